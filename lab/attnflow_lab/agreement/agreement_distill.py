"""The paper code's model for Tables 1-2: a Transformer distilled online from an LSTM.

The paper (Abnar & Zuidema 2020, §2) says it trains a 6-layer, 8-head Transformer
encoder of width 128 on verb number prediction. The code that produced Tables 1-2
(``samiraabnar/Reflect`` at commit ``d28ddd5``, notebook ``attention_flow.ipynb``)
loads a *student* of that shape that was distilled online from a 2-layer LSTM
*teacher* (embedding and hidden size 256): the teacher learns the task from the gold
labels while the student learns from the teacher's current predictions (weight 0.9,
temperature 1) and from the gold labels (weight 0.1), with heavy dropout on the
student (0.4 on the residual branches, 0.6 on the attention weights, 0.2 on the
embeddings). Such a student is less saturated than a model trained on the labels
alone. :func:`train_distilled_agreement_model` trains that pair on
:mod:`attnflow_lab.agreement.agreement`'s data, with attnflow's optimiser (AdamW,
warm-up and cosine decay) or, with ``optimiser="authors"``, the authors' own
(``Reflect`` at ``d28ddd5``, distillation config ``dstl_6_crs_slw``): Adam for the
student under TensorFlow's cosine decay with restarts (:func:`cosine_decay_restarts`),
RAdam for the teacher under an exponential decay, and their L2 penalties.

This module imports PyTorch.

References
----------
Abnar, S. & Zuidema, W. (2020). Quantifying attention flow in transformers. ACL 2020,
https://arxiv.org/abs/2005.00928.

Hinton, G., Vinyals, O. & Dean, J. (2015). Distilling the knowledge in a neural
network. https://arxiv.org/abs/1503.02531.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from attnflow_lab._atomic import write_atomically

from .agreement import AgreementData
from .agreement_torch import (
    AgreementConfig,
    AgreementTransformer,
    _batches,
    _bucketed_batches,
    _progress,
    _warmup_cosine,
    accuracy,
)

__all__ = [
    "AUTHORS_INITIALISER_RANGE",
    "AUTHORS_RECIPE",
    "AUTHORS_TEACHER_DROPOUT",
    "DISTILL_RATE",
    "TEMPERATURE",
    "LSTMTeacher",
    "cosine_decay_restarts",
    "student_config",
    "train_distilled_agreement_model",
]

DISTILL_RATE = 0.9
"""Weight of the teacher's predictions in the student's loss (the gold labels: 0.1)."""
TEMPERATURE = 1.0
"""Softmax temperature of the distillation."""

AUTHORS_RECIPE: dict[str, float] = {
    "lr": 1e-4,
    "first_decay_steps": 10_000,
    "t_mul": 5.0,
    "m_mul": 0.96,
    "alpha": 0.001,
    "teacher_decay_steps": 10_000,
    "teacher_decay_rate": 0.96,
    "student_l2": 1e-4,
    "teacher_l2": 1e-5,
    "eps": 1e-8,
}
"""The authors' optimisation of the distillation (``samiraabnar/Reflect`` at ``d28ddd5``).

``util/distill_params.py`` (``dstl_6_crs_slw``: learning rates 1e-4, student decay
steps 10,000, ``schedule: 'crs'``, student ``adam``, teacher ``radam``) with the
defaults of ``util/config_util.py`` (``DistillParams``: decay rates 0.96);
``distill/distiller.py`` (the student: ``tf.keras.experimental.CosineDecayRestarts``
with ``t_mul=5.0``, ``m_mul=student_decay_rate``, ``alpha=0.001``, no warm-up; Adam
with ``epsilon=1e-08``); ``distill/online_distiller.py`` (the teacher: RAdam with
``epsilon=1e-08`` under ``ExponentialDecayWithWarmpUp`` of ``tf2_models/train_utils.py``,
no warm-up, not staircase); the L2 penalties of ``tf2_models/transformers.py``
(``Bert``: 1e-4 times the sum of squares of the embeddings and of the blocks' dense
kernels and biases, not the LayerNorms nor the classifier) and
``tf2_models/lm_lstm.py`` (``ClassifierLSTM``: 1e-5 on every weight).
"""

AUTHORS_TEACHER_DROPOUT: dict[str, float] = {"input": 0.2, "hidden": 0.8}
"""The authors' teacher dropout (``small_lstm_v4`` in ``util/model_configs.py`` at ``d28ddd5``).

