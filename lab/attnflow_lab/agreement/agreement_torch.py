"""The verb number model of Abnar & Zuidema (2020), its training, saving and loading.

The paper (§2): "We train a Transformer encoder, with GPT-2 Transformer blocks [...]
(without masking). The model has 6 layers, and 8 heads, with hidden/embedding size of
128. Similar to Bert we add a CLS token and use its embedding in the final layer as the
input to the classifier." :class:`AgreementTransformer` is that model:

* token embeddings plus learned position embeddings (dropout after their sum);
* GPT-2 blocks with pre-LayerNorm: ``x + attn(LN(x))`` then ``x + mlp(LN(x))``, the MLP
  4x wide with GELU (tanh approximation, as GPT-2), dropout on the attention weights
  and on both residual branches; no causal mask: every token sees every real token;
* a final LayerNorm and a linear classifier (2 classes) on the final ``[CLS]`` state.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention``, looked up
as ``F.scaled_dot_product_attention`` at every call, with the padding mask as a boolean
``attn_mask`` over the keys: :func:`attnflow.adapters.torch.capture` records the weights
by replacing that function while the model runs. ``get_input_embeddings()`` returns the
token embedding module (the Hugging Face convention), whose output is where input
gradients are taken; position embeddings are added after it.

Models are saved as a ``weights.npz`` (``numpy.savez`` of the state dict, no pickle) and
a ``config.json``; see :func:`save_agreement_model`.

References
----------
Abnar, S. & Zuidema, W. (2020). Quantifying attention flow in transformers. ACL 2020,
https://arxiv.org/abs/2005.00928.

Radford, A. et al. (2019). Language models are unsupervised multitask learners.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import ArrayLike, NDArray
from torch import nn

from attnflow_lab._atomic import write_atomically

from .agreement import AgreementData

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "AgreementConfig",
    "AgreementTransformer",
    "accuracy",
    "load_agreement_model",
    "paper_input_gradients",
    "predict",
    "save_agreement_model",
    "train_agreement_model",
]

WEIGHTS_FILE = "weights.npz"
"""Name of the weights file in a saved model's folder."""
CONFIG_FILE = "config.json"
"""Name of the configuration file in a saved model's folder."""
_FORMAT = "attnflow-agreement-transformer"
_FORMAT_VERSION = 1

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgreementConfig:
    """Sizes of an :class:`AgreementTransformer` (defaults: the paper's model).

    Parameters
    ----------
    vocab_size : int
        Number of token ids.
    n_positions : int, default 64
        Longest input, ``[CLS]`` included.
    n_layers : int, default 6
        Transformer blocks.
    n_heads : int, default 8
        Attention heads per block; must divide `hidden`.
    hidden : int, default 128
        Width of the embeddings and hidden states.
    dropout : float, default 0.1
        Dropout on the embeddings, the attention weights and the residual branches
        (active in training mode only).
    n_classes : int, default 2
        Output classes (singular, plural).
    attention_dropout, embedding_dropout : float, optional
        Dropout on the attention weights and on the summed embeddings, when they differ
        from `dropout` (which then applies to the residual branches only). None uses
        `dropout`. The paper code's distilled student uses 0.4 (residual), 0.6
        (attention) and 0.2 (embedding): :func:`~attnflow_lab.agreement.agreement_distill.
        student_config`.

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement_torch import AgreementConfig
    >>> AgreementConfig(vocab_size=280).n_layers
    6
    """

    vocab_size: int
    n_positions: int = 64
    n_layers: int = 6
    n_heads: int = 8
    hidden: int = 128
    dropout: float = 0.1
    n_classes: int = 2
    attention_dropout: float | None = None
    embedding_dropout: float | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in ("attention_dropout", "embedding_dropout"):
                if value is not None and (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not 0.0 <= value < 1.0
                ):
                    msg = f"`{field.name}` must be None or a number in [0, 1); got {value!r}."
                    raise ValueError(msg)
            elif field.name == "dropout":
                if not isinstance(value, int | float) or not 0.0 <= value < 1.0:
                    msg = f"`dropout` must be a number in [0, 1); got {value!r}."
                    raise ValueError(msg)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{field.name}` must be a positive int; got {value!r}."
                raise ValueError(msg)
        if self.hidden % self.n_heads:
            msg = f"`n_heads` ({self.n_heads}) must divide `hidden` ({self.hidden})."
            raise ValueError(msg)


class _SelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: AgreementConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = (
            config.dropout if config.attention_dropout is None else config.attention_dropout
        )
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        batch, n, width = x.shape
        q, k, v = (
            part.view(batch, n, self.n_heads, width // self.n_heads).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=-1)
        )
        # Looked up at call time, so that attnflow's torch adapter can capture the weights.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0
        )
        out = out.transpose(1, 2).reshape(batch, n, width)
        return self.resid_dropout(self.proj(out))  # type: ignore[no-any-return]


class _Block(nn.Module):
    """A GPT-2 block (pre-LayerNorm), here without a causal mask."""

    def __init__(self, config: AgreementConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.attn = _SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden, 4 * config.hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * config.hidden, config.hidden),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class AgreementTransformer(nn.Module):
    """Transformer encoder of GPT-2 blocks that classifies from its final ``[CLS]`` state.

    Parameters
    ----------
    config : AgreementConfig
        The sizes; ``AgreementConfig(vocab_size=len(VOCABULARY))`` is the paper's model.

    Attributes
    ----------
    config : AgreementConfig
        The sizes.
    token_embedding, position_embedding : torch.nn.Embedding
        Token and learned position embeddings; their sum is the first hidden state.
    blocks : torch.nn.ModuleList
        The transformer blocks (pre-LayerNorm GPT-2 blocks without causal masking).
    ln_f : torch.nn.LayerNorm
        The final LayerNorm.
    classifier : torch.nn.Linear
        Maps the final ``[CLS]`` state to the class logits.

    Notes
    -----
    Weights are initialised as GPT-2's: normal with standard deviation 0.02, the output
    projection of each residual branch scaled by ``1 / sqrt(2 * n_layers)``, zero biases.
    Position 0 is taken to be ``[CLS]``.

    Examples
    --------
    >>> import torch
    >>> from attnflow_lab.agreement.agreement import VOCABULARY, encode
    >>> from attnflow_lab.agreement.agreement_torch import AgreementConfig, AgreementTransformer
    >>> _ = torch.manual_seed(0)
    >>> model = AgreementTransformer(AgreementConfig(vocab_size=len(VOCABULARY))).eval()
    >>> ids = torch.from_numpy(encode("the key to the cabinets"))[None]
    >>> model(ids).shape
    torch.Size([1, 2])
    >>> model.get_input_embeddings() is model.token_embedding
    True
    """

    def __init__(self, config: AgreementConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embedding = nn.Embedding(config.n_positions, config.hidden)
        self.drop = nn.Dropout(
            config.dropout if config.embedding_dropout is None else config.embedding_dropout
        )
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.classifier = nn.Linear(config.hidden, config.n_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        scaled = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            assert isinstance(block, _Block)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=scaled)
            last = block.mlp[2]
            assert isinstance(last, nn.Linear)
            nn.init.normal_(last.weight, mean=0.0, std=scaled)

    def get_input_embeddings(self) -> nn.Embedding:
        """Return the token embedding module (input gradients are taken at its output).

        Returns
        -------
        torch.nn.Embedding
            ``self.token_embedding``.
        """
        return self.token_embedding

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Class logits of a batch of token ids.

        Parameters
        ----------
        input_ids : Tensor of int64, shape (batch, n)
            Token ids, ``[CLS]`` at position 0; ``n <= config.n_positions``.
        attention_mask : Tensor, shape (batch, n), optional
            1 (or True) for real tokens, 0 for padding; padded keys get no attention.
            None: every position is a real token.

        Returns
        -------
        Tensor of float, shape (batch, n_classes)
            The logits (class 0: singular, 1: plural).
        """
        n = input_ids.shape[-1]
        if n > self.config.n_positions:
            msg = f"inputs of {n} tokens exceed n_positions={self.config.n_positions}."
            raise ValueError(msg)
        positions = torch.arange(n, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        x = self.drop(x)
        keep = None
        if attention_mask is not None:
            keep = attention_mask.to(device=input_ids.device, dtype=torch.bool)[:, None, None, :]
        for block in self.blocks:
            x = block(x, keep)
        return self.classifier(self.ln_f(x[:, 0]))  # type: ignore[no-any-return]


# -- training ------------------------------------------------------------------------------------
def _batches(
    data: AgreementData, batches: Iterable[NDArray[np.int64]], device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Tensors of the given batches of sentences, each cut to its longest sentence."""
    lengths = data.lengths
    for index in batches:
        width = int(lengths[index].max())
        yield (
            torch.from_numpy(data.ids[index, :width]).to(device),
            torch.from_numpy(data.mask[index, :width]).to(device),
            torch.from_numpy(data.labels[index]).to(device),
        )


def _consecutive(count: int, batch_size: int) -> Iterator[NDArray[np.int64]]:
    for start in range(0, count, batch_size):
        yield np.arange(start, min(start + batch_size, count), dtype=np.int64)


def _bucketed_batches(
    data: AgreementData, batch_size: int, generator: torch.Generator
) -> list[NDArray[np.int64]]:
    """Shuffled batches of sentences of similar length (less padding).

    The sentences are shuffled, cut into pools of 50 batches, each pool is sorted by
    length and cut into batches, and the batches are shuffled.
    """
    order = torch.randperm(len(data), generator=generator).numpy()
    lengths = data.lengths
    pool = 50 * batch_size
    batches: list[NDArray[np.int64]] = []
    for start in range(0, len(order), pool):
        chunk = order[start : start + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def _progress(total: int, enabled: bool) -> Any:
    """Make a tqdm bar over `total` steps if tqdm is installed and `enabled`, else None."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="training", unit="step", leave=False)


def train_agreement_model(
    train: AgreementData,
    /,
    *,
    seed: int,
    config: AgreementConfig | None = None,
    epochs: int = 5,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    warmup: float = 0.05,
    clip: float = 1.0,
    validation: AgreementData | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> AgreementTransformer:
    """Train an :class:`AgreementTransformer` on the verb number task.

    Cross-entropy on the ``[CLS]`` logits, AdamW, a linear warmup over the first
    `warmup` fraction of the steps and then a cosine decay to 0, gradient clipping,
    shuffled mini-batches each cut to its longest sentence. ``torch.manual_seed(seed)``
    seeds the weights, the dropout and the order of the batches.

    Parameters
    ----------
    train : AgreementData
        The training sentences.
    seed : int
        The seed of PyTorch's generator.
    config : AgreementConfig, optional
        The model's sizes; the paper's (6 layers, 8 heads, width 128) by default, with
        ``vocab_size = len(train.vocabulary)``.
    epochs : int, default 5
        Passes over `train`.
    batch_size : int, default 64
        Sentences per step.
    lr : float, default 1e-3
        Peak learning rate.
    weight_decay : float, default 0.01
        AdamW's decoupled weight decay (not applied to biases, LayerNorms, embeddings).
    warmup : float, default 0.05
        Fraction of the steps spent warming up.
    clip : float, default 1.0
        Largest gradient norm.
    validation : AgreementData, optional
        Sentences whose accuracy is logged after every epoch (it never steers training).
    device : str or torch.device, default "cpu"
        Where to train.
    progress : bool, default True
        Show a tqdm progress bar if tqdm is installed. One line per epoch is always
        logged at level INFO on the logger of this module.

    Returns
    -------
    AgreementTransformer
        The trained model, in evaluation mode.

    Raises
    ------
    ValueError
        If `train` is empty or a setting is out of range.

    References
    ----------
    Abnar & Zuidema (2020), §2: the model and task; Loshchilov & Hutter (2019) for
    AdamW.

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import agreement_data
    >>> from attnflow_lab.agreement.agreement_torch import AgreementConfig, train_agreement_model
    >>> data = agreement_data(64, seed=0)
    >>> tiny = AgreementConfig(len(data.vocabulary), n_layers=1, n_heads=2, hidden=16)
    >>> model = train_agreement_model(data, seed=0, config=tiny, epochs=1, progress=False)
    >>> model.training
    False
    """
    if len(train) == 0:
        msg = "`train` has no sentences."
        raise ValueError(msg)
    if epochs < 1 or batch_size < 1 or lr <= 0 or not 0 <= warmup < 1 or clip <= 0:
        msg = (
            "need epochs >= 1, batch_size >= 1, lr > 0, 0 <= warmup < 1 and clip > 0; got "
            f"{epochs=}, {batch_size=}, {lr=}, {warmup=}, {clip=}."
        )
        raise ValueError(msg)
    if config is None:
        config = AgreementConfig(vocab_size=len(train.vocabulary))
    if train.ids.shape[1] > config.n_positions:
        msg = f"sentences of {train.ids.shape[1]} tokens exceed n_positions={config.n_positions}."
        raise ValueError(msg)
    target = torch.device(device)
    torch.manual_seed(seed)
    model = AgreementTransformer(config).to(target)

    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, parameter in model.named_parameters():
        is_matrix = parameter.ndim >= 2 and "embedding" not in name
        (decay if is_matrix else no_decay).append(parameter)
    optimiser = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
    )
    total = epochs * math.ceil(len(train) / batch_size)
    schedule = _warmup_cosine(total, warmup)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, schedule)
    shuffler = torch.Generator().manual_seed(seed)
    bar = _progress(total, progress)
    started = time.perf_counter()
    try:
        for epoch in range(1, epochs + 1):
            model.train()
            batches = _bucketed_batches(train, batch_size, shuffler)
            loss_sum, correct = 0.0, 0
            for ids, mask, labels in _batches(train, batches, target):
                logits = model(ids, mask)
                loss = F.cross_entropy(logits, labels)
                optimiser.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimiser.step()
                scheduler.step()
                loss_sum += float(loss.detach()) * len(labels)
                correct += int((logits.argmax(-1) == labels).sum())
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch, loss=f"{float(loss.detach()):.3f}")
            message = (
                f"epoch {epoch}/{epochs}: loss {loss_sum / len(train):.4f}, "
                f"train accuracy {correct / len(train):.4f}"
            )
            if validation is not None and len(validation):
                model.eval()
                message += f", validation accuracy {accuracy(model, validation):.4f}"
            message += f" ({time.perf_counter() - started:.0f} s)"
            logger.info(message)
    finally:
        if bar is not None:
            bar.close()
    return model.eval()


@torch.no_grad()
def predict(
    model: AgreementTransformer, data: AgreementData, /, *, batch_size: int = 256
) -> NDArray[np.int64]:
    """Predicted class of every sentence (0 singular, 1 plural).

    Parameters
    ----------
    model : AgreementTransformer
        The model; it is run as it is (call ``model.eval()`` first to switch dropout
        off; models from :func:`train_agreement_model` and :func:`load_agreement_model`
        are in evaluation mode).
    data : AgreementData
        The sentences.
    batch_size : int, default 256
        Sentences per forward pass.

    Returns
    -------
    ndarray of int64, shape (N,)
        The argmax of the logits.

    Examples
    --------
    >>> import torch
    >>> from attnflow_lab.agreement.agreement import agreement_data
    >>> from attnflow_lab.agreement.agreement_torch import (
    ...     AgreementConfig, AgreementTransformer, predict)
    >>> data = agreement_data(8, seed=0)
    >>> model = AgreementTransformer(AgreementConfig(len(data.vocabulary), n_layers=1)).eval()
    >>> predict(model, data).shape
    (8,)
    """
    device = next(model.parameters()).device
    out = np.empty(len(data), dtype=np.int64)
    batches = _consecutive(len(data), batch_size)
    for start, (ids, mask, _) in zip(
        range(0, len(data), batch_size), _batches(data, batches, device), strict=True
    ):
        out[start : start + len(ids)] = model(ids, mask).argmax(-1).cpu().numpy()
    return out


def accuracy(
    model: AgreementTransformer, data: AgreementData, /, *, batch_size: int = 256
) -> float:
    """Fraction of the sentences whose verb number the model predicts correctly.

    Parameters
    ----------
    model : AgreementTransformer
        The model, in evaluation mode (see :func:`predict`).
    data : AgreementData
        The sentences.
    batch_size : int, default 256
        Sentences per forward pass.

    Returns
    -------
    float
        The accuracy, in [0, 1]; NaN for an empty set.

    References
    ----------
    Abnar & Zuidema (2020), §2, report 0.96 on the Linzen et al. (2016) data.

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import agreement_data
    >>> from attnflow_lab.agreement.agreement_torch import (
    ...     AgreementConfig, AgreementTransformer, accuracy)
    >>> data = agreement_data(8, seed=0)
    >>> model = AgreementTransformer(AgreementConfig(len(data.vocabulary), n_layers=1)).eval()
    >>> 0.0 <= accuracy(model, data) <= 1.0
    True
    """
    if len(data) == 0:
        return float("nan")
    return float((predict(model, data, batch_size=batch_size) == data.labels).mean())


def paper_input_gradients(model: AgreementTransformer, ids: ArrayLike, /) -> NDArray[np.float64]:
    r"""Compute the paper code's input gradient, one unpadded sentence at a time.

    Abnar & Zuidema's Table 2 was computed by ``samiraabnar/Reflect``
    (``notebooks/attention_flow.ipynb`` at commit ``d28ddd5``) as

    .. math::

        s_i = \Big\lvert \sum_d \frac{\partial (p_0 - p_1)}{\partial E_{i,d}} \Big\rvert,

    with :math:`p` the softmax of the two logits, :math:`E = e_\text{token} +
    e_\text{position}` and the batch of one sentence without padding. This function
    computes exactly that expression, in the model's dtype.

    In exact arithmetic :math:`s_i = 0`: every read of the residual stream of this
    pre-LayerNorm transformer (the authors' too) goes through a LayerNorm, which ignores
    a shift of all coordinates, so adding :math:`c\,(1, \dots, 1)` to :math:`E_i` changes
    no output. What the expression returns is the rounding error of that zero (about
    :math:`10^{-7}` of :math:`\lVert \partial p / \partial E_i \rVert` in float32), so
    a different way to round it (the gradient of :math:`p_\text{gold}` instead of
    :math:`p_0 - p_1`, a padded batch, float64) gives other values and other ranks.

    Parameters
    ----------
    model : AgreementTransformer
        The model, in evaluation mode (dropout would make the gradient random).
    ids : array_like of int, shape (n,)
        One sentence's token ids, ``[CLS]`` first, without padding.

    Returns
    -------
    ndarray of float64, shape (n,)
        :math:`s_i` for every position.

    Raises
    ------
    ValueError
        If `ids` is not one 1-d sentence, or the model does not have two classes.

    See Also
    --------
    attnflow.adapters.torch.input_gradients : The gradient of the target's probability,
        batched, with the l2 norm as the default reduction.

    References
    ----------
    S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
    Table 2; the code: https://github.com/samiraabnar/Reflect (commit d28ddd5).

    Examples
    --------
    >>> import torch
    >>> from attnflow_lab.agreement.agreement import VOCABULARY, encode
    >>> from attnflow_lab.agreement.agreement_torch import (
    ...     AgreementConfig, AgreementTransformer, paper_input_gradients)
    >>> _ = torch.manual_seed(0)
    >>> model = AgreementTransformer(AgreementConfig(len(VOCABULARY), n_layers=1)).eval()
    >>> scores = paper_input_gradients(model, encode("the keys"))
    >>> scores.shape, bool((scores < 1e-5).all())
    ((3,), True)
    """
    tokens = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    if tokens.ndim != 1 or tokens.numel() == 0:
        msg = (
            f"`ids` must be one sentence, a non-empty 1-d array of token ids; got shape "
            f"{tuple(tokens.shape)}. Pass one row, without padding: ids[i, :length]."
        )
        raise ValueError(msg)
    if model.config.n_classes != 2:
        msg = (
            f"the paper code's gradient differentiates p_0 - p_1 and needs a model with 2 "
            f"classes; this one has n_classes={model.config.n_classes}."
        )
        raise ValueError(msg)
    kept: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:  # noqa: ARG001
        kept.append(output)

    handle = model.get_input_embeddings().register_forward_hook(keep)
    try:
        with torch.enable_grad():
            probs = torch.softmax(model(tokens[None]), dim=-1)
            (grad,) = torch.autograd.grad(probs[0, 0] - probs[0, 1], kept[0])
    finally:
        handle.remove()
    return np.asarray(grad[0].sum(dim=-1).abs().detach().cpu().numpy(), dtype=np.float64)


# -- saving and loading -------------------------------------------------------------------------
def _exists(target: Path) -> FileExistsError:
    return FileExistsError(f"{target} exists; pass force=True to overwrite it.")


def save_agreement_model(
    model: AgreementTransformer,
    folder: str | os.PathLike[str],
    /,
    *,
    vocabulary: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Save a model as ``weights.npz`` and ``config.json`` in `folder`.

    The weights are the state dict written with ``numpy.savez`` (float32 arrays, no
    pickle); ``config.json`` holds the :class:`AgreementConfig`, the vocabulary and
    `metadata`. Each file is written to a temporary file in `folder` and renamed into
    place, so a reader never sees half a file.

    Parameters
    ----------
    model : AgreementTransformer
        The model to save.
    folder : str or path-like
        The folder; created if missing.
    vocabulary : sequence of str, optional
        The words of the token ids, stored so that :func:`load_agreement_model` can
        check them.
    metadata : mapping, optional
        JSON-serialisable facts to keep with the model (training settings, accuracy).
    force : bool, default False
        Overwrite existing files. Without it, nothing is written if either file exists.

    Returns
    -------
    pathlib.Path
        The folder.

    Raises
    ------
    FileExistsError
        If a file exists and `force` is False.
    TypeError
        If `metadata` is not JSON-serialisable.

    Examples
    --------
    >>> import tempfile
    >>> from attnflow_lab.agreement.agreement_torch import (
    ...     AgreementConfig, AgreementTransformer, load_agreement_model, save_agreement_model)
    >>> model = AgreementTransformer(AgreementConfig(vocab_size=10, n_layers=1, hidden=16))
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     _ = save_agreement_model(model, folder)
    ...     load_agreement_model(folder).config == model.config
    True
    """
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    targets = (path / WEIGHTS_FILE, path / CONFIG_FILE)
    if not force:
        existing = [str(target) for target in targets if target.exists()]
        if existing:
            msg = f"{' and '.join(existing)} exist(s); pass force=True to overwrite."
            raise FileExistsError(msg)
    document = {
        "format": _FORMAT,
        "version": _FORMAT_VERSION,
        # Unset optional sizes are left out, so older readers still load default models.
        "config": {k: v for k, v in asdict(model.config).items() if v is not None},
        "vocabulary": None if vocabulary is None else list(vocabulary),
        "metadata": dict(metadata or {}),
    }
    text = json.dumps(document, indent=2) + "\n"  # TypeError before anything is written
    arrays = {
        name: tensor.detach().to("cpu", torch.float32).numpy()
        for name, tensor in model.state_dict().items()
    }
    # Each file appears whole or not at all, with the mode open() would give.
    write_atomically(
        targets[0], lambda file: np.savez(file, **arrays), replace=force, exists=_exists, mode=None
    )
    write_atomically(
        targets[1], lambda file: file.write(text.encode()), replace=force, exists=_exists, mode=None
    )
    return path


def load_agreement_model(
    folder: str | os.PathLike[str],
    /,
    *,
    vocabulary: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
) -> AgreementTransformer:
    """Load a model saved by :func:`save_agreement_model`, in evaluation mode.

    Parameters
    ----------
    folder : str or path-like
        The folder with ``weights.npz`` and ``config.json``.
    vocabulary : sequence of str, optional
        The vocabulary the caller will use; a ValueError is raised if the model was
        saved with a different one.
    device : str or torch.device, default "cpu"
        Where to put the model.

    Returns
    -------
    AgreementTransformer
        The model (float32), in evaluation mode.

    Raises
    ------
    FileNotFoundError
        If a file is missing.
    ValueError
        If the files are not a saved agreement model, their weights do not match the
        configuration, or the vocabulary differs.

    Examples
    --------
    >>> import tempfile
    >>> import torch
    >>> from attnflow_lab.agreement.agreement_torch import (
    ...     AgreementConfig, AgreementTransformer, load_agreement_model, save_agreement_model)
    >>> model = AgreementTransformer(AgreementConfig(vocab_size=10, n_layers=1, hidden=16))
    >>> ids = torch.tensor([[1, 4, 5]])
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     _ = save_agreement_model(model.eval(), folder, vocabulary=[str(i) for i in range(10)])
    ...     loaded = load_agreement_model(folder)
    >>> torch.equal(loaded(ids), model(ids))
    True
    """
    path = Path(folder)
    with (path / CONFIG_FILE).open(encoding="utf-8") as stream:
        document = json.load(stream)
    if not isinstance(document, dict) or document.get("format") != _FORMAT:
        msg = f"{path / CONFIG_FILE} does not describe a saved agreement model."
        raise ValueError(msg)
    if document.get("version") != _FORMAT_VERSION:
        msg = f"{path / CONFIG_FILE} has format version {document.get('version')!r}."
        raise ValueError(msg)
    saved_vocabulary = document.get("vocabulary")
    if (
        vocabulary is not None
        and saved_vocabulary is not None
        and list(vocabulary) != list(saved_vocabulary)
    ):
        msg = f"the model in {path} was trained with a different vocabulary."
        raise ValueError(msg)
    try:
        config = AgreementConfig(**document["config"])
    except (KeyError, TypeError) as error:
        msg = f"{path / CONFIG_FILE} has an invalid config: {error}"
        raise ValueError(msg) from error
    model = AgreementTransformer(config)
    with np.load(path / WEIGHTS_FILE, allow_pickle=False) as weights:
        state = {name: torch.from_numpy(np.array(weights[name])) for name in weights.files}
    expected = model.state_dict()
    if set(state) != set(expected) or any(
        state[name].shape != expected[name].shape for name in expected
    ):
        msg = f"{path / WEIGHTS_FILE} does not hold the weights of the configured model."
        raise ValueError(msg)
    model.load_state_dict(state)
    return model.to(torch.device(device)).eval()


def _warmup_cosine(total: int, warmup: float) -> Callable[[int], float]:
    """Return the learning-rate factor of each step: warm-up, then a cosine decay.

    Linear warm-up over the fraction `warmup` of the `total` steps, then a cosine to 0.
    """
    warmup_steps = max(1, round(warmup * total))

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = (step - warmup_steps) / max(1, total - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))

    return schedule
