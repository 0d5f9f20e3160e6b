"""What the torch, JAX and Keras adapters share: argument checks and the ``explain`` dispatch.

Framework-neutral: nothing here imports a deep-learning framework. Each adapter captures
the attention (or the value-aware matrices) its own way, then hands the arrays to the
functions below, which check the arguments and pick the core method, so that the three
adapters accept the same values and raise the same messages. Framework tensors enter only
as opaque values (a ``describe`` callable reads them for :func:`check_target_type`).
"""

from __future__ import annotations

import math
import numbers
import typing
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import attnflow
from attnflow._deprecation import MISSING, renamed_keyword, warn_deprecated
from attnflow._methods import METHODS as METHOD_SPECS
from attnflow._methods import MethodSpec, method_spec
from attnflow._real_rows import by_real_end

__all__ = [
    "CONTRIBUTIONS",
    "HEAD_REDUCTIONS",
    "METHODS",
    "TARGET_SCORES",
    "CaptureBlock",
    "CaptureHeads",
    "Contributions",
    "HeadReduction",
    "Method",
    "Reduction",
    "Score",
    "TargetScore",
    "by_real_end",
    "capture_heads",
    "check_class_values",
    "check_contribution_method",
    "check_contributions",
    "check_explained_rows",
    "check_heads",
    "check_method",
    "check_no_target",
    "check_reduce_output",
    "check_scalar_shape",
    "check_scalar_target",
    "check_target_options",
    "check_target_score",
    "check_target_type",
    "explain_contributions",
    "explain_gradients",
    "explain_weights",
    "fuses_while_capturing",
    "is_class_index",
    "reject_heads",
    "score_values",
]

#: How the adapters fuse heads while capturing: the named subset of the core's
#: :data:`attnflow._typing.HeadFusion` (no callables, weights or ``"each"``).
HeadReduction = Literal["mean", "max", "min"]
HEAD_REDUCTIONS: tuple[HeadReduction, ...] = ("mean", "max", "min")
#: What a capture does with each layer's heads: keep every head (``"each"``, the default,
#: as the core's ``heads="each"`` keeps one map per head) or fuse them while capturing.
#: (``None`` meant "each" before 0.1; in the core, ``heads=None`` means "already fused".)
CaptureHeads = Literal["each", "mean", "max", "min"]
#: The value-aware token-mixing rules of attnflow.contributions.
Contributions = Literal["norm", "globenc", "alti"]
CONTRIBUTIONS: tuple[Contributions, ...] = ("norm", "globenc", "alti")
#: The methods of the adapters' ``explain`` functions, for type checkers only: every method
#: of the registry (:data:`attnflow._methods.METHODS`), which the code reads (a test keeps
#: the two equal). Adding a method to the registry adds its name here.
Method = Literal[
    "raw",
    "rollout",
    "flow",
    "gradient_rollout",
    "norm",
    "globenc",
    "alti",
    "direct_logit",
    "alti_logit",
    "ifr",
]
METHODS = typing.cast("tuple[Method, ...]", tuple(METHOD_SPECS))
#: How input gradients are reduced over the hidden axis.
Reduction = Literal["l2", "sum_abs", "x_input"]
#: What input gradients differentiate: the target class's probability or its logit.
Score = Literal["probability", "logit"]
#: What gradient rollout in ``explain`` differentiates at an explained row: the target's
#: logit, or its log-probability (the target's entry of the log-softmax of the logits).
TargetScore = Literal["logit", "log_probability"]
TARGET_SCORES: tuple[TargetScore, ...] = typing.get_args(TargetScore)


# -- heads and contributions ----------------------------------------------------------------
def capture_heads(heads: object, *, caller: str, stacklevel: int = 4) -> CaptureHeads:
    """Check a capture's `heads`, reading the deprecated ``None`` as ``"each"``.

    `caller` names the function in the warning; `stacklevel` points it at the user's
    call (4: the caller of the function that calls this one).
    """
    if heads is None:
        warn_deprecated(
            f"{caller}(heads=None)",
            'pass heads="each" to keep every head (in rollout, flow and the rest of attnflow '
            "heads=None means that the heads are already fused)",
            stacklevel=stacklevel,
        )
        return "each"
    check_heads(heads)
    return typing.cast("CaptureHeads", heads)


def check_heads(heads: object, *, optional: bool = True) -> None:
    """Check a capture's `heads` ("each" allowed) or, with ``optional=False``, a fused one."""
    if optional and heads not in ("each", *HEAD_REDUCTIONS):
        msg = (
            '`heads` must be "each" (keep every head), "mean", "max" or "min" (fuse them '
            f"while capturing); got {heads!r}."
        )
        raise ValueError(msg)
    if not optional and heads not in HEAD_REDUCTIONS:
        msg = f'`heads` must be "mean", "max" or "min"; got {heads!r}.'
        raise ValueError(msg)


