"""Attention rollout, flow and gradient rollout with captum's calling convention.

captum's attribution classes wrap a model, ``Method(model).attribute(inputs, target=...,
additional_forward_args=...)``, and return attributions shaped like `inputs`, which is
what captum's metrics (``captum.metrics.infidelity``, ``sensitivity_max``) and
visualisation helpers take. The classes here follow that convention and compute with
attnflow: the model runs once inside :func:`attnflow.adapters.torch.capture`, and
:func:`attnflow.rollout`, :func:`attnflow.flow` or :func:`attnflow.gradient_rollout`
score every input token for one output position (``row``, 0 = [CLS] by default).

Shapes, for ``inputs`` of shape

* ``(batch, n)`` (token ids, or one value per token): ``(batch, n)``, the row's
  attribution to each token;
* ``(batch, n, d)`` (embeddings): ``(batch, n, d)``, each token's score repeated along
  its embedding, so that sums over the input (what captum's metrics compute) weight each
  token by its score;
* ``(batch, channels, height, width)`` (images, for vision transformers): the scores of
  the patch tokens (the first ``prefix_tokens`` tokens, [CLS], registers, distillation,
  are left out) on the patch grid, upsampled to the image and repeated over channels.

The model is called as ``model(inputs, *additional_forward_args)`` and must be a
``torch.nn.Module`` (attnflow hooks its submodules). Captum classes are not subclassed:
captum's ``Attribution`` base brings nothing these methods use.

The attributions are contiguous tensors (captum's metrics flatten them with ``view``).
captum's metrics that call the model (``infidelity``) need a tensor of logits; a Hugging
Face model returns a ``ModelOutput``. :class:`Logits` wraps a model to return its
``.logits``, and each class's ``forward_func`` (captum's name for the wrapped model) is
such a wrapper: ``infidelity(explainer.forward_func, perturb, inputs, attributions)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ._patches import pixel_maps, prefix_tokens_of, token_scores

__all__ = ["AttentionFlow", "AttentionRollout", "GradientRollout", "Logits"]


def _check_module(model: object) -> None:
    if not isinstance(model, nn.Module):
        msg = (
            f"`model` must be a torch.nn.Module (attnflow captures attention from its "
            f"submodules); got {type(model).__name__}. Wrap a forward function in a "
            "Module."
        )
        raise TypeError(msg)


class Logits(nn.Module):
    """A model that returns its logits as a tensor, for captum's metrics.

    captum's ``infidelity`` subtracts the model's outputs; a Hugging Face model returns a
    ``ModelOutput``. Calling this module calls `model` with the same arguments and
    returns:

    * a tensor output as it is;
    * the ``logits`` of a ``ModelOutput`` (any object with a tensor ``.logits``) or of a
      mapping with a ``"logits"`` key.

    Anything else is a ``TypeError`` naming what the model returned. The model is a
    submodule, so attnflow still finds its attention: ``AttentionRollout(Logits(model))``
    gives the maps of ``AttentionRollout(model)``.

    Parameters
    ----------
    model : torch.nn.Module
        The model, e.g. a Hugging Face ``...ForImageClassification``.

    Examples
    --------
    >>> import torch
    >>> from transformers.modeling_outputs import SequenceClassifierOutput
    >>> from attnflow.integrations.captum import Logits
    >>> class Classifier(torch.nn.Module):
    ...     def forward(self, x):
    ...         return SequenceClassifierOutput(logits=2 * x)
    >>> Logits(Classifier())(torch.ones(1, 3))
    tensor([[2., 2., 2.]])
    """

    def __init__(self, model: nn.Module) -> None:
        _check_module(model)
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Call the model and return its logits (see the class docstring).

        Parameters
        ----------
        *args, **kwargs
            The model's arguments.

        Returns
        -------
        Tensor
            The logits.

        Raises
        ------
        TypeError
            If the output is neither a tensor nor carries a tensor ``logits``.
        """
        output = self.model(*args, **kwargs)
        if isinstance(output, torch.Tensor):
            return output
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, Mapping):
            logits = output.get("logits")
        if isinstance(logits, torch.Tensor):
            return logits
        msg = (
            f"The model returned a {type(output).__name__}, not a tensor of logits nor an "
            "output with a tensor `.logits` (a Hugging Face ModelOutput). Wrap it in a "
            "Module whose forward returns the logits (for a Hugging Face model, leave "
            "return_dict at its default True)."
        )
        raise TypeError(msg)


