"""Capture attention weights (and their gradients) from JAX / Flax models.

``attnflow.adapters.jax`` records the attention probabilities of a Flax model call and
hands them back in attnflow's canonical layout ``(*batch, layers, heads, n, n)`` with a
padding mask, ready for :func:`attnflow.rollout` and :func:`attnflow.flow`. It imports
jax and flax and is imported only on demand (``import attnflow`` never imports it).

JAX is functional, so the adapter is a set of functions that call the model and return
``(outputs, Capture)``; they are traceable and can be wrapped in :func:`jax.jit`.

* Flax linen (:func:`capture_linen`, :func:`attention_gradients_linen`): every
  ``flax.linen.MultiHeadDotProductAttention`` call is intercepted with
  :func:`flax.linen.intercept_methods` and run with ``sow_weights=True``, so the softmax
  probabilities are sown into the ``"intermediates"`` collection. For gradients,
  ``flax.linen.attention.dot_product_attention_weights`` is replaced, for the duration of
  the call, by a wrapper that adds a zero perturbation (:meth:`flax.linen.Module.perturb`)
  to the weights; the gradient with respect to the perturbation is the gradient with
  respect to the weights.
* Flax NNX (:func:`capture_nnx`, :func:`attention_gradients_nnx`): the ``attention_fn`` of every
  ``flax.nnx.MultiHeadAttention`` that uses the default ``nnx.dot_product_attention`` is
  replaced, for the duration of the call, by an explicit computation with the same
  semantics that records the weights (NNX's default otherwise calls the fused
  :func:`jax.nn.dot_product_attention`, which never materialises them) and, for
  gradients, adds a zero perturbation to them.

* Input gradients (:func:`input_gradients_linen`, :func:`input_gradients_nnx`): a zero
  array is added to the output of the embedding module (linen: through
  :func:`flax.linen.intercept_methods`; NNX: its class's ``__call__`` is wrapped for the
  call, acting on that instance only) and :func:`jax.grad` of the classifier's target
  score is taken with respect to it.

* Value-aware contributions (``capture_linen(..., contributions="norm" | "globenc" |
  "alti")``, the same for :func:`capture_nnx`): every module call of the model is
  followed (linen: :func:`flax.linen.intercept_methods`; NNX: each module class's
  ``__call__`` wrapped for the call, acting on the model's instances only), the
  attention blocks are recognised by how their calls are wired, and each block's
  ``n x n`` token-mixing matrix (:func:`attnflow.contributions`) is computed when it
  returns; see ``attnflow.adapters._jax_contributions``.

Everything is restored when the call returns, also when it raises. The patches are
process-wide while a call runs: do not capture from several threads at once.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, cast, overload

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import attention as linen_attention
from flax.nnx.nn import attention as nnx_attention
from flax.nnx.nn import dtypes as nnx_dtypes

import attnflow
from attnflow._deprecation import warn_deprecated
from attnflow._methods import MethodSpec, method_spec

from . import _jax_logit
from ._common import (
    CaptureHeads,
    Contributions,
    HeadReduction,
    Method,
    Reduction,
    Score,
    TargetScore,
    capture_heads,
    check_class_values,
    check_contributions,
    check_method,
    check_no_target,
    check_reduce_output,
    check_target_score,
    check_target_type,
    explain_contributions,
    explain_gradients,
    explain_weights,
    is_class_index,
    reject_heads,
    score_values,
)
from ._jax_contributions import BlockTracker, linen_tracking, nnx_tracking, read_linen, read_nnx

__all__ = [
    "Capture",
    "ContributionCapture",
    "attention_gradients_linen",
    "attention_gradients_nnx",
    "capture_linen",
    "capture_nnx",
    "explain_linen",
    "explain_nnx",
    "input_gradients_linen",
    "input_gradients_nnx",
]


#: The Flax collection that holds attnflow's zero perturbations (linen).
_PERTURBATIONS = "attnflow_perturbations"
_SOWN = "attention_weights"
_LOCK = threading.RLock()


class Capture(NamedTuple):
    """Attention weights captured from one Flax model call (a named tuple and a JAX pytree).

    What :func:`capture_linen` and :func:`capture_nnx` return beside the model's
    outputs; build it through them. A
    pytree, so it can be returned from a function transformed with :func:`jax.jit`, and
    a named tuple, so it unpacks as ``attentions, mask, gradients = cap``.

    Parameters
    ----------
    attentions : jax.Array
        ``(*batch, layers, heads, n, n)``, layers in the order the model ran them; with
        heads fused while capturing, one head: ``(*batch, layers, 1, n, n)``.
    mask : jax.Array or None, default None
        ``(*batch, n)`` bool, True for real tokens: a key is real when some query may
        attend to it under the attention mask of the first attention call. None when the
        model passed no mask.
    gradients : jax.Array or None, default None
        Gradient of the target scalar with respect to `attentions`, same shape, filled
        only by the deprecated ``gradients_linen`` and ``gradients_nnx``; None otherwise
        (:func:`attention_gradients_linen` returns the gradients themselves).

    Attributes
    ----------
    attentions, mask, gradients
        The fields, as above.
    contributions, outputs : jax.Array
        Not recorded: reading them raises ``RuntimeError``. They are the fields of a
        :class:`ContributionCapture`, which ``contributions=`` returns instead.

    See Also
    --------
    ContributionCapture : What ``contributions=`` captures instead.
    capture_linen, capture_nnx : Capture the weights.
    attention_gradients_linen, attention_gradients_nnx : The weights and their gradients.
    attnflow.rollout, attnflow.flow : Read `attentions` with `mask`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnflow.adapters.jax import Capture, capture_nnx
    >>> mha = nnx.MultiHeadAttention(
    ...     num_heads=2, in_features=4, decode=False, rngs=nnx.Rngs(0)
    ... )
    >>> y, cap = capture_nnx(mha, jnp.ones((1, 3, 4)))
    >>> isinstance(cap, Capture)
    True
    >>> cap.attentions.shape, cap.mask, cap.gradients
    ((1, 1, 2, 3, 3), None, None)
    >>> jax.tree.map(jnp.shape, jax.jit(lambda x: capture_nnx(mha, x)[1])(jnp.ones((1, 3, 4))))
    Capture(attentions=(1, 1, 2, 3, 3), mask=None, gradients=None)
    """

    attentions: jax.Array
    mask: jax.Array | None = None
    gradients: jax.Array | None = None

    @property
    def contributions(self) -> jax.Array:
        """Not recorded here: reading it raises ``RuntimeError``.

        It is a field of :class:`ContributionCapture`, which ``contributions=`` returns.
        """
        msg = (
            '`contributions` needs capture_linen / capture_nnx(..., contributions="norm" | '
            '"globenc" | "alti"); this capture recorded attention weights (read `attentions`).'
        )
        raise RuntimeError(msg)

    @property
    def outputs(self) -> jax.Array:
        """Not recorded here: reading it raises ``RuntimeError``.

        It is a field of :class:`ContributionCapture`, which ``contributions=`` returns.
        """
        msg = (
            '`outputs` needs capture_linen / capture_nnx(..., contributions="norm" | '
            '"globenc" | "alti"); this capture recorded attention weights (read `attentions`).'
        )
        raise RuntimeError(msg)


class ContributionCapture(NamedTuple):
    r"""Value-aware token-mixing matrices captured from one Flax model call (a JAX pytree).

    What :func:`capture_linen` and :func:`capture_nnx` return with ``contributions=``
    beside the model's outputs; build it through them. Each attention block
    :math:`y_i = \sum_j T_i(x_j) + b_i` (see :func:`attnflow.attention_terms`) gives one
    matrix :math:`c_{ij}`, the share of input token :math:`j` in output :math:`i`
    (:func:`attnflow.contributions`). A named tuple, so it unpacks as
    ``contributions, outputs, mask = cap``, and a pytree.

    Parameters
    ----------
    contributions : jax.Array
        ``(*batch, layers, n, n)``, rows = receiving token, one matrix per attention
        block in the order the blocks ran. Roll them out with
        ``attnflow.rollout(c, heads=None, residual=0.0, normalize_layers=True)`` (ALTI;
        ``residual=0.5`` for the norm-based matrix, which has no residual; GlobEnc's
        authors multiply the raw matrices, ``normalize_layers=False, validate=False``).
    outputs : jax.Array
        ``(*batch, layers, n, d)``: each block's output rebuilt from its decomposition,
        :math:`\sum_j T_i(x_j) + b_i` (the LayerNorm output of a post-LN block, the
        residual stream after the attention of a pre-LN one). Compare it with the
        model's own block outputs to check the decomposition.
    mask : jax.Array or None, default None
        ``(*batch, n)`` bool, True for real tokens, from the mask of the first attention
        call, as for :class:`Capture`; None when the model passed no mask.

    Attributes
    ----------
    contributions, outputs, mask
        The fields, as above.
    attentions : jax.Array
        Not recorded (the per-head weights are dropped with their block): reading it
        raises ``RuntimeError``; capture without ``contributions=`` for a
        :class:`Capture`.

    See Also
    --------
    Capture : What a capture without ``contributions=`` returns.
    capture_linen, capture_nnx : Capture the matrices.
    attnflow.contributions : The matrix of one block from its pieces.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import attnflow
    >>> from attnflow.adapters.jax import ContributionCapture, capture_nnx
    >>> class Block(nnx.Module):  # post-LN
    ...     def __init__(self, rngs):
    ...         self.attention = nnx.MultiHeadAttention(
    ...             num_heads=2, in_features=4, decode=False, rngs=rngs
    ...         )
    ...         self.norm = nnx.LayerNorm(4, rngs=rngs)
    ...
    ...     def __call__(self, x):
    ...         return self.norm(x + self.attention(x))
    >>> y, cap = capture_nnx(Block(nnx.Rngs(0)), jnp.ones((1, 3, 4)), contributions="alti")
    >>> isinstance(cap, ContributionCapture)
    True
    >>> jax.tree.map(jnp.shape, cap)
    ContributionCapture(contributions=(1, 1, 3, 3), outputs=(1, 1, 3, 4), mask=None)
    >>> attnflow.rollout(cap.contributions, heads=None, residual=0.0, normalize_layers=True).shape
    (1, 3, 3)
    """

    contributions: jax.Array
    outputs: jax.Array
    mask: jax.Array | None = None

    @property
    def attentions(self) -> jax.Array:
        """Not recorded: reading it raises ``RuntimeError``.

        The per-head weights are dropped with their block; capture without
        ``contributions=`` for a :class:`Capture`.
        """
        msg = (
            "This capture recorded value-aware contributions, not attention weights: read "
            "`contributions` (or call without contributions= for `attentions`)."
        )
        raise RuntimeError(msg)


# -- shared helpers -----------------------------------------------------------------------------
def _nothing_captured(*, nnx: bool) -> RuntimeError:
    if not nnx:
        detail = (
            "attnflow sees flax.linen.MultiHeadDotProductAttention (and its subclasses such "
            "as SelfAttention) whose attention_fn accepts a `module` argument, like the "
            "default nn.dot_product_attention. Attention written inline, plain "
            "jax.nn.dot_product_attention or a custom attention_fn without `module` cannot "
            "be seen."
        )
    else:
        detail = (
            "attnflow sees flax.nnx.MultiHeadAttention modules that use the default "
            "attention_fn (nnx.dot_product_attention), found with nnx.iter_modules(model). "
            "Attention written inline, plain jax.nn.dot_product_attention or a custom "
            "attention_fn cannot be seen."
        )
    return RuntimeError(f"No attention weights were captured from the model call. {detail}")


def _stack(weights: Sequence[jax.Array], heads: CaptureHeads) -> jax.Array:
    shapes = {tuple(w.shape) for w in weights}
    if len(shapes) > 1:
        msg = (
            f"The {len(weights)} attention calls have different shapes {sorted(shapes)} and "
            "cannot be stacked into one (*batch, layers, heads, n, n) array. This happens "
            "with encoder-decoder models (self- and cross-attention) or incremental "
            "decoding: run a single forward pass of one attention stack."
        )
        raise ValueError(msg)
    if heads != "each":
        # One fused head, its axis kept: the canonical layout.
        fused = [
            attnflow.fuse_heads(w, heads=heads, validate=False)[..., None, :, :] for w in weights
        ]
        return jnp.stack(fused, axis=-4)
    return jnp.stack(list(weights), axis=-4)


def _padding_mask(mask: Any, weights: jax.Array) -> jax.Array | None:
    """Derive ``(*batch, n)`` real-token flags from a boolean attention mask, if any."""
    if mask is None:
        return None
    keep = jnp.asarray(mask).astype(jnp.bool_)
    if keep.ndim < 2:
        return None
    keys = jnp.any(keep, axis=-2)  # some query may attend to this key
    if keys.ndim >= 2:
        keys = jnp.any(keys, axis=-2)  # over the heads axis
    batch = weights.shape[:-3]
    try:
        return jnp.broadcast_to(keys, (*batch, weights.shape[-1]))
    except ValueError:
        return None


@contextlib.contextmanager
def _patched(namespace: Any, name: str, replacement: object) -> Iterator[None]:
    original = getattr(namespace, name)
    setattr(namespace, name, replacement)
    try:
        yield
    finally:
        setattr(namespace, name, original)


def _contribution_capture(tracker: BlockTracker, *, nnx: bool) -> ContributionCapture:
    if not tracker.matrices:
        raise _nothing_captured(nnx=nnx)
    shapes = {tuple(m.shape) for m in tracker.matrices}
    if len(shapes) > 1:
        msg = (
            f"The {len(tracker.matrices)} attention blocks have token-mixing matrices of "
            f"different shapes {sorted(shapes)} and cannot be stacked into one "
            "(*batch, layers, n, n) array: run a single forward pass of one attention stack."
        )
        raise ValueError(msg)
    first = tracker.masks[0] if tracker.masks else None
    try:
        matrices = jnp.stack(tracker.matrices, axis=-3)
        outputs = jnp.stack(tracker.outputs, axis=-3)
    except jax.errors.UnexpectedTracerError:
        transforms = "nnx.remat, nnx.scan, nnx.vmap" if nnx else "nn.remat, nn.scan, nn.vmap"
        msg = (
            "contributions= cannot follow attention blocks inside the model's own JAX "
            f"transforms ({transforms}...): each block's matrix is computed while the block "
            "runs and cannot leave the transform. Capture from the model built without "
            "them (e.g. remat off; scanned layers unrolled), or capture the attention "
            "weights instead."
        )
        raise ValueError(msg) from None
    mask = _padding_mask(first, matrices[..., 0, None, :, :])
    return ContributionCapture(matrices, outputs, mask)


# -- Flax linen ---------------------------------------------------------------------------------
class _LinenRecorder:
    """Python-side bookkeeping while a linen model is traced: which calls happened, in order."""

    def __init__(self, *, perturb: bool) -> None:
        self.perturb = perturb
        self.calls: list[tuple[tuple[str, ...], int]] = []
        self.masks: list[Any] = []
        self._counts: dict[tuple[str, ...], int] = {}
        self._perturbed: dict[tuple[str, ...], int] = {}

    def intercept(
        self,
        next_fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: Any,
    ) -> Any:
        module = context.module
        if not (
            isinstance(module, nn.MultiHeadDotProductAttention)
            and context.method_name == "__call__"
            and _accepts_module(module.attention_fn)
        ):
            return next_fun(*args, **kwargs)
        path = tuple(module.scope.path) if module.scope is not None else ()
        index = self._counts.get(path, 0)
        self._counts[path] = index + 1
        self.calls.append((path, index))
        self.masks.append(kwargs.get("mask"))
        return next_fun(*args, **{**kwargs, "sow_weights": True})

    def weights_function(self, original: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        signature = inspect.signature(original)

        def dot_product_attention_weights(*args: Any, **kwargs: Any) -> jax.Array:
            weights = original(*args, **kwargs)
            module = signature.bind(*args, **kwargs).arguments.get("module")
            if not self.perturb or module is None or module.scope is None:
                return weights
            path = tuple(module.scope.path)
            index = self._perturbed.get(path, 0)
            self._perturbed[path] = index + 1
            perturbed: jax.Array = module.perturb(
                f"{_SOWN}_{index}", weights, collection=_PERTURBATIONS
            )
            return perturbed

        return dot_product_attention_weights


def _accepts_module(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return "module" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        tree = tree[name]
    return tree


def _run_linen(
    recorder: _LinenRecorder,
    module: nn.Module,
    variables: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    collections: Sequence[str],
) -> tuple[Any, dict[str, Any], bool]:
    """Apply the model with the recorder active; return (outputs, state, user asked mutable)."""
    kwargs = dict(kwargs)
    user_mutable = kwargs.pop("mutable", False)
    if isinstance(user_mutable, bool):
        mutable: Any = list(collections) if not user_mutable else True
    elif isinstance(user_mutable, str):
        mutable = [user_mutable, *collections]
    else:
        mutable = [*user_mutable, *collections]
    original = linen_attention.dot_product_attention_weights
    with (
        _LOCK,
        _patched(
            linen_attention, "dot_product_attention_weights", recorder.weights_function(original)
        ),
        nn.intercept_methods(recorder.intercept),
    ):
        outputs, state = module.apply(variables, *args, mutable=mutable, **kwargs)
    return outputs, dict(state), user_mutable is not False


def _linen_outputs(outputs: Any, state: dict[str, Any], user_mutable: bool) -> Any:
    if not user_mutable:
        return outputs
    kept = {k: v for k, v in state.items() if k not in ("intermediates", _PERTURBATIONS)}
    return outputs, kept


def _linen_weights(recorder: _LinenRecorder, state: dict[str, Any]) -> list[jax.Array]:
    if not recorder.calls:
        raise _nothing_captured(nnx=False)
    intermediates = state.get("intermediates", {})
    weights = []
    for path, index in recorder.calls:
        try:
            sown = _lookup(intermediates, path)[_SOWN]
            weights.append(sown[index])
        except (KeyError, IndexError, TypeError):
            raise _nothing_captured(nnx=False) from None
    return weights


@overload
def capture_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    heads: CaptureHeads = "each",
    contributions: None = None,
    **kwargs: Any,
) -> tuple[Any, Capture]: ...


@overload
def capture_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    heads: Literal["each"] = "each",
    contributions: Contributions,
    **kwargs: Any,
) -> tuple[Any, ContributionCapture]: ...


def capture_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    heads: CaptureHeads = "each",
    contributions: Contributions | None = None,
    **kwargs: Any,
) -> tuple[Any, Capture | ContributionCapture]:
    r"""Call a Flax linen model and capture its attention weights.

    Runs ``module.apply(variables, *args, **kwargs)`` with every
    ``flax.linen.MultiHeadDotProductAttention`` call forced to ``sow_weights=True``
    (through :func:`flax.linen.intercept_methods`), and reads the sown weights back in
    call order. The model's outputs are unchanged. The function is traceable: wrap it
    (or a function calling it) in :func:`jax.jit`.

    Parameters
    ----------
    module : flax.linen.Module
        The model.
    variables : mapping
        Its variables, e.g. ``{"params": params}``.
    *args
        Positional arguments of the model call.
    heads : {"each", "mean", "max", "min"}, default "each"
        Fuse the heads of each layer while capturing (:func:`attnflow.fuse_heads`);
        ``"each"`` keeps every head. (``None``, its old spelling, is deprecated: in
        rollout and flow ``heads=None`` means that the heads are already fused.)
    contributions : {"norm", "globenc", "alti"} or None, default None
        Record value-aware token-mixing matrices instead of attention weights
        (:func:`attnflow.contributions`; Kobayashi et al. 2020, Modarressi et al. 2022,
        Ferrando et al. 2022) and return a :class:`ContributionCapture`. Every module
        call is followed with :func:`flax.linen.intercept_methods`; the **block** of an
        attention module is the module that calls it, and its first array argument
        :math:`x` is the residual stream. Recognised, by the identity of the arrays
        passed between the calls (so also under :func:`jax.jit`):

        * post-LN, :math:`y = \mathrm{LN}(x + \mathrm{Attn}(x))`: the attention reads
          :math:`x` itself; the LayerNorm is the first ``nn.LayerNorm`` the block calls
          after the attention (none: :math:`y = x + \mathrm{Attn}(x)`), GlobEnc's second
          LayerNorm the next one;
        * pre-LN, :math:`y = x + \mathrm{Attn}(\mathrm{LN}(x))`: the attention reads
          the output of an ``nn.LayerNorm`` or ``nn.RMSNorm`` the block called on
          :math:`x`.

        The attention must be a self-attention ``nn.MultiHeadDotProductAttention``
        with the default attention function, without a KV cache, run deterministically
        (no active dropout anywhere in the block). The value and output projections
        are read from its ``value`` and ``out`` parameters. Each block's output rebuilt
        from the decomposition is compared with what the block computed after its
        attention (the LayerNorm's output, else the inputs and outputs of the modules it
        called next or its return value): with concrete arrays a mismatch (no residual
        connection, a scaled one...) raises; under a JAX transformation the block's
        matrix and rebuilt output become NaN instead. Blocks inside the model's own
        lifted transforms (``nn.remat``, ``nn.scan``...) are refused. Not with `heads`.
    **kwargs
        Keyword arguments of ``module.apply`` (model keywords, ``rngs``, ``method``,
        ``mutable``).

    Returns
    -------
    outputs : Any
        What ``module.apply`` returns without attnflow; with a `mutable` keyword,
        ``(outputs, state)`` without attnflow's collections.
    capture : Capture or ContributionCapture
        ``attentions`` ``(*batch, layers, [heads,] n, n)`` in call order, ``mask``
        ``(*batch, n)`` bool (True = real token) derived from the ``mask`` of the first
        attention call, or None; ``gradients`` is None. With `contributions`: a
        :class:`ContributionCapture`, ``contributions`` ``(*batch, layers, n, n)``,
        ``outputs`` ``(*batch, layers, n, d)`` and ``mask``.

    Raises
    ------
    RuntimeError
        If the call ran no attention that attnflow can see.
    ValueError
        On a bad `heads` or `contributions`, or if the calls' weights have different
        shapes. With `contributions`: (while the model runs) an attention block that
        cannot be decomposed, named with what was expected, or active dropout.

    Notes
    -----
    The weights are the softmax probabilities before dropout. With a mask from
    ``nn.make_attention_mask(pad, pad)`` a padded query row is fully masked and Flax
    gives it uniform weights over all keys; pass ``capture.mask`` to attnflow so that
    padded rows are ignored.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import attnflow
    >>> from attnflow.adapters.jax import capture_linen
    >>> class Encoder(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, mask):
    ...         for _ in range(2):
    ...             x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x, mask=mask)
    ...         return x
    >>> x = jnp.ones((1, 4, 8))
    >>> mask = nn.make_attention_mask(jnp.array([[1, 1, 1, 0]]), jnp.array([[1, 1, 1, 0]]))
    >>> model = Encoder()
    >>> variables = model.init(jax.random.key(0), x, mask)
    >>> y, cap = capture_linen(model, variables, x, mask)
    >>> cap.attentions.shape
    (1, 2, 2, 4, 4)
    >>> cap.mask
    Array([[ True,  True,  True, False]], dtype=bool)
    >>> attnflow.rollout(cap.attentions, rows=0, mask=cap.mask).shape
    (1, 4)

    Value-aware contributions (ALTI) of a pre-LN encoder, rolled out with the residual
    they already carry:

    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x))
    >>> class PreLN(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return Block()(Block()(x))
    >>> x = jax.random.normal(jax.random.key(0), (1, 4, 8))
    >>> variables = PreLN().init(jax.random.key(1), x)
    >>> y, cap = capture_linen(PreLN(), variables, x, contributions="alti")
    >>> cap.contributions.shape, cap.outputs.shape
    ((1, 2, 4, 4), (1, 2, 4, 8))
    >>> attnflow.rollout(cap.contributions, heads=None, residual=0.0, normalize_layers=True).shape
    (1, 4, 4)
    """
    heads = capture_heads(heads, caller="capture_linen")
    check_contributions(contributions, heads)
    if contributions is not None:
        tracker = BlockTracker(contributions, *read_linen())
        with _LOCK, linen_tracking(tracker):
            result = module.apply(variables, *args, **kwargs)
        return result, _contribution_capture(tracker, nnx=False)
    recorder = _LinenRecorder(perturb=False)
    outputs, state, user_mutable = _run_linen(
        recorder, module, variables, args, kwargs, ["intermediates"]
    )
    weights = _linen_weights(recorder, state)
    capture = Capture(_stack(weights, heads), _padding_mask(recorder.masks[0], weights[0]))
    return _linen_outputs(outputs, state, user_mutable), capture


def _gradients_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    target: Callable[[Any], jax.Array],
    **kwargs: Any,
) -> tuple[Any, Capture]:
    """Return the outputs and a :class:`Capture` with ``gradients``, for a linen model.

    The weights get a zero perturbation (a variable in an ``"attnflow_perturbations"``
    collection, :meth:`flax.linen.Module.perturb`); :func:`jax.value_and_grad` of
    ``target(outputs)`` with respect to the perturbations gives the gradient with
    respect to the weights. Raises ``RuntimeError`` if no attention was seen, or no
    gradient could be attached to some call.
    """
    clean = {k: v for k, v in dict(variables).items() if k != _PERTURBATIONS}

    def run(perturbations: Any) -> tuple[Any, dict[str, Any], bool, _LinenRecorder]:
        recorder = _LinenRecorder(perturb=True)
        full = clean if perturbations is None else {**clean, _PERTURBATIONS: perturbations}
        collections = (
            ["intermediates", _PERTURBATIONS] if perturbations is None else ["intermediates"]
        )
        outputs, state, user_mutable = _run_linen(recorder, module, full, args, kwargs, collections)
        return outputs, state, user_mutable, recorder

    shapes = jax.eval_shape(lambda: run(None)[1].get(_PERTURBATIONS, {}))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    calls: list[list[tuple[tuple[str, ...], int]]] = []

    def scalar(perturbations: Any) -> tuple[jax.Array, tuple[Any, Capture]]:
        outputs, state, user_mutable, recorder = run(perturbations)
        result = _linen_outputs(outputs, state, user_mutable)
        weights = _linen_weights(recorder, state)
        capture = Capture(_stack(weights, "each"), _padding_mask(recorder.masks[0], weights[0]))
        calls.append(recorder.calls)
        return jnp.asarray(target(result)), (result, capture)

    (_, (result, capture)), grads = jax.value_and_grad(scalar, has_aux=True)(zeros)
    gradients = []
    for path, index in calls[-1]:
        try:
            gradients.append(_lookup(grads, path)[f"{_SOWN}_{index}"])
        except (KeyError, TypeError):
            msg = (
                f"No gradient could be attached to the attention call at {'/'.join(path)!r}: "
                "its attention_fn does not call flax.linen.attention."
                "dot_product_attention_weights (the default nn.dot_product_attention does)."
            )
            raise RuntimeError(msg) from None
    return result, capture._replace(gradients=jnp.stack(gradients, axis=-4))


# -- Flax NNX -----------------------------------------------------------------------------------
class _NNXRecorder:
    """Replacement ``attention_fn`` for nnx.MultiHeadAttention that records the weights."""

    def __init__(self, deltas: Sequence[jax.Array] | None = None) -> None:
        self.weights: list[jax.Array] = []
        self.masks: list[Any] = []
        self.deltas = deltas

    def attention(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: Any = None,  # noqa: ARG002 - MultiHeadAttention passes it
        promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
        is_causal: bool = False,
    ) -> jax.Array:
        """Compute ``nnx.dot_product_attention`` explicitly, recording the weights."""
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        weights = nnx_attention.dot_product_attention_weights(
            query,
            key,
            bias,
            mask,
            broadcast_dropout,
            dropout_rng,
            0.0,  # dropout is applied below, after recording
            True,
            query.dtype,
            precision,
            None,
            promote_dtype,
            is_causal,
        )
        index = len(self.weights)
        self.weights.append(weights)
        self.masks.append(mask)
        if self.deltas is not None:
            weights = weights + self.deltas[index]
        if not deterministic and dropout_rate > 0.0 and dropout_rng is not None:
            keep_prob = 1.0 - dropout_rate
            shape = (
                (1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
            )
            keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
            weights = weights * (keep.astype(weights.dtype) / jnp.asarray(keep_prob, weights.dtype))
        if weights.shape[-3] != value.shape[-2]:  # grouped-query attention
            q_heads, v_heads = weights.shape[-3], value.shape[-2]
            grouped = weights.reshape(
                (*weights.shape[:-3], v_heads, q_heads // v_heads, *weights.shape[-2:])
            )
            out = jnp.einsum(
                "...hgqk,...kh1d->...qhgd", grouped, value[..., None, :], precision=precision
            )
            return out.reshape((*out.shape[:-3], q_heads, out.shape[-1]))
        return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def _nnx_targets(model: nnx.Module) -> list[nnx.MultiHeadAttention]:
    found = []
    for _, sub in nnx.iter_modules(model):
        if isinstance(sub, nnx.MultiHeadAttention) and (
            sub.attention_fn is nnx.dot_product_attention
            or sub.attention_fn is nnx_attention.dot_product_attention
        ):
            found.append(sub)
    return found


def _run_nnx(
    recorder: _NNXRecorder, model: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    targets = _nnx_targets(model)  # type: ignore[arg-type, unused-ignore]
    if not targets:
        raise _nothing_captured(nnx=True)
    originals = [t.attention_fn for t in targets]
    with _LOCK:
        try:
            # object.__setattr__: attention_fn is a static attribute, and NNX refuses
            # ordinary attribute writes from inside a JAX trace (jit, grad, eval_shape).
            for t in targets:
                object.__setattr__(t, "attention_fn", recorder.attention)
            outputs = model(*args, **kwargs)
        finally:
            for t, original in zip(targets, originals, strict=True):
                object.__setattr__(t, "attention_fn", original)
    if not recorder.weights:
        raise _nothing_captured(nnx=True)
    return outputs


@overload
def capture_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    heads: CaptureHeads = "each",
    contributions: None = None,
    **kwargs: Any,
) -> tuple[Any, Capture]: ...


@overload
def capture_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    heads: Literal["each"] = "each",
    contributions: Contributions,
    **kwargs: Any,
) -> tuple[Any, ContributionCapture]: ...


def capture_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    heads: CaptureHeads = "each",
    contributions: Contributions | None = None,
    **kwargs: Any,
) -> tuple[Any, Capture | ContributionCapture]:
    """Call a Flax NNX model and capture its attention weights.

    Runs ``model(*args, **kwargs)`` with the ``attention_fn`` of every
    ``flax.nnx.MultiHeadAttention`` that uses the default ``nnx.dot_product_attention``
    replaced by an explicit computation that records the weights, then restores it.
    Outputs equal those of an ordinary call within float rounding. Traceable: call it
    inside :func:`jax.jit` or :func:`flax.nnx.jit`.

    Parameters
    ----------
    model : flax.nnx.Module
        The model (a callable NNX module).
    *args
        Positional arguments of the model call.
    heads : {"each", "mean", "max", "min"}, default "each"
        Fuse the heads of each layer while capturing; ``"each"`` keeps every head
        (``None``, its old spelling, is deprecated).
    contributions : {"norm", "globenc", "alti"} or None, default None
        Record value-aware token-mixing matrices instead (a
        :class:`ContributionCapture`), with the blocks recognised as for
        :func:`capture_linen` (``nnx.MultiHeadAttention``, ``nnx.LayerNorm``,
        ``nnx.RMSNorm``; the value and output projections are its ``value`` and
        ``out``). The calls are followed by wrapping each module class's ``__call__``
        for the duration (acting on the model's own instances only); each attention's
        ``attention_fn`` is called unchanged and its weights are computed beside it, so
        the outputs are those of an ordinary call. Not with `heads`.
    **kwargs
        Keyword arguments of the model call.

    Returns
    -------
    outputs : Any
        The model's outputs.
    capture : Capture or ContributionCapture
        ``attentions`` ``(*batch, layers, [heads,] n, n)`` in call order, ``mask``
        derived from the first attention call's mask (or None), ``gradients`` None.
        With `contributions`: ``contributions`` ``(*batch, layers, n, n)``, ``outputs``
        ``(*batch, layers, n, d)`` and ``mask``.

    Raises
    ------
    RuntimeError
        If the model has no ``nnx.MultiHeadAttention`` with the default attention
        function, or none of them ran.
    ValueError
        On a bad `heads` or `contributions`; with `contributions`, an attention block
        that cannot be decomposed or active dropout.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnflow.adapters.jax import capture_nnx
    >>> mha = nnx.MultiHeadAttention(
    ...     num_heads=2, in_features=4, decode=False, rngs=nnx.Rngs(0)
    ... )
    >>> y, cap = capture_nnx(mha, jnp.ones((1, 3, 4)))
    >>> cap.attentions.shape
    (1, 1, 2, 3, 3)

    A post-LN block, GlobEnc:

    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.attention = nnx.MultiHeadAttention(
    ...             num_heads=2, in_features=4, decode=False, rngs=rngs
    ...         )
    ...         self.norm = nnx.LayerNorm(4, rngs=rngs)
    ...
    ...     def __call__(self, x):
    ...         return self.norm(x + self.attention(x))
    >>> y, cap = capture_nnx(Block(nnx.Rngs(0)), jnp.ones((1, 3, 4)), contributions="globenc")
    >>> cap.contributions.shape
    (1, 1, 3, 3)
    """
    heads = capture_heads(heads, caller="capture_nnx")
    check_contributions(contributions, heads)
    if contributions is not None:
        tracker = BlockTracker(contributions, *read_nnx())
        with _LOCK, nnx_tracking(tracker, model):
            result = model(*args, **kwargs)
        return result, _contribution_capture(tracker, nnx=True)
    recorder = _NNXRecorder()
    outputs = _run_nnx(recorder, model, args, kwargs)
    weights = recorder.weights
    return outputs, Capture(_stack(weights, heads), _padding_mask(recorder.masks[0], weights[0]))


def _gradients_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    target: Callable[[Any], jax.Array],
    **kwargs: Any,
) -> tuple[Any, Capture]:
    """Return the outputs and a :class:`Capture` with ``gradients``, for an NNX model.

    Each attention call adds a zero array to its weights; :func:`jax.value_and_grad`
    of ``target(model(*args, **kwargs))`` with respect to those arrays is the gradient
    with respect to the weights (the perturbation trick).
    """

    def shapes() -> list[jax.Array]:
        recorder = _NNXRecorder()
        _run_nnx(recorder, model, args, kwargs)
        return recorder.weights

    zeros = [jnp.zeros(s.shape, s.dtype) for s in jax.eval_shape(shapes)]

    def scalar(deltas: list[jax.Array]) -> tuple[jax.Array, tuple[Any, Capture]]:
        recorder = _NNXRecorder(deltas)
        outputs = _run_nnx(recorder, model, args, kwargs)
        weights = recorder.weights
        capture = Capture(_stack(weights, "each"), _padding_mask(recorder.masks[0], weights[0]))
        return jnp.asarray(target(outputs)), (outputs, capture)

    (_, (outputs, capture)), grads = jax.value_and_grad(scalar, has_aux=True)(zeros)
    return outputs, capture._replace(gradients=jnp.stack(grads, axis=-4))


def attention_gradients_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    target: Callable[[Any], jax.Array],
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array]:
    """Differentiate a scalar of a linen model's output by its attention weights.

    The adapter's gradients verb, named as in the torch and Keras adapters
    (:func:`attnflow.adapters.torch.attention_gradients`). The weights get a zero
    perturbation (a variable in an ``"attnflow_perturbations"`` collection,
    :meth:`flax.linen.Module.perturb`); :func:`jax.value_and_grad` of
    ``target(outputs)`` with respect to the perturbations gives the gradient with
    respect to the weights. Traceable: wrap it in :func:`jax.jit`. Feed the result to
    :func:`attnflow.gradient_rollout`; the outputs and the padding mask come from
    :func:`capture_linen`.

    Parameters
    ----------
    module : flax.linen.Module
        The model.
    variables : mapping
        Its variables, e.g. ``{"params": params}``.
    *args
        Positional arguments of the model call.
    target : callable
        Maps the model's outputs to a scalar, e.g. ``lambda y: y[:, 0].sum()``.
    **kwargs
        Keyword arguments of ``module.apply``.

    Returns
    -------
    attentions : jax.Array
        ``(*batch, layers, heads, n, n)``, as ``cap.attentions`` of :func:`capture_linen`.
    gradients : jax.Array
        The same shape: ``d target / d attentions``.

    Raises
    ------
    RuntimeError
        If no attention was seen, or no gradient could be attached to some call.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> from attnflow.adapters.jax import attention_gradients_linen
    >>> model = nn.MultiHeadDotProductAttention(num_heads=2)
    >>> x = jnp.ones((1, 3, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> attentions, gradients = attention_gradients_linen(
    ...     model, variables, x, target=lambda y: y[:, 0].sum()
    ... )
    >>> gradients.shape == attentions.shape == (1, 1, 2, 3, 3)
    True
    """
    _, cap = _gradients_linen(module, variables, *args, target=target, **kwargs)
    assert cap.gradients is not None  # _gradients_linen fills them
    return cap.attentions, cap.gradients


def attention_gradients_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    target: Callable[[Any], jax.Array],
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array]:
    """Differentiate a scalar of an NNX model's output by its attention weights.

    As :func:`attention_gradients_linen`, for NNX: each attention call adds a zero array
    to its weights, and :func:`jax.value_and_grad` of ``target(model(*args, **kwargs))``
    with respect to those arrays is the gradient with respect to the weights. Run the
    model deterministically (no state updates during the call). Traceable: wrap it in
    :func:`jax.jit`. The outputs and the padding mask come from :func:`capture_nnx`.

    Parameters
    ----------
    model : flax.nnx.Module
        The model.
    *args
        Positional arguments of the model call.
    target : callable
        Maps the outputs to a scalar, e.g. ``lambda y: y[:, 0].sum()``.
    **kwargs
        Keyword arguments of the model call.

    Returns
    -------
    attentions : jax.Array
        ``(*batch, layers, heads, n, n)``, as ``cap.attentions`` of :func:`capture_nnx`.
    gradients : jax.Array
        The same shape: ``d target / d attentions``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnflow.adapters.jax import attention_gradients_nnx
    >>> mha = nnx.MultiHeadAttention(
    ...     num_heads=2, in_features=4, decode=False, rngs=nnx.Rngs(0)
    ... )
    >>> attentions, gradients = attention_gradients_nnx(
    ...     mha, jnp.ones((1, 3, 4)), target=lambda y: y[:, 0].sum()
    ... )
    >>> gradients.shape == attentions.shape == (1, 1, 2, 3, 3)
    True
    """
    _, cap = _gradients_nnx(model, *args, target=target, **kwargs)
    assert cap.gradients is not None  # _gradients_nnx fills them
    return cap.attentions, cap.gradients


# -- the second gradients verb, until 0.2 -------------------------------------------------------
def gradients_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    target: Callable[[Any], jax.Array],
    **kwargs: Any,
) -> tuple[Any, Capture]:
    """Return ``(outputs, Capture)`` with gradients; deprecated for :func:`attention_gradients_linen`.

    .. deprecated:: 0.1
        One gradients verb per adapter, as in torch and Keras; ``gradients_linen`` goes in
        attnflow 0.2. It returns ``(outputs, Capture)`` with ``gradients`` filled, as before.
    """
    warn_deprecated(
        "attnflow.adapters.jax.gradients_linen",
        "call attention_gradients_linen(...) for (attentions, gradients), and capture_linen "
        "for the outputs and the padding mask",
    )
    return _gradients_linen(module, variables, *args, target=target, **kwargs)


def gradients_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    target: Callable[[Any], jax.Array],
    **kwargs: Any,
) -> tuple[Any, Capture]:
    """Return ``(outputs, Capture)`` with gradients; deprecated for :func:`attention_gradients_nnx`.

    .. deprecated:: 0.1
        One gradients verb per adapter, as in torch and Keras; ``gradients_nnx`` goes in
        attnflow 0.2. It returns ``(outputs, Capture)`` with ``gradients`` filled, as before.
    """
    warn_deprecated(
        "attnflow.adapters.jax.gradients_nnx",
        "call attention_gradients_nnx(...) for (attentions, gradients), and capture_nnx "
        "for the outputs and the padding mask",
    )
    return _gradients_nnx(model, *args, target=target, **kwargs)


def _check_method(
    method: object,
    target: object,
    heads: object = None,
    target_score: object = "logit",
    foil: object = None,
) -> MethodSpec:
    """Check `explain`'s arguments before any work; return the method's spec.

    Decided on the spec's properties, never on its name. `heads` None is the method's
    default: ``"mean"`` (attention), the sum (target-conditioned).
    """
    check_method(method)
    spec = method_spec(method)
    check_target_score(target_score, method)
    if spec.target_conditioned:
        return spec  # the rest is checked by _jax_logit, before the model runs
    if foil is not None:
        msg = (
            f"`foil` contrasts a target's logit with another's (method=\"direct_logit\" or "
            f'"alti_logit"); method="{spec.name}" does not read it. Drop `foil`.'
        )
        raise ValueError(msg)
    if spec.value_aware and heads not in (None, "mean"):
        reject_heads(method, heads)
    if not spec.gradients:
        check_no_target(method, target)
    check_target_type(target, _describe_target, arrays="a 0-d or 1-d integer array")
    return spec


def _class_score(target: Any, target_score: TargetScore) -> Callable[[Any], jax.Array]:
    """Return the scalar that gradient_rollout differentiates, summed over the batch.

    Each sample's target logit, or its log-probability (`target_score`).
    """

    def score(outputs: Any) -> jax.Array:
        logits = _logits_of(outputs)
        classes, _ = _target_classes(target, int(logits.shape[0]), int(logits.shape[1]))
        return _target_score(logits, classes, target_score)

    return score


def explain_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    method: Method = "rollout",
    rows: int | Sequence[int] | None = 0,
    heads: HeadReduction | Literal["sum", "each"] | None = None,
    target: Any = None,
    target_score: TargetScore = "logit",
    foil: Any = None,
    options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> jax.Array:
    r"""Call a Flax linen model and return rollout, flow, GAE or target-conditioned maps.

    Captures with :func:`capture_linen` (heads fused while capturing), then runs
    :func:`attnflow.rollout` or :func:`attnflow.flow` with the captured padding mask. The
    target-conditioned methods of a causal LM (``"direct_logit"``, ``"alti_logit"``,
    ``"ifr"``) read the explained rows, the values and the target's readout from one
    forward instead (see Notes).

    Parameters
    ----------
    module : flax.linen.Module
        The model.
    variables : pytree
        Its variables, as for ``module.apply``.
    *args
        The model's positional inputs.
    method : str, default "rollout"
        The attribution method: ``"raw"``, ``"rollout"``, ``"flow"``,
        ``"gradient_rollout"``, ``"norm"``, ``"globenc"``, ``"alti"``, ``"direct_logit"``,
        ``"alti_logit"`` or ``"ifr"``. Flow runs on the host and cannot be traced.
        ``"gradient_rollout"`` (Chefer et al.'s GAE, :func:`attnflow.gradient_rollout`)
        differentiates the logit of the `target` class of each sample, or its
        log-probability (`target_score`), summed over the
        batch, with respect to every layer's attention weights (:func:`attention_gradients_linen`)
        and pairs weights and gradients layer by layer; it is traceable. ``"norm"``,
        ``"globenc"`` and ``"alti"`` capture the value-aware token-mixing matrices
        (``capture_linen(..., contributions=method)``) and roll them out:
        ``attnflow.rollout(cap.contributions, heads=None, normalize_layers=True,
        residual=0.0, mask=cap.mask)`` (``residual=0.5`` for ``"norm"``, whose matrix
        has no residual); GlobEnc as its authors do, the raw matrices multiplied without
        renormalising rows (``normalize_layers=True`` in `options` for the renormalised
        variant); `options` may override ``residual`` and ``mask``.
        ``"direct_logit"``, ``"alti_logit"`` and ``"ifr"``: see Notes.
    rows : int, sequence of int or None, default 0
        Output positions to explain. Negative rows count from the end of each
        sequence's real tokens (the captured padding mask; outside ``jax.jit``):
        ``rows=-1`` is every sequence's last real token (a causal LM's next-token row).
    heads : {"mean", "max", "min", "sum", "each"} or None, default None
        Head fusion, applied while capturing (rollout and flow, ``"mean"`` by default;
        gradient rollout needs every head and ignores it; the value-aware methods sum
        the heads inside their matrix and refuse any other value). The
        target-conditioned methods: ``"sum"`` (the default) or ``"each"``, one map per
        head, ``(batch, [layers,] heads, [r,] n)``.
    target : int, sequence of int, int array or None, default None
        ``"gradient_rollout"``: the class whose logit is explained (the model returns
        ``(batch, classes)`` logits, or an output with ``.logits``); None for each
        sample's predicted class. ``"direct_logit"`` and ``"alti_logit"``: the vocabulary
        id explained, one for all, one per sample or one per sample and row; None for
        the model's prediction at each explained row.
    target_score : {"logit", "log_probability"}, default "logit"
        ``"gradient_rollout"`` only: what is differentiated, the target's logit
        :math:`z_t` or its log-probability over the classes,
        :math:`\log \operatorname{softmax}(z)_t = z_t - \log \sum_v e^{z_v}`, whose
        gradient :math:`\nabla z_t - \sum_v p_v \nabla z_v` is what raises the target
        above the other classes (as in :func:`attnflow.adapters.torch.explain`). The default target (the argmax) is the
        same for both. Checked before the model runs: another value, or a value other
        than ``"logit"`` with another method, raises a ValueError.
    foil : int, sequence of int, int array or None, default None
        ``"direct_logit"`` and ``"alti_logit"``: a second vocabulary id; the scores then
        explain the target's logit minus the foil's (the difference of the readouts).
    options : mapping, optional
        More options for the method (``residual``, ``layers``, ``mask``, ``rule``,
        ``normalize_result``, ``exclude_self``...). The target-conditioned methods take
        ``layers`` (``"sum"``, ``"all"``: one map per layer, ``"cumulative"``) and, for
        ``"ifr"``, ``span=True`` (the rows as one target span, FlashTrace's aggregate).
    **kwargs
        The model's keyword inputs, as for ``module.apply``.

    Returns
    -------
    jax.Array
        The maps, shaped as :func:`attnflow.rollout` returns them; for the
        target-conditioned methods ``(batch, [layers,] [heads,] n)`` for an int row (or a
        span) and ``(batch, [layers,] [heads,] r, n)`` for ``r`` rows.

    Notes
    -----
    ``"direct_logit"``, ``"alti_logit"`` and ``"ifr"`` (:mod:`attnflow._logit_attribution`;
    docs/llms.md) explain a causal LM that returns logits ``(batch, n, vocabulary)``. Read
    from the model's own calls: **pre-LN** decoder blocks, GPT-2 style,
    :math:`h = x + \mathrm{Attn}(\mathrm{Norm}(x))` (a ``LayerNorm`` or ``RMSNorm`` the
    block calls on its input, then a self-attention ``MultiHeadDotProductAttention``
    with the default attention function and the model's own, e.g. causal, mask), and
    logits returned as the very output of ``Dense(Norm(h))`` or ``Embed.attend(Norm(h))``
    (tied weights). A post-LN block or a head that does more (a scale, a soft-cap) is
    refused. The call is traced abstractly first (:func:`jax.eval_shape`), so a bad
    `target`, `foil` or row and an unsupported model are refused before the model
    computes; every call checks that the final norm and the unembedding give the
    model's own logits at the explained rows. They read concrete values: run them
    eagerly, not under :func:`jax.jit`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from attnflow.adapters.jax import explain_linen
    >>> class Encoder(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         for _ in range(2):
    ...             x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)
    ...         return x
    >>> x = jax.random.normal(jax.random.key(0), (1, 5, 8))
    >>> variables = Encoder().init(jax.random.key(1), x)
    >>> explain_linen(Encoder(), variables, x, rows=0).shape
    (1, 5)

    The direct logit attribution of a small causal LM's next token, per head:

    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, mask):
    ...         attention = nn.MultiHeadDotProductAttention(num_heads=2)
    ...         return x + attention(nn.LayerNorm()(x), mask=mask)
    >>> class LM(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, ids):
    ...         embed = nn.Embed(20, 8)
    ...         x = embed(ids)
    ...         for _ in range(2):
    ...             x = Block()(x, nn.make_causal_mask(ids))
    ...         return embed.attend(nn.LayerNorm()(x))
    >>> ids = jnp.array([[3, 1, 4, 1, 5]])
    >>> lm_variables = LM().init(jax.random.key(0), ids)
    >>> per_head = explain_linen(
    ...     LM(), lm_variables, ids, method="direct_logit", rows=-1, heads="each",
    ...     options={"layers": "all"},
    ... )
    >>> per_head.shape  # (batch, layers, heads, n)
    (1, 2, 2, 5)
    >>> summed = explain_linen(LM(), lm_variables, ids, method="direct_logit", rows=-1)
    >>> bool(jnp.allclose(per_head.sum((1, 2)), summed, atol=1e-6))
    True
    """
    spec = _check_method(method, target, heads, target_score, foil)
    if spec.target_conditioned:
        linen_model = _jax_logit.Model(
            call=lambda: module.apply(variables, *args, **kwargs),
            tracking=lambda tracker: linen_tracking(tracker, _jax_logit.METHODS),
            read=read_linen(),
            lock=_LOCK,
            inputs=(variables, args, kwargs),
        )
        return _jax_logit.explain_target_conditioned(
            linen_model,
            spec=spec,
            rows=rows,
            target=target,
            foil=foil,
            heads="sum" if heads is None else heads,
            options=options,
        )
    if spec.gradients:
        _, cap = _gradients_linen(
            module, variables, *args, target=_class_score(target, target_score), **kwargs
        )
        assert cap.gradients is not None  # _gradients_linen / _gradients_nnx fill them
        grads: jax.Array = explain_gradients(cap.attentions, cap.gradients, cap.mask, rows, options)
        return grads
    if spec.value_aware:
        _, mixing = capture_linen(
            module, variables, *args, contributions=cast(Contributions, spec.matrix), **kwargs
        )
        mixed: jax.Array = explain_contributions(
            mixing.contributions, mixing.mask, method, rows, options
        )
        return mixed
    fused = cast(CaptureHeads, "mean" if heads is None else heads)
    _, cap = capture_linen(module, variables, *args, heads=fused, **kwargs)
    result: jax.Array = explain_weights(cap.attentions, cap.mask, method, rows, fused, options)
    return result


def explain_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    method: Method = "rollout",
    rows: int | Sequence[int] | None = 0,
    heads: HeadReduction | Literal["sum", "each"] | None = None,
    target: Any = None,
    target_score: TargetScore = "logit",
    foil: Any = None,
    options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> jax.Array:
    """Call a Flax NNX model and return rollout, flow, GAE or target-conditioned maps.

    As :func:`explain_linen`, with :func:`capture_nnx`; the target-conditioned methods
    read ``nnx.MultiHeadAttention`` in pre-LN blocks and logits returned by an
    ``nnx.Linear`` or ``nnx.Embed.attend`` on the final ``nnx.LayerNorm`` / ``nnx.RMSNorm``
    (the Notes of :func:`explain_linen`).

    Parameters
    ----------
    model : flax.nnx.Module
        The model.
    *args
        Its positional inputs.
    method : str, default "rollout"
        The attribution method, as for :func:`explain_linen`; ``"gradient_rollout"`` and
        the value-aware methods with :func:`attention_gradients_nnx` and
        :func:`capture_nnx`.
    rows : int, sequence of int or None, default 0
        Output positions to explain. Negative rows count from the end of each
        sequence's real tokens (the captured padding mask; outside ``jax.jit``):
        ``rows=-1`` is every sequence's last real token.
    heads : {"mean", "max", "min", "sum", "each"} or None, default None
        Head fusion, applied while capturing (rollout and flow, ``"mean"`` by default;
        the value-aware methods refuse any other value); ``"sum"`` or ``"each"`` for the
        target-conditioned methods, as for :func:`explain_linen`.
    target : int, sequence of int, int array or None, default None
        ``"gradient_rollout"``: the class whose logit is explained; None for each
        sample's predicted class. ``"direct_logit"`` and ``"alti_logit"``: the vocabulary
        id explained (None: the model's prediction at each row).
    target_score : {"logit", "log_probability"}, default "logit"
        ``"gradient_rollout"`` only: the target's logit or its log-probability, as for
        :func:`explain_linen`.
    foil : int, sequence of int, int array or None, default None
        ``"direct_logit"`` and ``"alti_logit"``: the id contrasted with the target.
    options : mapping, optional
        More options for the method (``residual``, ``layers``, ``mask``, ``rule``,
        ``normalize_result``, ``exclude_self``...); ``layers`` and ``span`` for the
        target-conditioned methods.
    **kwargs
        Its keyword inputs.

    Returns
    -------
    jax.Array
        The maps, shaped as :func:`attnflow.rollout` returns them.

    Examples
    --------
    >>> import jax, flax.nnx as nnx
    >>> from attnflow.adapters.jax import explain_nnx
    >>> attention = nnx.MultiHeadAttention(
    ...     num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)
    ... )
    >>> x = jax.random.normal(jax.random.key(0), (1, 5, 8))
    >>> explain_nnx(attention, x, method="flow", rows=[0, 1]).shape
    (1, 2, 5)
    """
    spec = _check_method(method, target, heads, target_score, foil)
    if spec.target_conditioned:
        nnx_model = _jax_logit.Model(
            call=lambda: model(*args, **kwargs),
            tracking=lambda tracker: nnx_tracking(tracker, model, _jax_logit.METHODS),
            read=read_nnx(),
            lock=_LOCK,
            inputs=(args, kwargs),
        )
        return _jax_logit.explain_target_conditioned(
            nnx_model,
            spec=spec,
            rows=rows,
            target=target,
            foil=foil,
            heads="sum" if heads is None else heads,
            options=options,
        )
    if spec.gradients:
        _, cap = _gradients_nnx(model, *args, target=_class_score(target, target_score), **kwargs)
        assert cap.gradients is not None  # _gradients_linen / _gradients_nnx fill them
        grads: jax.Array = explain_gradients(cap.attentions, cap.gradients, cap.mask, rows, options)
        return grads
    if spec.value_aware:
        _, mixing = capture_nnx(
            model, *args, contributions=cast(Contributions, spec.matrix), **kwargs
        )
        mixed: jax.Array = explain_contributions(
            mixing.contributions, mixing.mask, method, rows, options
        )
        return mixed
    fused = cast(CaptureHeads, "mean" if heads is None else heads)
    _, cap = capture_nnx(model, *args, heads=fused, **kwargs)
    result: jax.Array = explain_weights(cap.attentions, cap.mask, method, rows, fused, options)
    return result


# -- input gradients ----------------------------------------------------------------------------
def _describe_target(target: object) -> tuple[bool, str] | None:
    """Read an array `target` for check_target_type: a valid one is 0-d or 1-d integer."""
    if not isinstance(target, jax.Array | np.ndarray):
        return None
    valid = bool(jnp.issubdtype(target.dtype, jnp.integer)) and np.ndim(target) <= 1
    return valid, f"a {target.dtype} array of shape {tuple(target.shape)}"


def _target_classes(target: Any, batch: int, classes: int) -> tuple[Any, Any]:
    """Resolve `target` to ``(batch,)`` classes and, for a traced array, validity flags.

    Python ints and concrete arrays are checked here, before the backward pass; a traced
    array (under ``jax.jit``) cannot be, so its out-of-range entries are flagged and their
    rows of the result become NaN. None stays None (the argmax is taken on the logits).
    """
    if target is None:
        return None, None
    traced = isinstance(target, jax.core.Tracer)
    if is_class_index(target):
        values: Any = [int(target)] * batch
    elif isinstance(target, jax.Array | np.ndarray):
        if target.ndim == 1 and target.shape[0] != batch:
            values = [0] * int(target.shape[0])  # reported as a wrong length below
        elif traced:
            flags = jnp.broadcast_to((target >= 0) & (target < classes), (batch,))
            return jnp.broadcast_to(target, (batch,)), flags
        else:
            values = [int(v) for v in np.broadcast_to(np.asarray(target), (batch,))]
    else:
        values = [int(v) for v in target]
    check_class_values(values, batch, classes)
    return jnp.asarray(values, dtype=jnp.int32), None


def _logits_of(outputs: Any) -> jax.Array:
    """Read the ``(batch, classes)`` logits of a model call: an array or ``outputs.logits``."""
    logits = outputs if isinstance(outputs, jax.Array) else getattr(outputs, "logits", None)
    if (
        isinstance(logits, jax.Array)
        and logits.ndim == 2
        and jnp.issubdtype(logits.dtype, jnp.floating)
    ):
        return logits
    if isinstance(logits, jax.Array):
        found = f"an array of shape {tuple(logits.shape)} ({logits.dtype})"
    else:
        found = f"a {type(outputs).__name__} without a `logits` array"
    msg = (
        "Input gradients need a classifier: a model returning floating logits of shape "
        f"(batch, classes), as an array or as `.logits`; got {found}. Wrap the model so that "
        "it returns them, e.g. a Dense head on the first token's state."
    )
    raise TypeError(msg)


def _target_score(
    logits: jax.Array, classes: jax.Array | None, output: Score | TargetScore
) -> jax.Array:
    """Sum over the batch of each sample's target probability, log-probability or logit."""
    if classes is None:
        classes = jnp.argmax(jax.lax.stop_gradient(logits), axis=-1)
    scores = score_values(
        logits,
        output,
        lambda z: jax.nn.softmax(z, axis=-1),
        lambda z: jax.nn.log_softmax(z, axis=-1),
    )
    index = jnp.clip(classes, 0, logits.shape[-1] - 1).astype(jnp.int32)
    return jnp.sum(jnp.take_along_axis(scores, index[:, None], axis=-1))


def _reduce_hidden(grads: jax.Array, embedded: jax.Array, reduce: Reduction) -> jax.Array:
    """Reduce ``(batch, n, d)`` gradients over the hidden axis to ``(batch, n)``."""
    if reduce == "l2":
        norm: jax.Array = jnp.linalg.norm(grads, axis=-1)
        return norm
    if reduce == "sum_abs":
        return jnp.abs(jnp.sum(grads, axis=-1))
    return jnp.abs(jnp.sum(grads * embedded, axis=-1))


class _EmbeddingRecorder:
    """Records the outputs of the embedding site and adds `delta` to the first one."""

    def __init__(self, delta: jax.Array | None, name: str) -> None:
        self.delta = delta
        self.name = name
        self.outputs: list[jax.Array] = []

    def record(self, output: Any) -> Any:
        if not isinstance(output, jax.Array) or not jnp.issubdtype(output.dtype, jnp.floating):
            found = type(output).__name__
            if isinstance(output, jax.Array):
                found = f"a {output.dtype} array"
            msg = (
                f"The embedding module {self.name} returned {found}; input gradients need a "
                "floating array (batch, n, d): name the module that returns the token "
                "embeddings in `embeddings`."
            )
            raise TypeError(msg)
        self.outputs.append(output)
        if self.delta is not None and len(self.outputs) == 1:
            # The gradient w.r.t. this zero is the gradient w.r.t. the embeddings.
            return output + self.delta
        return output


def _input_gradients(
    run: Callable[[jax.Array | None], tuple[Any, _EmbeddingRecorder]],
    target: Any,
    reduce: Reduction,
    output: Score,
) -> jax.Array:
    """Shape pass, checks, then one differentiated pass (shared by linen and NNX)."""
    found: list[_EmbeddingRecorder] = []

    def shapes() -> tuple[jax.Array, list[jax.Array]]:
        outputs, recorder = run(None)
        found.append(recorder)
        return _logits_of(outputs), recorder.outputs

    logits, embedded = jax.eval_shape(shapes)
    name = found[0].name
    if len(embedded) != 1:
        msg = (
            f"The embedding module {name} ran {len(embedded)} times in one model call; input "
            "gradients need it to run exactly once: name in `embeddings` the module that "
            "embeds the input tokens, once."
        )
        raise RuntimeError(msg)
    batch, classes = logits.shape
    if len(embedded[0].shape) != 3 or embedded[0].shape[0] != batch:
        msg = (
            f"The output of the embedding module {name} has shape {tuple(embedded[0].shape)}; "
            f"input gradients need (batch, n, d) with batch = {batch} as in the logits: name "
            "the batch-first token embedding module in `embeddings`."
        )
        raise ValueError(msg)
    indices, valid = _target_classes(target, batch, classes)

    def score(delta: jax.Array) -> tuple[jax.Array, jax.Array]:
        outputs, recorder = run(delta)
        if len(recorder.outputs) != 1:
            msg = f"The embedding module {name} ran {len(recorder.outputs)} times, not once."
            raise RuntimeError(msg)
        value = _target_score(_logits_of(outputs), indices, output)
        return value, jax.lax.stop_gradient(recorder.outputs[0])

    zeros = jnp.zeros(embedded[0].shape, embedded[0].dtype)
    grads, values = jax.grad(score, has_aux=True)(zeros)
    result = _reduce_hidden(grads, values, reduce)
    if valid is not None:  # a traced target: out-of-range classes give NaN rows
        result = jnp.where(valid[:, None], result, jnp.nan)
    return result


class _LinenEmbeddingSite:
    """Interceptor that finds the embedding module's call and perturbs its output."""

    def __init__(self, path: tuple[str, ...] | None, delta: jax.Array | None) -> None:
        self.path = path
        self.delta = delta
        self.recorder = _EmbeddingRecorder(delta, "?" if path is None else repr("/".join(path)))
        self.embeds: list[tuple[str, ...]] = []  # paths of the nn.Embed calls, in order
        self.ran: set[tuple[str, ...]] = set()  # paths of every module called

    def intercept(
        self,
        next_fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: Any,
    ) -> Any:
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        module = context.module
        path = tuple(module.scope.path) if module.scope is not None else ()
        self.ran.add(path)
        if isinstance(module, nn.Embed):
            self.embeds.append(path)
        if self.path is None or path != self.path:
            return next_fun(*args, **kwargs)
        return self.recorder.record(next_fun(*args, **kwargs))


def _linen_path(embeddings: object) -> tuple[str, ...] | None:
    if embeddings is None:
        return None
    if isinstance(embeddings, str) and embeddings and all(embeddings.split("/")):
        return tuple(embeddings.split("/"))
    msg = (
        "`embeddings` must be the path of the linen submodule whose output is "
        'differentiated, its names joined by "/" as in the params tree (e.g. "embed" or '
        f'"encoder/embed"), or None for the model\'s only nn.Embed; got {embeddings!r}.'
    )
    raise TypeError(msg)


def _default_linen_path(
    module: nn.Module, variables: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, ...]:
    """Find the path of the only nn.Embed that runs (a shape-only trace)."""
    seen: list[_LinenEmbeddingSite] = []

    def trace() -> None:
        site = _LinenEmbeddingSite(None, None)
        seen.append(site)
        with _LOCK, nn.intercept_methods(site.intercept):
            module.apply(variables, *args, **kwargs)

    jax.eval_shape(trace)
    paths = sorted(set(seen[0].embeds))
    if len(paths) == 1:
        return paths[0]
    names = ", ".join(repr("/".join(p)) for p in paths)
    msg = (
        f"{type(module).__name__} runs {'no' if not paths else 'several'} flax.linen.Embed "
        f"modules{': ' + names if paths else ''}, so the token embeddings are not known: pass "
        '`embeddings=` the path of the one to differentiate (e.g. embeddings="embed").'
    )
    raise ValueError(msg)


def input_gradients_linen(
    module: nn.Module,
    variables: Any,
    /,
    *args: Any,
    target: int | Sequence[int] | jax.Array | None = None,
    embeddings: str | None = None,
    reduce: Reduction = "l2",
    output: Score = "probability",
    **kwargs: Any,
) -> jax.Array:
    r"""Input-gradient importance of each token for a linen classifier's prediction.

    The gradient of the target class's score with respect to the output of the
    embedding module, reduced over the hidden axis to one number per token: the
    input-gradient attribution that Abnar & Zuidema (2020) compare attention rollout and
    attention flow with. For sample :math:`b` with target class :math:`t_b`, logits
    :math:`z_b` and token embeddings :math:`e_{b,i} \in \mathbb{R}^d` (the embedding
    module's output),

    .. math::

        s_b = \operatorname{softmax}(z_b)_{t_b} \ \text{(or } z_{b,t_b}\text{)}, \qquad
        g_{b,i} = \frac{\partial s_b}{\partial e_{b,i}},

    and the importance of token :math:`i` is :math:`\lVert g_{b,i} \rVert_2`
    (``"l2"``), :math:`\lvert \sum_k g_{b,i,k} \rvert` (``"sum_abs"``, as in the paper's
    code) or :math:`\lvert \sum_k g_{b,i,k}\, e_{b,i,k} \rvert` (``"x_input"``,
    gradient times input).

    How: :func:`flax.linen.intercept_methods` adds a zero array to the output of the
    embedding module's ``__call__``, and :func:`jax.grad` of the summed target scores
    with respect to that zero gives the gradient with respect to the embeddings (samples
    are independent, so each sample gets its own gradient). A shape-only trace
    (:func:`jax.eval_shape`) first finds the module and the shapes. Traceable: wrap it
    in :func:`jax.jit`.

    Parameters
    ----------
    module : flax.linen.Module
        A classifier: ``module.apply(variables, *args, **kwargs)`` returns logits of
        shape ``(batch, classes)``, as an array or as ``.logits``. Run it
        deterministically (no dropout).
    variables : mapping
        Its variables, e.g. ``{"params": params}``.
    *args
        Positional arguments of the model call (the token ids).
    target : int, sequence of int, int array or None, default None
        The class to explain: None for each sample's predicted class (argmax of its
        logits), an int for every sample, or one class per sample. Python ints and
        concrete arrays are checked against the number of classes; under
        :func:`jax.jit` a traced array cannot be, and a sample whose class is out of
        range gets a row of NaN.
    embeddings : str, optional
        The path of the submodule whose output is differentiated, its names joined by
        ``"/"`` as in the params tree (``"embed"``, ``"encoder/embed"``); by default
        the only ``flax.linen.Embed`` that runs. Its ``__call__`` must run exactly
        once and return ``(batch, n, d)``.
    reduce : {"l2", "sum_abs", "x_input"}, default "l2"
        How the hidden axis is reduced (see above).
    output : {"probability", "logit"}, default "probability"
        Differentiate the softmax probability of the target class or its logit.
    **kwargs
        Keyword arguments of ``module.apply`` (model keywords, ``rngs``, ``method``);
        not ``mutable``.

    Returns
    -------
    jax.Array
        ``(batch, n)`` importances, in the floating dtype of the embeddings.

    Raises
    ------
    TypeError
        If `module` is not a linen module, `target` or `embeddings` has the wrong type,
        or the model does not return ``(batch, classes)`` logits.
    ValueError
        On a bad `reduce` or `output`, a target out of range or of the wrong length, a
        ``mutable`` keyword, an embedding output that is not ``(batch, n, d)``, or, with
        `embeddings` not given, no or several ``nn.Embed`` modules.
    RuntimeError
        If the embedding module does not run exactly once.

    Notes
    -----
    ``"sum_abs"`` is zero, up to rounding, when the embedding output reaches the rest of
    the model only through a LayerNorm of a sum (BERT-like models: word + position
    embeddings, then LayerNorm), since LayerNorm ignores a shift of all coordinates;
    use ``"l2"`` or ``"x_input"`` there.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] K. Simonyan, A. Vedaldi and A. Zisserman, "Deep Inside Convolutional Networks:
       Visualising Image Classification Models and Saliency Maps", ICLR Workshop 2014,
       https://arxiv.org/abs/1312.6034

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> from attnflow.adapters.jax import input_gradients_linen
    >>> class Classifier(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, ids):
    ...         x = nn.Embed(10, 8, name="embed")(ids)
    ...         for _ in range(2):
    ...             x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x)
    ...         return nn.Dense(3)(x[:, 0])
    >>> ids = jnp.array([[1, 4, 2, 7], [3, 3, 5, 9]])
    >>> model = Classifier()
    >>> variables = model.init(jax.random.key(0), ids)
    >>> input_gradients_linen(model, variables, ids).shape
    (2, 4)
    >>> explain = jax.jit(
    ...     lambda v, i: input_gradients_linen(model, v, i, target=2, reduce="x_input")
    ... )
    >>> explain(variables, ids).shape
    (2, 4)
    """
    given: object = module
    if not isinstance(given, nn.Module):
        msg = (
            "input_gradients_linen() expects a flax.linen.Module (the classifier); got "
            f"{type(given).__name__}."
        )
        raise TypeError(msg)
    check_reduce_output(reduce, output)
    check_target_type(target, _describe_target, arrays="a 0-d or 1-d integer array")
    path = _linen_path(embeddings)
    if "mutable" in kwargs:
        msg = (
            "input_gradients_linen() differentiates a pure call: `mutable` is not supported. "
            "Run the model in inference mode (e.g. BatchNorm with use_running_average=True)."
        )
        raise ValueError(msg)
    if path is None:
        path = _default_linen_path(module, variables, args, kwargs)
    chosen = path

    def run(delta: jax.Array | None) -> tuple[Any, _EmbeddingRecorder]:
        site = _LinenEmbeddingSite(chosen, delta)
        with _LOCK, nn.intercept_methods(site.intercept):
            outputs = module.apply(variables, *args, **kwargs)
        if not site.recorder.outputs and chosen not in site.ran:
            ran = ", ".join(repr("/".join(p)) for p in sorted(site.ran) if p)
            msg = (
                f"No submodule at {'/'.join(chosen)!r} ran in the model call; `embeddings` "
                f"names one by its path, e.g. one of {ran or 'none ran'}."
            )
            raise ValueError(msg)
        return outputs, site.recorder

    return _input_gradients(run, target, reduce, output)


# -- input gradients, NNX -----------------------------------------------------------------------
def _nnx_embedding(model: nnx.Module, embeddings: object) -> tuple[nnx.Module, str]:
    """Find the module whose output is differentiated, with its path for messages."""
    modules: dict[int, tuple[nnx.Module, str]] = {}
    for path, sub in nnx.iter_modules(model):
        modules.setdefault(id(sub), (sub, "/".join(str(p) for p in path) or "<model>"))
    if embeddings is not None:
        if not isinstance(embeddings, nnx.Module):
            msg = (
                "`embeddings` must be the flax.nnx.Module of the model that returns the token "
                f"embeddings (e.g. model.embed); got {type(embeddings).__name__}."
            )
            raise TypeError(msg)
        if id(embeddings) not in modules:
            msg = (
                f"`embeddings` ({type(embeddings).__name__}) is not a submodule of "
                f"{type(model).__name__}: pass one of its modules, e.g. model.embed (inside "
                "nnx.jit, the module of the traced model)."
            )
            raise ValueError(msg)
        return modules[id(embeddings)]
    found = [(m, p) for m, p in modules.values() if isinstance(m, nnx.Embed)]
    if len(found) == 1:
        return found[0]
    names = ", ".join(repr(p) for _, p in found)
    msg = (
        f"{type(model).__name__} has {'no' if not found else 'several'} flax.nnx.Embed "
        f"modules{': ' + names if found else ''}, so the token embeddings are not known: "
        "pass `embeddings=` the module to differentiate (e.g. embeddings=model.embed)."
    )
    raise ValueError(msg)


@contextlib.contextmanager
def _output_hooked(site: nnx.Module, recorder: _EmbeddingRecorder) -> Iterator[None]:
    """Route the output of ``site.__call__`` through `recorder` (this instance only).

    Python looks ``__call__`` up on the class, so the class method is wrapped for the
    duration and the wrapper acts on `site` alone; other instances run as usual.
    """
    cls = type(site)
    own = cls.__dict__.get("__call__")
    original: Callable[..., Any] = cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        return recorder.record(result) if self is site else result

    cls.__call__ = __call__  # type: ignore[method-assign, assignment, unused-ignore]
    try:
        yield
    finally:
        if own is not None:
            cls.__call__ = own  # type: ignore[method-assign, unused-ignore]
        else:
            del cls.__call__


def input_gradients_nnx(
    model: nnx.Module,
    /,
    *args: Any,
    target: int | Sequence[int] | jax.Array | None = None,
    embeddings: nnx.Module | None = None,
    reduce: Reduction = "l2",
    output: Score = "probability",
    **kwargs: Any,
) -> jax.Array:
    r"""Input-gradient importance of each token for an NNX classifier's prediction.

    As :func:`input_gradients_linen`: with :math:`s_b` the target class's probability
    (or logit) of sample :math:`b` and :math:`g_{b,i} = \partial s_b / \partial e_{b,i}`
    the gradient with respect to the embedding module's output, the importance of token
    :math:`i` is :math:`\lVert g_{b,i} \rVert_2` (``"l2"``),
    :math:`\lvert \sum_k g_{b,i,k} \rvert` (``"sum_abs"``) or
    :math:`\lvert \sum_k g_{b,i,k}\, e_{b,i,k} \rvert` (``"x_input"``).

    How: while the model runs, the embedding module's output gets a zero array added
    (its class's ``__call__`` is wrapped for the duration of the call, acting on that
    instance only, and restored afterwards), and :func:`jax.grad` of the summed target
    scores with respect to the zero gives the gradient. Run the model deterministically
    (no state updates during the call). Traceable: call it inside :func:`jax.jit` or
    :func:`flax.nnx.jit`.

    Parameters
    ----------
    model : flax.nnx.Module
        A classifier: ``model(*args, **kwargs)`` returns logits ``(batch, classes)``, as
        an array or as ``.logits``.
    *args
        Positional arguments of the model call (the token ids).
    target : int, sequence of int, int array or None, default None
        The class to explain, as for :func:`input_gradients_linen`.
    embeddings : flax.nnx.Module, optional
        The submodule whose output is differentiated; by default the model's only
        ``flax.nnx.Embed``. It must run exactly once and return ``(batch, n, d)``.
    reduce : {"l2", "sum_abs", "x_input"}, default "l2"
        How the hidden axis is reduced.
    output : {"probability", "logit"}, default "probability"
        Differentiate the softmax probability of the target class or its logit.
    **kwargs
        Keyword arguments of the model call.

    Returns
    -------
    jax.Array
        ``(batch, n)`` importances, in the floating dtype of the embeddings.

    Raises
    ------
    TypeError
        If `model` or `embeddings` is not an NNX module, `target` has the wrong type, or
        the model does not return ``(batch, classes)`` logits.
    ValueError
        On a bad `reduce` or `output`, a target out of range or of the wrong length, an
        `embeddings` module that is not part of `model`, an embedding output that is not
        ``(batch, n, d)``, or, with `embeddings` not given, no or several ``nnx.Embed``.
    RuntimeError
        If the embedding module does not run exactly once.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnflow.adapters.jax import input_gradients_nnx
    >>> class Classifier(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.embed = nnx.Embed(10, 8, rngs=rngs)
    ...         self.attention = nnx.MultiHeadAttention(
    ...             num_heads=2, in_features=8, decode=False, rngs=rngs
    ...         )
    ...         self.head = nnx.Linear(8, 3, rngs=rngs)
    ...
    ...     def __call__(self, ids):
    ...         x = self.embed(ids)
    ...         x = x + self.attention(x)
    ...         return self.head(x[:, 0])
    >>> model = Classifier(nnx.Rngs(0))
    >>> ids = jnp.array([[1, 4, 2, 7], [3, 3, 5, 9]])
    >>> input_gradients_nnx(model, ids, target=[0, 2], output="logit").shape
    (2, 4)
    """
    given: object = model
    if not isinstance(given, nnx.Module):
        msg = (
            "input_gradients_nnx() expects a flax.nnx.Module (the classifier); got "
            f"{type(given).__name__}."
        )
        raise TypeError(msg)
    check_reduce_output(reduce, output)
    check_target_type(target, _describe_target, arrays="a 0-d or 1-d integer array")
    site, name = _nnx_embedding(model, embeddings)

    def run(delta: jax.Array | None) -> tuple[Any, _EmbeddingRecorder]:
        recorder = _EmbeddingRecorder(delta, repr(name))
        with _LOCK, _output_hooked(site, recorder):
            outputs = model(*args, **kwargs)
        return outputs, recorder

    return _input_gradients(run, target, reduce, output)