def fuses_while_capturing(heads: object) -> bool:
    """Whether `explain` fuses `heads` while capturing (a name) or leaves it to the method."""
    return isinstance(heads, str) and heads in HEAD_REDUCTIONS


def check_contribution_method(contributions: object) -> None:
    """Check a capture's `contributions`: None or one of :data:`CONTRIBUTIONS`."""
    if contributions not in (None, *CONTRIBUTIONS):
        msg = (
            '`contributions` must be None (capture attention weights), "norm" '
            '(Kobayashi et al. 2020), "globenc" (Modarressi et al. 2022) or "alti" '
            f"(Ferrando et al. 2022); got {contributions!r}."
        )
        raise ValueError(msg)


def check_contributions(contributions: object, heads: object) -> None:
    """Check `contributions`, which records matrices, not weights, so takes no `heads`."""
    check_contribution_method(contributions)
    if contributions is not None and heads != "each":
        msg = (
            f"contributions={contributions!r} records one token-mixing matrix per layer, "
            f"not attention weights: drop `heads` (got heads={heads!r})."
        )
        raise ValueError(msg)


# -- the `with` block of torch's and Keras's Capture -------------------------------------------
class CaptureBlock:
    """The context-manager protocol that torch's and Keras's ``Capture`` share.

    One ``with`` block per capture: :meth:`_prepare` checks the model (and builds the
    value-aware recorder), :meth:`_install_hooks` patches it, :meth:`_restore` undoes that
    on exit or on a failed install, and a block that ends without error is checked. The
    adapter names what it records (``_RECORDS``) and what to do when nothing ran
    (:meth:`_nothing_captured`).
    """

    _RECORDS = "attention weights"
    model: Any
    contribution_method: Contributions | None
    _recorder: Any
    _records: list[Any]
    _active: bool
    _used: bool

    def _prepare(self) -> None:
        raise NotImplementedError

    def _install_hooks(self) -> None:
        raise NotImplementedError

    def _restore(self) -> None:
        raise NotImplementedError

    def _check_contributions(self, recorder: Any) -> None:
        raise NotImplementedError

    def _nothing_captured(self) -> str:
        raise NotImplementedError

    def __enter__(self) -> Self:
        if self._used:
            msg = "A Capture records one `with` block; call capture(model) again for another."
            raise RuntimeError(msg)
        self._used = True
        self._prepare()
        try:
            self._install_hooks()
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._active = False
        self._restore()
        if exc_type is None and self._recorder is not None:
            self._check_contributions(self._recorder)
            return
        if exc_type is None and not self._records:
            raise RuntimeError(self._nothing_captured())

    def _recorded(self, name: str) -> Any:
        """Return the value-aware recorder once it has recorded; `name` is the result read."""
        recorder = self._recorder
        if recorder is None:
            msg = (
                f'`{name}` needs capture(model, contributions="norm" | "globenc" | '
                f'"alti"); this capture recorded {self._RECORDS} (read `attentions`).'
            )
            raise RuntimeError(msg)
        if not recorder.matrices:
            msg = f"Nothing was captured: read `{name}` after calling the model in the block."
            raise RuntimeError(msg)
        return recorder


# -- explain ----------------------------------------------------------------------------------
def check_explained_rows(rows: object) -> list[int]:
    """Return the rows of a target-conditioned method as a non-empty list of int positions."""
    if isinstance(rows, bool) or not isinstance(rows, int | Sequence) or isinstance(rows, str):
        msg = (
            "`rows` of a target-conditioned method must be an int or a sequence of ints (the "
            f"explained positions; -1 is the last real token); got {rows!r}."
        )
        raise TypeError(msg)
    chosen = [rows] if isinstance(rows, int) else list(rows)
    if not chosen or not all(isinstance(r, int) and not isinstance(r, bool) for r in chosen):
        msg = f"`rows` must name at least one position, as ints; got {rows!r}."
        raise ValueError(msg)
    return chosen