class _AttentionAttribution:
    """What the three classes share; `method` names attnflow's function."""

    method: ClassVar[str]

    def __init__(self, model: nn.Module) -> None:
        _check_module(model)  # checked at run time: callers may pass any callable
        # captum's name for the wrapped model; it returns logits, so that captum's metrics
        # can take it: infidelity(explainer.forward_func, ...).
        self.forward_func = model if isinstance(model, Logits) else Logits(model)
        self.model: nn.Module = self.forward_func.model  # what attnflow runs and reads

    @staticmethod
    def has_convergence_delta() -> bool:
        """Return False: there is no completeness delta, as for captum's attention-free methods.

        Returns
        -------
        bool
            Always False.
        """
        return False

    def attribute(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor],
        target: Any = None,
        additional_forward_args: Any = None,
        *,
        row: int = 0,
        prefix_tokens: int | None = None,
        interpolate: str = "nearest",
        **options: Any,
    ) -> torch.Tensor | tuple[torch.Tensor]:
        """Attribute the output position `row` to the inputs; the result has their shape.

        Parameters
        ----------
        inputs : Tensor or 1-tuple of Tensor
            ``(batch, n)``, ``(batch, n, d)`` or images ``(batch, channels, height,
            width)``, passed first to the model; a 1-tuple (as captum's metrics pass it)
            gives a 1-tuple.
        target : int, sequence of int, Tensor or None, default None
            The class explained, for :class:`GradientRollout` (None: the predicted class).
            Rollout and flow do not depend on it; it is accepted so that captum's metrics
            can pass it.
        additional_forward_args : object or tuple, optional
            Further positional arguments of the model call.
        row : int, default 0
            The output position explained (0 = [CLS]).
        prefix_tokens : int, optional
            Images only: the tokens before the patches ([CLS], registers, distillation).
            Default: the model's ``num_prefix_tokens`` (timm) if it has one, else 1.
        interpolate : {"nearest", "bilinear", "bicubic"}, default "nearest"
            Images only: how the patch grid is upsampled to pixels.
        **options
            attnflow options: ``heads``, ``residual``, ``layers`` (``"last"`` or one
            index), ``mask``, ``normalize_result`` (flow), ``rule`` (gradient rollout) ...

        Returns
        -------
        Tensor or 1-tuple of Tensor
            Attributions of the shape of `inputs` (see the module docstring), detached.

        Raises
        ------
        ValueError
            If `inputs` has another number of dimensions, or an option is bad (before
            the model runs).
        """
        # captum passes and expects tuples (its metrics do): a 1-tuple gives a 1-tuple.
        wrap = isinstance(inputs, tuple) and len(inputs) == 1
        tensor: object = inputs[0] if wrap else inputs  # a longer tuple is refused here
        if not isinstance(tensor, torch.Tensor) or tensor.ndim not in (2, 3, 4):
            got = (
                f"shape {tuple(tensor.shape)}"
                if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__
            )
            msg = (
                "`inputs` must be a Tensor (batch, n), (batch, n, d) or images (batch, "
                f"channels, height, width); got {got}. Pass one tensor (captum tuples of "
                "several inputs are not supported; pass the others as "
                "additional_forward_args)."
            )
            raise ValueError(msg)
        image = tensor.ndim == 4
        if image:
            prefix = prefix_tokens_of(self.model, prefix_tokens)
        arguments = [tensor, *_as_tuple(additional_forward_args)]
        scores = token_scores(
            self.model,
            arguments,
            method=self.method,
            row=row,
            target=target,
            options=options,
        )
        if image:
            maps = pixel_maps(
                scores,
                prefix_tokens=prefix,
                size=(tensor.shape[-2], tensor.shape[-1]),
                interpolate=interpolate,
            )
            # Contiguous copies, not stride-0 views: captum's metrics flatten with view().
            result = maps[:, None].expand_as(tensor).to(tensor.device).contiguous()
            return (result,) if wrap else result
        if scores.shape != tensor.shape[:2]:
            msg = (
                f"The model attended over {scores.shape[-1]} tokens for inputs of shape "
                f"{tuple(tensor.shape)}: the attributions cannot take the inputs' shape. "
                "Pass the token axis of the model's attention as the second axis of `inputs`."
            )
            raise ValueError(msg)
        result = scores[..., None].expand_as(tensor).contiguous() if tensor.ndim == 3 else scores
        return (result,) if wrap else result


def _as_tuple(value: Any) -> Sequence[Any]:
    if value is None:
        return ()
    return value if isinstance(value, tuple) else (value,)


class AttentionRollout(_AttentionAttribution):
    """Attention rollout (:func:`attnflow.rollout`), captum-style.

    Parameters
    ----------
    model : torch.nn.Module
        The model, called as ``model(inputs, *additional_forward_args)``.

    Examples
    --------
    >>> import torch
    >>> from attnflow.integrations.captum import AttentionRollout
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    >>> AttentionRollout(model).attribute(torch.randn(3, 5, 8)).shape
    torch.Size([3, 5, 8])
    """

    method = "rollout"


class AttentionFlow(_AttentionAttribution):
    """Attention flow (:func:`attnflow.flow`), captum-style.

    Parameters
    ----------
    model : torch.nn.Module
        The model, called as ``model(inputs, *additional_forward_args)``.

    Examples
    --------
    >>> import torch
    >>> from attnflow.integrations.captum import AttentionFlow
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    >>> scores = AttentionFlow(model).attribute(torch.randn(3, 5, 8))
    >>> bool(torch.allclose(scores[..., 0].sum(-1), torch.ones(3)))
    True
    """

    method = "flow"


class GradientRollout(_AttentionAttribution):
    """Gradient-weighted rollout (:func:`attnflow.gradient_rollout`), captum-style.

    Explains the logit of `target` (None: each sample's predicted class); the model must
    return logits ``(batch, classes)`` and be in eval mode.

    Parameters
    ----------
    model : torch.nn.Module
        The classifier, called as ``model(inputs, *additional_forward_args)``.

    Examples
    --------
    >>> import torch
    >>> from attnflow.integrations.captum import GradientRollout
    >>> class Classifier(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    ...         self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ...         self.head = torch.nn.Linear(8, 3)
    ...
    ...     def forward(self, x):
    ...         return self.head(self.encoder(x)[:, 0])
    >>> GradientRollout(Classifier().eval()).attribute(torch.randn(2, 5, 8), target=1).shape
    torch.Size([2, 5, 8])
    """

    method = "gradient_rollout"
