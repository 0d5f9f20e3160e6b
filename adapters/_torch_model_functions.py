"""The callables :func:`attnflow.evaluate.faithfulness` needs, from a PyTorch model.

:func:`model_functions` builds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import attnflow
import attnflow.explanation

from ._common import (
    CaptureHeads,
    Contributions,
    Reduction,
    Score,
    capture_heads,
    check_reduce_output,
)
from ._torch_capture import capture
from ._torch_gradients import _logits, _weights_and_gradients, input_gradients

__all__ = ["model_functions"]


def model_functions(
    model: nn.Module,
    *,
    input_name: str = "input_ids",
    mask_name: str | None = "attention_mask",
    heads: CaptureHeads = "mean",
    embeddings: nn.Module | None = None,
    reduce: Reduction = "l2",
    output: Score = "probability",
    contributions: Contributions | None = None,
) -> attnflow.evaluate.ModelFunctions:
    """Wrap a PyTorch classifier for :func:`attnflow.evaluate.faithfulness`.

    Builds the functions the evaluation calls on a batch of token ids ``(B, n)`` and its
    padding mask (arrays of any library; they are moved to the model's device):

    * ``predict(ids, mask)``: the softmax of the model's logits, under ``torch.no_grad()``;
    * ``attentions(ids, mask)``: the attention weights of the same call, captured with
      :func:`capture` (or, with `contributions`, the value-aware token-mixing matrices);
    * ``input_gradients(ids, mask, targets)``: :func:`input_gradients` for the target
      classes;
    * ``attention_gradients(ids, mask, targets)``: every head's attention weights and the
      gradients of the target classes' logits with respect to them (what
      ``explain(..., method="gradient_rollout")`` uses), for ``"gradient_rollout"``.

    The model is called as ``model(**{input_name: ids, mask_name: mask})`` (the mask as
    ``0``/``1`` integers, as Hugging Face models take it), or ``model(ids)`` with
    ``mask_name=None``. It must return logits ``(B, C)``, as a tensor or as the
    ``logits`` attribute of its output.

    Parameters
    ----------
    model : torch.nn.Module
        The classifier, in eval mode (the functions do not change its mode).
    input_name : str, default "input_ids"
        The keyword of the token ids.
    mask_name : str or None, default "attention_mask"
        The keyword of the padding mask; None calls ``model(ids)`` without one.
    heads : {"mean", "max", "min", "each"}, default "mean"
        Fuse the heads while capturing, so that each layer keeps ``n x n`` values; the
        attentions are then returned with a heads axis of length one ``(B, L, 1, n, n)``,
        which every head fusion leaves as it is. ``"each"`` returns every head (``None``
        is its deprecated spelling, as for :func:`capture`).
    embeddings : torch.nn.Module, optional
        Where input gradients are taken, as for :func:`input_gradients` (by default
        ``model.get_input_embeddings()``).
    reduce : {"l2", "sum_abs", "x_input"}, default "l2"
        The reduction of the gradient over the hidden axis, as for
        :func:`input_gradients`.
    output : {"probability", "logit"}, default "probability"
        Differentiate the target's probability or its logit (input gradients).
    contributions : {"norm", "globenc", "alti"}, optional
        Make ``attentions`` return value-aware token-mixing matrices
        (``capture(model, contributions=...)``) with a heads axis of length one,
        ``(B, L, 1, n, n)``, instead of the attention weights (`heads` is then unused).
        Evaluate them with methods that take their rows as they are, e.g.
        ``functools.partial(attnflow.rollout, residual=0.0, normalize_layers=True)`` for
        ALTI, which carries the residual connection, or, for GlobEnc as its authors
        aggregate it (raw products),
        ``functools.partial(attnflow._contributions.compose_unnormalized, attnflow.rollout)``.

    Returns
    -------
    attnflow.evaluate.ModelFunctions
        ``predict``, ``attentions``, ``input_gradients`` and ``attention_gradients``,
        returning torch tensors.

    Raises
    ------
    TypeError
        If `model` is not a module.
    ValueError
        On a bad `heads`, `reduce` or `output`.

    See Also
    --------
    attnflow.evaluate.faithfulness : Runs the evaluation.

    Examples
    --------
    >>> import numpy as np
    >>> import torch
    >>> import attnflow
    >>> from attnflow.adapters.torch import model_functions
    >>> class Classifier(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(10, 8)
    ...         layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    ...         self.encoder = torch.nn.TransformerEncoder(
    ...             layer, num_layers=2, enable_nested_tensor=False
    ...         )
    ...         self.head = torch.nn.Linear(8, 2)
    ...
    ...     def get_input_embeddings(self):
    ...         return self.embed
    ...
    ...     def forward(self, input_ids):
    ...         return self.head(self.encoder(self.embed(input_ids))[:, 0])
    >>> functions = model_functions(Classifier().eval(), mask_name=None)
    >>> ids = np.array([[1, 4, 2, 7], [3, 3, 5, 9]])
    >>> functions.predict(ids, None).shape
    torch.Size([2, 2])
    >>> functions.attentions(ids, None).shape
    torch.Size([2, 2, 1, 4, 4])
    >>> report = attnflow.evaluate.faithfulness(functions, ids, replacement=0, fractions=None)
    >>> report.n_layers
    2
    """
    given: object = model
    if not isinstance(given, nn.Module):
        msg = f"model_functions() expects a torch.nn.Module; got {type(given).__name__}."
        raise TypeError(msg)
    heads = capture_heads(heads, caller="model_functions")
    if contributions not in (None, "norm", "globenc", "alti"):
        msg = (
            '`contributions` must be None (attention weights), "norm", "globenc" or "alti"; '
            f"got {contributions!r}."
        )
        raise ValueError(msg)
    check_reduce_output(reduce, output)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def arguments(ids: Any, mask: Any) -> dict[str, Any] | torch.Tensor:
        tokens = _as_tensor(ids, device)
        if mask_name is None:
            return tokens
        keep = torch.ones_like(tokens) if mask is None else _as_tensor(mask, device).long()
        return {input_name: tokens, mask_name: keep}

    def call(given: dict[str, Any] | torch.Tensor) -> Any:
        return model(given) if isinstance(given, torch.Tensor) else model(**given)

    def predict(ids: Any, mask: Any = None) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(_logits(call(arguments(ids, mask))), dim=-1)

    def attentions(ids: Any, mask: Any = None) -> torch.Tensor:
        if contributions is not None:
            with torch.no_grad(), capture(model, contributions=contributions) as cap:
                call(arguments(ids, mask))
            return cap.contributions[..., None, :, :]
        with torch.no_grad(), capture(model, heads=heads) as cap:
            call(arguments(ids, mask))
        return cap.attentions  # (*batch, layers, 1, n, n) when fused

    def weights_and_gradients(
        ids: Any, mask: Any, targets: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, grads, _, _ = _weights_and_gradients(
            model, arguments(ids, mask), _as_tensor(targets, device)
        )
        return weights, grads[0]  # a classifier (predict reads its logits): one score

    def gradients(ids: Any, mask: Any, targets: Any) -> torch.Tensor:
        return input_gradients(
            model,
            arguments(ids, mask),
            target=_as_tensor(targets, device),
            embeddings=embeddings,
            reduce=reduce,
            output=output,
        )

    options = {
        "input_name": input_name,
        "mask_name": mask_name,
        "heads": heads,
        "embeddings": None if embeddings is None else type(embeddings).__qualname__,
        "reduce": reduce,
        "output": output,
        "contributions": contributions,
    }

    def identity() -> str:  # read when an evaluation writes to a folder
        return _weights_identity(model, options)

    return attnflow.evaluate.ModelFunctions(
        predict, attentions, gradients, weights_and_gradients, identity=identity
    )


def _weights_identity(model: nn.Module, options: Mapping[str, object] | None = None) -> str:
    """Name a model by its class, a SHA-256 of its weights and buffers, and `options`.

    What :func:`model_functions` records as the model's identity in an evaluation
    folder: two models differ in it unless every tensor of their state dicts (names,
    dtypes, shapes and bytes) is equal.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    options : mapping, optional
        Settings of the wrapper that change the numbers, written out after the hash.

    Returns
    -------
    str
        ``"<module>.<class> sha256:<64 hex digits> {options}"``.

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters._torch_model_functions import _weights_identity
    >>> a = _weights_identity(torch.nn.Linear(2, 2))
    >>> a.startswith("torch.nn.modules.linear.Linear sha256:"), a == _weights_identity(
    ...     torch.nn.Linear(2, 2))
    (True, False)
    """
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            msg = f"tensor {name!r} of the model is on the meta device: it has no weights to hash."
            raise ValueError(msg)
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{name};{flat.dtype};{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    settings = ", ".join(f"{key}={value!r}" for key, value in (options or {}).items())
    return f"{kind} sha256:{digest.hexdigest()}" + (f" {{{settings}}}" if settings else "")


def _as_tensor(values: Any, device: torch.device) -> torch.Tensor:
    """Any library's array as a torch tensor on `device` (torch tensors are not copied)."""
    if isinstance(values, torch.Tensor):
        return values.to(device)
    import numpy as np

    array = np.asarray(values)
    if not array.flags.writeable:  # torch warns on read-only memory (e.g. frozen datasets)
        array = array.copy()
    return torch.as_tensor(array, device=device)