def check_target_options(spec: MethodSpec, heads: object, layers: object, span: object) -> None:
    """Check a target-conditioned method's `heads`, `layers` and `span`, before any work."""
    if heads not in ("sum", "each"):
        msg = (
            f'`heads` of method="{spec.name}" must be "sum" or "each" (one map per head); got '
            f"{heads!r}."
        )
        raise ValueError(msg)
    if layers not in ("sum", "all", "cumulative"):
        msg = (
            f'`layers` of method="{spec.name}" must be "sum", "all" (one map per layer) or '
            f'"cumulative" (layer l: the layers up to l); got {layers!r}.'
        )
        raise ValueError(msg)
    if not isinstance(span, bool):
        msg = f"`span` must be True or False; got {span!r}."
        raise TypeError(msg)
    if span and spec.uses_target:
        msg = (
            f'`span` aggregates IFR over a target span (method="ifr"); method="{spec.name}" '
            "explains each row: sum its rows instead."
        )
        raise ValueError(msg)


def check_method(method: object) -> None:
    """Check `explain`'s `method`: a name of the method registry (every adapter takes all)."""
    method_spec(method)


def check_no_target(method: object, target: object) -> None:
    """Refuse a `target` for a method without gradients."""
    if target is not None:
        with_gradients = _gradient_methods()
        msg = (
            f"`target` selects the class explained by method={with_gradients}; {method} "
            f"does not use gradients. Drop `target`, or pass method={with_gradients}."
        )
        raise ValueError(msg)


def check_target_score(target_score: object, method: object = None) -> None:
    """Check `target_score` before any work: a name of :data:`TARGET_SCORES`.

    Only a method with gradients (:attr:`MethodSpec.gradients`) differentiates a score:
    another `method` takes the default, ``"logit"``, alone (it is refused otherwise, as a
    `target` is). `method` None checks the name only.
    """
    if not isinstance(target_score, str) or target_score not in TARGET_SCORES:
        msg = (
            '`target_score` must be "logit" (the target\'s logit) or "log_probability" (its '
            f"log-softmax over the classes or the vocabulary); got {target_score!r}."
        )
        raise ValueError(msg)
    if target_score != "logit" and method is not None and not method_spec(method).gradients:
        with_gradients = _gradient_methods()
        msg = (
            f"`target_score` chooses what method={with_gradients} differentiates; "
            f"{method} does not use gradients. Drop `target_score`, or pass "
            f"method={with_gradients}."
        )
        raise ValueError(msg)


def _gradient_methods() -> str:
    """Return the registry's methods with gradients, quoted for an error message."""
    return " or ".join(f'"{name}"' for name, spec in METHOD_SPECS.items() if spec.gradients)


def score_values(
    logits: Any,
    output: Score | TargetScore,
    softmax: Callable[[Any], Any],
    log_softmax: Callable[[Any], Any],
) -> Any:
    r"""Return what a target score reads of `logits` ``(batch, classes)``, per class.

    ``"probability"``: :math:`\operatorname{softmax}(z)`; ``"log_probability"``:
    :math:`\log \operatorname{softmax}(z) = z - \log \sum_v e^{z_v}`; ``"logit"``: `z`
    itself. `softmax` and `log_softmax` are the framework's, over the last axis.
    """
    if output == "probability":
        return softmax(logits)
    if output == "log_probability":
        return log_softmax(logits)
    return logits


def reject_heads(method: object, heads: object) -> None:
    """Raise: a value-aware `method` sums the heads inside its matrices."""
    msg = (
        f'method="{method}" rolls out one token-mixing matrix per layer (the heads are '
        f"summed inside it): drop `heads` (got heads={heads!r})."
    )
    raise ValueError(msg)


def explain_weights(
    attentions: Any,
    mask: Any,
    method: object,
    rows: int | Sequence[int] | None,
    heads: Any,
    options: Mapping[str, Any] | None,
) -> Any:
    """Raw attention, rollout or flow over captured weights, the mask by default.

    Negative `rows` count from each sequence's last real token (the core function
    resolves them from the mask).
    """
    settings = {"mask": mask, **(options or {})}
    return method_spec(method).function()(attentions, rows=rows, heads=heads, **settings)


def explain_gradients(
    attentions: Any,
    gradients: Any,
    mask: Any,
    rows: int | Sequence[int] | None,
    options: Mapping[str, Any] | None,
) -> Any:
    """Gradient-weighted rollout over per-head weights and their gradients."""
    settings = {"mask": mask, **(options or {})}
    return attnflow.gradient_rollout(attentions, gradients, rows=rows, **settings)