``ClassifierLSTM`` (``tf2_models/lm_lstm.py``) drops ``input_dropout_rate`` (0.2) of the
embeddings, and ``hidden_dropout_rate`` (0.8) three times: each Keras LSTM layer's
``dropout`` (its inputs) and ``recurrent_dropout`` (its previous state), one mask per
sentence shared by every time step, and the last layer's outputs before the classifier.
"""
AUTHORS_INITIALISER_RANGE = 0.05
"""The student's ``initializer_range`` (``small_gpt_v9``, ``util/model_configs.py``).

``get_initializer`` (``tf2_models/common_layers.py``) is Keras's ``TruncatedNormal``
with that standard deviation: a normal cut at two deviations, not rescaled.
"""

logger = logging.getLogger(__name__)


def cosine_decay_restarts(
    step: int,
    /,
    *,
    first_decay_steps: int,
    t_mul: float = 2.0,
    m_mul: float = 1.0,
    alpha: float = 0.0,
) -> float:
    r"""Return the factor of the initial learning rate at `step`: cosine decay with restarts.

    The schedule of ``tf.keras.experimental.CosineDecayRestarts`` (SGDR), computed as
    TensorFlow computes it. With :math:`f = s / T_0` the steps done in units of the
    first period :math:`T_0`, the period :math:`i` (from 0) lasts :math:`T_0 t^i`, so

    .. math::

        i = \left\lfloor \frac{\log(1 - f (1 - t))}{\log t} \right\rfloor, \quad
        c = \frac{f - (1 - t^i) / (1 - t)}{t^i}

    (:math:`i = \lfloor f \rfloor`, :math:`c = f - i` when :math:`t = 1`), and the
    factor is :math:`(1 - \alpha) \, \tfrac12 m^i (1 + \cos \pi c) + \alpha`, with
    :math:`t` = `t_mul` and :math:`m` = `m_mul`. It falls from 1 to :math:`\alpha` over
    the first :math:`T_0` steps, restarts at :math:`m (1 - \alpha) + \alpha`, and so on.
    Computed in float64; where the logarithm rounds across a restart at its very step
    (TensorFlow's float32 can land on either side), :math:`i` is corrected so that
    :math:`0 \le c < 1`.

    Parameters
    ----------
    step : int
        The optimiser's step, from 0 (TensorFlow evaluates the schedule at the
        optimiser's ``iterations`` before the update, as ``LambdaLR`` does).
    first_decay_steps : int
        :math:`T_0`, positive.
    t_mul : float, default 2.0
        :math:`t`, the growth of each period; positive.
    m_mul : float, default 1.0
        :math:`m`, the factor of each restart's peak; non-negative.
    alpha : float, default 0.0
        :math:`\alpha`, the floor of the factor, in [0, 1].

    Returns
    -------
    float
        The factor; the learning rate is the initial one times it.

    Raises
    ------
    ValueError
        If a setting is out of range.

    References
    ----------
    Loshchilov, I. & Hutter, F. (2017). SGDR: stochastic gradient descent with warm
    restarts. ICLR 2017, https://arxiv.org/abs/1608.03983.

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement_distill import cosine_decay_restarts
    >>> [round(cosine_decay_restarts(s, first_decay_steps=10, t_mul=5.0, m_mul=0.5), 3)
    ...  for s in (0, 5, 10, 35)]
    [1.0, 0.5, 0.5, 0.25]
    """
    given: object = step  # checked as given: a bool or float is refused
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        msg = f"`step` must be a non-negative int; got {step!r}."
        raise ValueError(msg)
    if first_decay_steps < 1 or not t_mul > 0 or not m_mul >= 0 or not 0 <= alpha <= 1:
        msg = (
            "need first_decay_steps >= 1, t_mul > 0, m_mul >= 0 and 0 <= alpha <= 1; got "
            f"{first_decay_steps=}, {t_mul=}, {m_mul=}, {alpha=}."
        )
        raise ValueError(msg)
    done = step / first_decay_steps
    if t_mul == 1.0:
        restart = math.floor(done)
        done -= restart
    else:
        fraction = done
        restart = math.floor(math.log(1.0 - fraction * (1.0 - t_mul)) / math.log(t_mul))
        done = (fraction - (1.0 - t_mul**restart) / (1.0 - t_mul)) / t_mul**restart
        # At a restart's very step the logarithm can round to either side (TensorFlow's
        # float32 too); keep the position inside its period, in [0, 1).
        while done >= 1.0 or done < 0.0:
            restart += 1 if done >= 1.0 else -1
            done = (fraction - (1.0 - t_mul**restart) / (1.0 - t_mul)) / t_mul**restart
    cosine = 0.5 * m_mul**restart * (1.0 + math.cos(math.pi * done))
    return (1.0 - alpha) * cosine + alpha


def _exponential_decay(step: int, /, *, decay_steps: int, rate: float) -> float:
    """Return the teacher's factor, ``rate ** (step / decay_steps)``.

    The authors' ``ExponentialDecayWithWarmpUp`` with no warm-up or hold, not staircase.
    """
    return float(rate ** (step / decay_steps))


def _authors_l2_parameters(student: nn.Module) -> list[nn.Parameter]:
    """Return the student's weights under the authors' L2.

    The embeddings and dense layers, not the LayerNorms nor the classifier (``Bert`` in
    ``tf2_models/transformers.py``).
    """
    classifier = getattr(student, "classifier", None)
    return [
        p
        for module in student.modules()
        if isinstance(module, nn.Linear | nn.Embedding) and module is not classifier
        for p in module.parameters(recurse=False)
    ]


def _authors_initialisation(student: nn.Module, teacher: LSTMTeacher) -> None:
    """Re-initialise both models as the authors' code does (``Reflect`` at ``d28ddd5``).

    The student (``Bert``, ``tf2_models/transformers.py``; ``Conv1D``,
    ``tf2_models/transformer_layers.py``; the classifier ``e2c`` of ``ClassifierBERT``,
    ``tf2_models/lm_transformer.py``): every embedding and dense
    kernel (the classifier's included) from a normal of deviation
    :data:`AUTHORS_INITIALISER_RANGE` cut at two deviations (Keras's
    ``TruncatedNormal``), biases 0, LayerNorms 1 and 0, no residual scaling. The teacher
    (``ClassifierLSTM``, ``tf2_models/lm_lstm.py``) passes no initialiser, so Keras's
    defaults: embeddings uniform on [-0.05, 0.05]; LSTM kernels Glorot-uniform,
    recurrent kernels orthogonal, bias 0 but 1 on the forget gate
    (``unit_forget_bias``; PyTorch's second bias 0); classifier Glorot-uniform, bias 0.
    """
    std = AUTHORS_INITIALISER_RANGE
    with torch.no_grad():
        for module in student.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.uniform_(teacher.embedding.weight, -0.05, 0.05)
        for name, weight in teacher.lstm.named_parameters():
            if name.startswith("weight_ih"):
                nn.init.xavier_uniform_(weight)
            elif name.startswith("weight_hh"):
                nn.init.orthogonal_(weight)
            else:
                nn.init.zeros_(weight)
                if name.startswith("bias_ih"):
                    width = weight.shape[0] // 4
                    weight[width : 2 * width] = 1.0
        nn.init.xavier_uniform_(teacher.classifier.weight)
        nn.init.zeros_(teacher.classifier.bias)


def student_config(vocab_size: int, /) -> AgreementConfig:
    """Return the paper code's student: 6 x 8 x 128, dropout 0.4 / 0.6 / 0.2.

    Parameters
    ----------
    vocab_size : int
        Number of token ids.

    Returns
    -------
    AgreementConfig
        Dropout 0.4 on the residual branches, 0.6 on the attention weights and 0.2 on
        the embeddings (``small_gpt_v9`` in the authors' ``util/model_configs.py``).

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement_distill import student_config
    >>> config = student_config(300)
    >>> config.n_layers, config.n_heads, config.hidden, config.attention_dropout
    (6, 8, 128, 0.6)
    """
    return AgreementConfig(
        vocab_size=vocab_size, dropout=0.4, attention_dropout=0.6, embedding_dropout=0.2
    )


class LSTMTeacher(nn.Module):
    """An LSTM classifier of verb number: the teacher of the distillation.

    Token embeddings, a stacked unidirectional LSTM, and a linear classifier on the
    hidden state at the last real token of each (right-padded) sentence.

    Parameters
    ----------
    vocab_size : int
        Number of token ids.
    hidden : int, default 256
        Embedding and hidden size (the authors' ``em-256_h-256``).
    n_layers : int, default 2
        LSTM layers (``d-2``).
    dropout : float, default 0.1
        Dropout on the embeddings (unless `input_dropout` is given), between the layers
        and on the final state (ours); with `variational`, the LSTM's and the final
        state's rate (the authors' ``hidden_dropout_rate``, 0.8).
    n_classes : int, default 2
        Output classes.
    input_dropout : float, optional
        Dropout on the embeddings; None uses `dropout` (the authors': 0.2).
    variational : bool, default False
        Drop as Keras's LSTM layers do with ``dropout`` and ``recurrent_dropout`` both
        `dropout` (the authors' ``ClassifierLSTM``, :data:`AUTHORS_TEACHER_DROPOUT`):
        in each layer, one mask per sentence on its inputs and one on its previous
        hidden state, shared by all time steps (Gal & Ghahramani 2016), then `dropout`
        on the last layer's outputs. Training then runs the recurrence step by step;
        evaluation (no dropout) uses the same weights through ``torch.nn.LSTM``.

    Examples
    --------
    >>> import torch
    >>> from attnflow_lab.agreement.agreement_distill import LSTMTeacher
    >>> _ = torch.manual_seed(0)
    >>> teacher = LSTMTeacher(10, hidden=8).eval()
    >>> ids = torch.tensor([[1, 4, 5, 0], [1, 3, 0, 0]])
    >>> mask = ids != 0
    >>> teacher(ids, mask).shape
    torch.Size([2, 2])
    >>> torch.allclose(teacher(ids[1:, :2]), teacher(ids, mask)[1:])  # padding is ignored
    True
    """

    def __init__(
        self,
        vocab_size: int,
        /,
        *,
        hidden: int = 256,
        n_layers: int = 2,
        dropout: float = 0.1,
        n_classes: int = 2,
        input_dropout: float | None = None,
        variational: bool = False,
    ) -> None:
        super().__init__()
        sizes: tuple[tuple[str, object], ...] = (
            ("vocab_size", vocab_size),
            ("hidden", hidden),
            ("n_layers", n_layers),
        )
        for name, value in sizes:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive int; got {value!r}."
                raise ValueError(msg)
        rates: tuple[tuple[str, object], ...] = (
            ("dropout", dropout),
            ("input_dropout", 0.0 if input_dropout is None else input_dropout),
        )
        for name, rate in rates:
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
                msg = f"`{name}` must be a number in [0, 1); got {rate!r}."
                raise ValueError(msg)
        flag: object = variational
        if not isinstance(flag, bool):
            msg = f"`variational` must be a bool; got {variational!r}."
            raise TypeError(msg)
        self.variational = variational
        self.hidden_dropout = float(dropout)
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.input_drop = nn.Dropout(dropout if input_dropout is None else input_dropout)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(
            hidden,
            hidden,
            num_layers=n_layers,
            batch_first=True,
            dropout=0.0 if variational else dropout,
        )
        self.classifier = nn.Linear(hidden, n_classes)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Class logits ``(batch, n_classes)`` from the state at each last real token.

        Parameters
        ----------
        input_ids : Tensor of int64, shape (batch, n)
            Token ids, right-padded.
        attention_mask : Tensor, shape (batch, n), optional
            True (or 1) for real tokens; None: no padding.

        Returns
        -------
        Tensor of float, shape (batch, n_classes)
            The logits.
        """
        embedded = self.input_drop(self.embedding(input_ids))
        if self.variational and self.training and self.hidden_dropout > 0:
            states = self._variational_states(embedded)
        else:
            states, _ = self.lstm(embedded)
        batch, n = input_ids.shape
        if attention_mask is None:
            last = torch.full((batch,), n - 1, dtype=torch.long, device=input_ids.device)
        else:
            last = attention_mask.to(torch.long).sum(dim=1).clamp(min=1) - 1
        final = states[torch.arange(batch, device=input_ids.device), last]
        return self.classifier(self.drop(final))  # type: ignore[no-any-return]

    def _variational_states(self, x: torch.Tensor) -> torch.Tensor:
        """Return the LSTM's outputs under Keras's ``dropout`` = ``recurrent_dropout`` = p.

        For each layer, one Bernoulli mask per sentence on the layer's inputs and one on
        its previous hidden state (scaled by ``1 / (1 - p)``), the same at every time
        step; gates i, f, g, o as ``torch.nn.LSTM`` (and Keras) order them.
        """
        keep = 1.0 - self.hidden_dropout
        batch, n, _ = x.shape
        for layer in range(self.lstm.num_layers):
            w_ih = getattr(self.lstm, f"weight_ih_l{layer}")
            w_hh = getattr(self.lstm, f"weight_hh_l{layer}")
            bias = getattr(self.lstm, f"bias_ih_l{layer}") + getattr(self.lstm, f"bias_hh_l{layer}")
            width = w_hh.shape[1]
            inputs_mask = x.new_empty(batch, 1, x.shape[-1]).bernoulli_(keep) / keep
            state_mask = x.new_empty(batch, width).bernoulli_(keep) / keep
            projected = F.linear(x * inputs_mask, w_ih, bias)
            h = x.new_zeros(batch, width)
            c = x.new_zeros(batch, width)
            outputs = []
            for t in range(n):
                gates = projected[:, t] + F.linear(h * state_mask, w_hh)
                i, f, g, o = gates.chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outputs.append(h)
            x = torch.stack(outputs, dim=1)
        return x


def train_distilled_agreement_model(
    train: AgreementData,
    /,
    *,
    seed: int,
    config: AgreementConfig | None = None,
    teacher_hidden: int = 256,
    teacher_layers: int = 2,
    distill_rate: float = DISTILL_RATE,
    temperature: float = TEMPERATURE,
    epochs: int = 5,
    batch_size: int = 64,
    optimiser: Literal["adamw", "authors"] = "adamw",
    initialisation: Literal["ours", "authors"] = "ours",
    teacher_dropout: Literal["ours", "authors"] = "ours",
    lr: float | None = None,
    warmup: float | None = None,
    clip: float | None = None,
    validation: AgreementData | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    checkpoint: str | os.PathLike[str] | None = None,
    on_epoch: Callable[[int, AgreementTransformer, LSTMTeacher], object] | None = None,
) -> tuple[AgreementTransformer, LSTMTeacher]:
    r"""Train an LSTM teacher and distil it online into an :class:`AgreementTransformer`.

    At every step, on the same batch, the teacher takes a step on the cross-entropy with
    the gold labels, and the student on

    .. math::

        \mathcal L = r \, T^2 \, \mathrm{CE}\big(\mathrm{softmax}(t / T),
        \mathrm{softmax}(s / T)\big) + (1 - r) \, \mathrm{CE}(y, \mathrm{softmax}(s)),

    with :math:`t, s` the teacher's (detached) and the student's logits, :math:`r` the
    distillation rate and :math:`T` the temperature (online distillation as in the
    paper's code, ``Reflect/distill``). With ``optimiser="adamw"`` both use AdamW with
    the schedule of :func:`~attnflow_lab.agreement.agreement_torch.train_agreement_model`
    (linear warmup, cosine decay) and gradient clipping. With ``optimiser="authors"``
    they use the authors' optimisation (:data:`AUTHORS_RECIPE`): the student Adam at
    :math:`\eta = 10^{-4}` times :func:`cosine_decay_restarts` (first period 10,000
    steps, ``t_mul`` 5, ``m_mul`` 0.96, ``alpha`` 0.001), the teacher RAdam at
    :math:`10^{-4} \cdot 0.96^{s / 10000}` at step :math:`s`, both with
    :math:`\epsilon = 10^{-8}`, no warm-up and no clipping, and the authors' L2
    penalties added to the losses (:math:`10^{-4} \sum w^2` over the student's
    embeddings and dense layers, :math:`10^{-5} \sum w^2` over all the teacher's
    weights). ``torch.manual_seed(seed)`` seeds the weights, the dropout and the batch
    order.

    Parameters
    ----------
    train : AgreementData
        The training sentences.
    seed : int
        The seed of PyTorch's generator.
    config : AgreementConfig, optional
        The student; :func:`student_config` by default.
    teacher_hidden, teacher_layers : int, default 256, 2
        The teacher's size.
    distill_rate : float, default 0.9
        :math:`r`, in [0, 1].
    temperature : float, default 1.0
        :math:`T`, positive.
    epochs, batch_size
        As for :func:`~attnflow_lab.agreement.agreement_torch.train_agreement_model`.
    optimiser : {"adamw", "authors"}, default "adamw"
        attnflow's optimisation, or the authors' (above).
    initialisation : {"ours", "authors"}, default "ours"
        GPT-2's initialisation of the student (deviation 0.02) and PyTorch's of the
        teacher, or the authors' (:func:`_authors_initialisation`: a normal of deviation
        0.05 cut at two deviations for the student, Keras's defaults for the teacher).
    teacher_dropout : {"ours", "authors"}, default "ours"
        The teacher's dropout: 0.1 (ours), or the authors'
        (:data:`AUTHORS_TEACHER_DROPOUT`: 0.2 on the embeddings, 0.8 variational on
        each LSTM layer's inputs and recurrent state and on its final state).
    lr : float, optional
        The peak learning rate: 1e-3 for ``"adamw"``, 1e-4 for ``"authors"`` by default.
    warmup : float, optional
        The warm-up's share of the steps under ``"adamw"`` (0.05 by default); the
        authors' schedules have none, so ``"authors"`` takes no `warmup`.
    clip : float, optional
        The largest norm of all the gradients of a model together (rescaled above it):
        1.0 under ``"adamw"`` by default, none under ``"authors"`` by default (their
        ``clipnorm=1.0`` is inert where their loop applies the gradients: see
        ``docs/reproduction.md``, the sixth run).
    validation : AgreementData, optional
        Sentences whose accuracy (student and teacher) is logged after every epoch; it
        never steers training.
    device : str or torch.device, default "cpu"
        Where to train.
    progress : bool, default True
        Show a tqdm bar if tqdm is installed; one line per epoch is always logged at
        level INFO.
    checkpoint : str or path-like, optional
        A file holding the whole training state (both models, both optimisers and
        schedulers, PyTorch's generator and the batch shuffler), written atomically at
        the end of every epoch. If it exists when training starts, training continues
        after its last epoch, so a killed run resumed from it ends with the very
        weights of an uninterrupted one. The file records the settings that fix the
        run (seed, sizes, epochs, schedule); resuming under other settings is refused,
        but for the number of epochs under ``optimiser="authors"``: its schedules depend
        on the step alone, so a finished run's file extends it to more `epochs`, with
        the very weights of a run that long from the start.
    on_epoch : callable, optional
        Called as ``on_epoch(epoch, student, teacher)`` after every epoch (1-based) and
        after its checkpoint is written, with both models in evaluation mode (training
        puts them back in training mode); epochs done before a resume are not called
        again.

    Returns
    -------
    student : AgreementTransformer
        In evaluation mode.
    teacher : LSTMTeacher
        In evaluation mode.

    Raises
    ------
    ValueError
        If `train` is empty, a setting is out of range, or `checkpoint` holds another
        run's state or more epochs than `epochs`.

    References
    ----------
    Abnar & Zuidema (2020), §2; Hinton, Vinyals & Dean (2015).

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import agreement_data
    >>> from attnflow_lab.agreement.agreement_distill import train_distilled_agreement_model
    >>> from attnflow_lab.agreement.agreement_torch import AgreementConfig
    >>> data = agreement_data(64, seed=0)
    >>> tiny = AgreementConfig(len(data.vocabulary), n_layers=1, n_heads=2, hidden=16)
    >>> student, teacher = train_distilled_agreement_model(
    ...     data, seed=0, config=tiny, teacher_hidden=16, epochs=1, progress=False)
    >>> student.training, teacher.training
    (False, False)
    """
    if len(train) == 0:
        msg = "`train` has no sentences."
        raise ValueError(msg)
    if not 0.0 <= distill_rate <= 1.0 or not temperature > 0:
        msg = (
            "`distill_rate` must lie in [0, 1] and `temperature` be positive; got "
            f"{distill_rate=}, {temperature=}."
        )
        raise ValueError(msg)
    if optimiser not in ("adamw", "authors"):
        msg = f"`optimiser` must be 'adamw' or 'authors'; got {optimiser!r}."
        raise ValueError(msg)
    if optimiser == "authors" and warmup is not None:
        msg = (
            f"`warmup` does not apply to optimiser='authors' (their schedules have no "
            f"warm-up); got {warmup=}. Leave it out, or use optimiser='adamw'."
        )
        raise ValueError(msg)
    for name, value in (("initialisation", initialisation), ("teacher_dropout", teacher_dropout)):
        if value not in ("ours", "authors"):
            msg = f"`{name}` must be 'ours' or 'authors'; got {value!r}."
            raise ValueError(msg)
    authors = optimiser == "authors"
    if lr is None:
        lr = AUTHORS_RECIPE["lr"] if authors else 1e-3
    if warmup is None:
        warmup = 0.0 if authors else 0.05
    if clip is None and not authors:
        clip = 1.0
    if (
        epochs < 1
        or batch_size < 1
        or not lr > 0
        or not 0 <= warmup < 1
        or (clip is not None and not clip > 0)
    ):
        msg = (
            "need epochs >= 1, batch_size >= 1, lr > 0, 0 <= warmup < 1 and clip > 0; got "
            f"{epochs=}, {batch_size=}, {lr=}, {warmup=}, {clip=}."
        )
        raise ValueError(msg)
    if config is None:
        config = student_config(len(train.vocabulary))
    if train.ids.shape[1] > config.n_positions:
        msg = f"sentences of {train.ids.shape[1]} tokens exceed n_positions={config.n_positions}."
        raise ValueError(msg)
    target = torch.device(device)
    torch.manual_seed(seed)
    student = AgreementTransformer(config).to(target)
    dropouts: dict[str, Any] = {}
    if teacher_dropout == "authors":
        dropouts = {
            "dropout": AUTHORS_TEACHER_DROPOUT["hidden"],
            "input_dropout": AUTHORS_TEACHER_DROPOUT["input"],
            "variational": True,
        }
    teacher = LSTMTeacher(
        config.vocab_size, hidden=teacher_hidden, n_layers=teacher_layers, **dropouts
    ).to(target)
    if initialisation == "authors":
        _authors_initialisation(student, teacher)
    total = epochs * math.ceil(len(train) / batch_size)
    penalties: list[tuple[float, list[nn.Parameter]]] = [(0.0, []), (0.0, [])]
    if authors:
        recipe = AUTHORS_RECIPE
        betas = (0.9, 0.999)  # the Keras Adam's and TF-Addons RAdam's defaults
        optimisers: list[torch.optim.Optimizer] = [
            torch.optim.Adam(student.parameters(), lr=lr, betas=betas, eps=recipe["eps"]),
            torch.optim.RAdam(teacher.parameters(), lr=lr, betas=betas, eps=recipe["eps"]),
        ]
        schedules: list[Callable[[int], float]] = [
            functools.partial(
                cosine_decay_restarts,
                first_decay_steps=int(recipe["first_decay_steps"]),
                t_mul=recipe["t_mul"],
                m_mul=recipe["m_mul"],
                alpha=recipe["alpha"],
            ),
            functools.partial(
                _exponential_decay,
                decay_steps=int(recipe["teacher_decay_steps"]),
                rate=recipe["teacher_decay_rate"],
            ),
        ]
        penalties = [
            (recipe["student_l2"], _authors_l2_parameters(student)),
            (recipe["teacher_l2"], list(teacher.parameters())),
        ]
    else:
        optimisers = [
            torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
            for model in (student, teacher)
        ]
        schedules = [_warmup_cosine(total, warmup)] * 2
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(o, schedule)
        for o, schedule in zip(optimisers, schedules, strict=True)
    ]
    shuffler = torch.Generator().manual_seed(seed)
    run = {
        "seed": seed,
        "sentences": len(train),
        "vocab_size": config.vocab_size,
        "config": repr(config),
        "teacher": [teacher_hidden, teacher_layers],
        "distill_rate": distill_rate,
        "temperature": temperature,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "warmup": warmup,
        "clip": clip,
    }
    if authors:  # recorded only here, so that the earlier runs' states still resume
        run["optimiser"] = {"name": optimiser, **AUTHORS_RECIPE}
    if initialisation != "ours":  # likewise
        run["initialisation"] = {"name": initialisation, "student": AUTHORS_INITIALISER_RANGE}
    if teacher_dropout != "ours":
        run["teacher_dropout"] = {"name": teacher_dropout, **AUTHORS_TEACHER_DROPOUT}
    done = 0
    if checkpoint is not None and Path(checkpoint).exists():
        done = _resume(Path(checkpoint), run, student, teacher, optimisers, schedulers, shuffler)
        logger.info("resumed from %s after epoch %d of %d", checkpoint, done, epochs)
    bar = _progress(total, progress)
    if bar is not None and done:
        bar.update(done * math.ceil(len(train) / batch_size))
    started = time.perf_counter()
    try:
        for epoch in range(done + 1, epochs + 1):
            student.train()
            teacher.train()
            batches = _bucketed_batches(train, batch_size, shuffler)
            sums = [0.0, 0.0]
            for ids, mask, labels in _batches(train, batches, target):
                teacher_logits = teacher(ids, mask)
                teacher_loss = F.cross_entropy(teacher_logits, labels)
                soft = F.softmax(teacher_logits.detach() / temperature, dim=-1)
                student_logits = student(ids, mask)
                distilled = -(soft * F.log_softmax(student_logits / temperature, dim=-1))
                student_loss = distill_rate * temperature**2 * distilled.sum(-1).mean() + (
                    1 - distill_rate
                ) * F.cross_entropy(student_logits, labels)
                for model, step_optimiser, scheduler, loss, (l2, weights) in zip(
                    (student, teacher),
                    optimisers,
                    schedulers,
                    (student_loss, teacher_loss),
                    penalties,
                    strict=True,
                ):
                    objective = loss
                    if l2:
                        objective = loss + l2 * sum(w.square().sum() for w in weights)
                    step_optimiser.zero_grad(set_to_none=True)
                    objective.backward()  # type: ignore[no-untyped-call]
                    if clip is not None:
                        nn.utils.clip_grad_norm_(model.parameters(), clip)
                    step_optimiser.step()
                    scheduler.step()
                sums[0] += float(student_loss.detach()) * len(labels)
                sums[1] += float(teacher_loss.detach()) * len(labels)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        epoch=epoch,
                        student=f"{float(student_loss.detach()):.3f}",
                        teacher=f"{float(teacher_loss.detach()):.3f}",
                    )
            message = (
                f"epoch {epoch}/{epochs}: student loss {sums[0] / len(train):.4f}, "
                f"teacher loss {sums[1] / len(train):.4f}"
            )
            if validation is not None and len(validation):
                student.eval()
                teacher.eval()
                message += (
                    f", validation accuracy student {accuracy(student, validation):.4f} "
                    f"teacher {_teacher_accuracy(teacher, validation, target):.4f}"
                )
            message += f" ({time.perf_counter() - started:.0f} s)"
            logger.info(message)
            if checkpoint is not None:
                _save_state(
                    Path(checkpoint), run, epoch, student, teacher, optimisers, schedulers, shuffler
                )
            if on_epoch is not None:
                student.eval()
                teacher.eval()
                on_epoch(epoch, student, teacher)
    finally:
        if bar is not None:
            bar.close()
    return student.eval(), teacher.eval()


def _save_state(
    path: Path,
    run: dict[str, Any],
    epoch: int,
    student: nn.Module,
    teacher: nn.Module,
    optimisers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR],
    shuffler: torch.Generator,
) -> None:
    """Write the training state after `epoch` to `path` atomically (replacing the last)."""
    state = {
        "run": run,
        "epoch": epoch,
        "student": student.state_dict(),
        "teacher": teacher.state_dict(),
        "optimisers": [o.state_dict() for o in optimisers],
        "schedulers": [s.state_dict() for s in schedulers],
        "torch_rng": torch.get_rng_state(),
        "shuffler": shuffler.get_state(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(
        path,
        lambda file: torch.save(state, file),
        replace=True,
        exists=FileExistsError,
        mode=None,
    )


def _resume(
    path: Path,
    run: dict[str, Any],
    student: nn.Module,
    teacher: nn.Module,
    optimisers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR],
    shuffler: torch.Generator,
) -> int:
    """Load the training state of `path` into the run; return the epochs it had done."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = dict(state.get("run", {}))
    asked = dict(run)
    if asked.get("optimiser", {}).get("name") == "authors":
        # The authors' schedules depend on the step alone, so a run may be extended:
        # its first epochs are those of a longer run with the same settings.
        saved.pop("epochs", None)
        asked.pop("epochs")
    if saved != asked:
        diff = {
            k: (saved.get(k), asked.get(k))
            for k in (*asked, *(k for k in saved if k not in asked))
            if saved.get(k) != asked.get(k)
        }
        msg = (
            f"`checkpoint` {str(path)!r} holds another run's state (saved vs asked: {diff}); "
            "pass the settings it was saved with, or another file to start afresh."
        )
        raise ValueError(msg)
    if int(state["epoch"]) > run["epochs"]:
        msg = (
            f"`checkpoint` {str(path)!r} holds {int(state['epoch'])} epochs, more than the "
            f"epochs={run['epochs']} asked; ask for at least {int(state['epoch'])} epochs, "
            "or pass another file to start afresh."
        )
        raise ValueError(msg)
    student.load_state_dict(state["student"])
    teacher.load_state_dict(state["teacher"])
    for optimiser, saved in zip(optimisers, state["optimisers"], strict=True):
        optimiser.load_state_dict(saved)
    for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    torch.set_rng_state(state["torch_rng"])
    shuffler.set_state(state["shuffler"])
    return int(state["epoch"])


@torch.no_grad()
def _teacher_accuracy(teacher: LSTMTeacher, data: AgreementData, device: torch.device) -> float:
    ids = torch.tensor(data.ids, device=device)  # copies: the data's arrays are read-only
    mask = torch.tensor(data.mask, device=device)
    labels = torch.tensor(data.labels, device=device)
    return float((teacher(ids, mask).argmax(-1) == labels).float().mean())