def explain_contributions(
    contributions: Any,
    mask: Any,
    method: object,
    rows: int | Sequence[int] | None,
    options: Mapping[str, Any] | None,
) -> Any:
    """Rollout over the value-aware matrices, composed as each method's authors do.

    The norm-based matrix and ALTI: rows renormalised (``normalize_layers=True``). GlobEnc: the
    raw N-Enc matrices multiplied without renormalising rows, as Modarressi et al.'s code
    does (:func:`attnflow._contributions.compose_unnormalized`); ``normalize_layers=True`` in
    `options` gives the renormalised variant.
    """
    # The registry holds each rule: GlobEnc and ALTI carry the residual connection, the
    # norm-based matrix has none (mixed with the identity as attention is, the paper's 0.5);
    # GlobEnc's authors never renormalise rows.
    spec = method_spec(method)
    settings = {"residual": spec.residual, **(options or {})}
    old: object = settings.pop("renormalize", MISSING)  # its spelling until 0.1
    normalize_layers = renamed_keyword(
        "renormalize",
        "normalize_layers",
        old,
        settings.pop("normalize_layers", spec.normalize_layers),
        default=spec.normalize_layers,
    )
    given_mask = settings.pop("mask", mask)
    if normalize_layers is False:
        from attnflow._contributions import compose_unnormalized

        # It hands rollout the matrices with the padding zeroed and no mask: the rows are
        # resolved here, from the mask.
        return by_real_end(
            lambda given: compose_unnormalized(
                attnflow.rollout, contributions, heads=None, rows=given, mask=given_mask, **settings
            ),
            given_mask,
            rows,
        )
    return attnflow.rollout(
        contributions,
        heads=None,
        rows=rows,
        mask=given_mask,
        normalize_layers=normalize_layers,
        **settings,
    )


# -- input gradients --------------------------------------------------------------------------
_OUTPUT_WORDS = {
    "logits": ("softmax of the logits at the target class", "the target logit"),
    "outputs": (
        "softmax of the outputs at the target class",
        "the output at the target class as it is",
    ),
}


def check_reduce_output(
    reduce: object, output: object, *, of: Literal["logits", "outputs"] = "logits"
) -> None:
    """Check input gradients' `reduce` and `output`; `of` names what the model returns."""
    if reduce not in ("l2", "sum_abs", "x_input"):
        msg = (
            '`reduce` must be "l2" (norm of the gradient), "sum_abs" (|sum of the gradient|, '
            f'the paper\'s code) or "x_input" (|gradient . embedding|); got {reduce!r}.'
        )
        raise ValueError(msg)
    if output not in ("probability", "logit"):
        probability, logit = _OUTPUT_WORDS[of]
        msg = (
            f'`output` must be "probability" ({probability}) or "logit" ({logit}); got {output!r}.'
        )
        raise ValueError(msg)


def check_scalar_target(target: object) -> None:
    """Check an ``attention_gradients`` `target`: a callable of the model's outputs."""
    if not callable(target):
        msg = f"`target` must be a callable mapping the outputs to a scalar; got {target!r}."
        raise TypeError(msg)


def check_scalar_shape(shape: tuple[int, ...]) -> None:
    """Check that a gradient target of this `shape` has one element."""
    if math.prod(int(dim) for dim in shape) != 1:
        msg = (
            "`target` must map the model's outputs to a scalar; got shape "
            f"{tuple(shape)} (e.g. sum over the batch: samples do not interact)."
        )
        raise ValueError(msg)


def is_class_index(value: object) -> bool:
    """Whether `value` is a Python or NumPy integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_target_type(
    target: object,
    describe: Callable[[object], tuple[bool, str] | None],
    *,
    arrays: str = "a 1-d integer tensor",
) -> None:
    """Check the kind of `target` before any work (its values are checked once C is known).

    `describe` reads a framework array: None when `target` is none, else whether it is a
    valid class array and how to name it in the error; `arrays` names the valid ones.
    """
    if target is None or is_class_index(target):
        return
    described = describe(target)
    if described is not None:
        valid, found = described
        if valid:
            return
    elif isinstance(target, Sequence) and not isinstance(target, str | bytes):
        if all(is_class_index(value) for value in target):
            return
        found = f"a sequence holding {sorted({type(v).__name__ for v in target})}"
    else:
        found = repr(target)
    msg = (
        "`target` must be None (each sample's predicted class), an int (one class for every "
        f"sample), or a sequence of ints / {arrays} with one class per sample; got {found}."
    )
    raise TypeError(msg)


def check_class_values(
    values: Sequence[int], batch: int, classes: int, *, of: str = "logits"
) -> None:
    """Check resolved target classes: one per sample, each in ``[0, classes)``."""
    if len(values) != batch:
        msg = (
            f"`target` has {len(values)} classes for a batch of {batch} samples; give one "
            "class per sample, or an int for the same class in all of them."
        )
        raise ValueError(msg)
    wrong = [v for v in values if not 0 <= v < classes]
    if wrong:
        msg = (
            f"`target` classes must lie in [0, {classes}) for {of} of shape "
            f"({batch}, {classes}); got {wrong[:5]}."
        )
        raise ValueError(msg)
