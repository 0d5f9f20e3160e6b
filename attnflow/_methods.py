"""The attribution methods by name, and what each one needs.

The one table every entry point reads.

``explain`` (every adapter), ``explain_text``/``explain_image``, ``attnflow explain``, the
evaluation, the integrations and the tests' expectations (host only, refuses ``jax.jit``,
needs gradients) all look a method up here, so a new method is one row of
:data:`METHODS` plus its function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from ._flow import flow
from ._gradient_rollout import gradient_rollout
from ._rollout import raw, rollout

__all__ = [
    "ATTENTION_METHODS",
    "METHODS",
    "TARGET_CONDITIONED_METHODS",
    "VALUE_AWARE_METHODS",
    "MethodSpec",
    "check_methods",
    "method_of_function",
    "method_spec",
]

Matrix = Literal["attention", "norm", "globenc", "alti"]
Composition = Literal[
    "raw", "rollout", "flow", "gradient_rollout", "direct_logit", "alti_logit", "ifr"
]


@dataclass(frozen=True)
class MethodSpec:
    """One attribution method: what it composes, over which matrices, and what it needs.

    Parameters
    ----------
    name : str
        The name users pass (``method="rollout"``, ``--method rollout``).
    summary : str
        One line for help texts and pages.
    composes : {"raw", "rollout", "flow", "gradient_rollout", "direct_logit", "alti_logit", "ifr"}
        The core function that turns the per-layer matrices into scores; for the
        target-conditioned methods, the rule of :mod:`attnflow._logit_attribution`.
    matrix : {"attention", "norm", "globenc", "alti"}
        The per-layer matrices it reads: the attention weights, or a value-aware
        token-mixing matrix captured with ``capture(model, contributions=matrix)``.
    gradients : bool
        Whether it also needs the gradients of the attention weights (a backward pass).
    host_only : bool
        Whether it runs on the host (max-flow): it accepts ``n_jobs``/``executor`` and
        cannot be traced by ``jax.jit``.
    residual : float or None
        For value-aware matrices, the weight of the identity mixed into each layer (the
        norm-based matrix has no residual path, so it gets the paper's 0.5; GlobEnc and
        ALTI carry theirs); None for attention, where the function's own default holds.
    normalize_layers : bool
        Whether each layer's rows are renormalised to sum to one before composing.
    target_conditioned : bool
        Whether it reads a causal LM's explained rows, per head and value-aware, and sums
        the layers (direct logit, ALTI-Logit, IFR): the adapter gathers the attention rows
        at the target, the values, the projections and (for the logit methods) the
        target's readout, in one forward pass, instead of capturing whole matrices.
    signed : bool
        Whether its scores can be negative (a token pushing the target's logit down).
    uses_target : bool
        Whether it explains a `target` (a class, or a causal LM's vocabulary id): the
        gradient methods and the logit-conditioned ones.
    blockwise : bool
        Whether the PyTorch adapter can compute its rows blockwise on a causal LM
        (``explain(..., blockwise=True)``): from each layer's recomputed queries and keys,
        never holding an ``(heads, n, n)`` array.
    composes_layers : bool
        Whether it composes the layers (rollout, flow...), so that it takes a `residual`
        mix, `exclude` and `receptive_field`; False for raw attention, which reads each
        layer alone.
    """

    name: str
    summary: str
    composes: Composition
    matrix: Matrix = "attention"
    gradients: bool = False
    host_only: bool = False
    residual: float | None = None
    normalize_layers: bool = False
    target_conditioned: bool = False
    signed: bool = False
    uses_target: bool = False
    blockwise: bool = False
    composes_layers: bool = True

    @property
    def value_aware(self) -> bool:
        """Whether it reads a value-aware matrix rather than the attention weights."""
        return self.matrix != "attention"

    def function(self) -> Callable[..., Any]:
        """Return the core function it composes with (not for target-conditioned methods).

        Raises
        ------
        ValueError
            For a target-conditioned method, which no single function over attention
            weights computes: the adapters' ``explain`` runs it.
        """
        if self.target_conditioned:
            msg = (
                f'method="{self.name}" reads a causal LM\'s values, projections and target '
                "readout, not attention weights alone: run it with the PyTorch adapter's "
                f'explain(model, inputs, method="{self.name}"), the JAX adapter\'s '
                "explain_linen / explain_nnx or the Keras adapter's explain."
            )
            raise ValueError(msg)
        return _FUNCTIONS[self.composes]


METHODS: Mapping[str, MethodSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            MethodSpec(
                "raw",
                "the attention weights of one layer",
                composes="raw",
                composes_layers=False,
            ),
            MethodSpec(
                "rollout",
                "attention rollout: the product of the residual-mixed layers",
                composes="rollout",
                blockwise=True,
            ),
            MethodSpec(
                "flow",
                "attention flow: the max-flow through the layered attention graph",
                composes="flow",
                host_only=True,
            ),
            MethodSpec(
                "gradient_rollout",
                "gradient-weighted rollout (Chefer et al. 2021, GAE)",
                composes="gradient_rollout",
                gradients=True,
                uses_target=True,
                blockwise=True,
            ),
            MethodSpec(
                "norm",
                "rollout of the norm-based matrices (Kobayashi et al. 2020)",
                composes="rollout",
                matrix="norm",
                residual=0.5,
                normalize_layers=True,
            ),
            MethodSpec(
                "globenc",
                "rollout of GlobEnc's matrices as its authors aggregate them, rows not "
                "renormalised (Modarressi et al. 2022)",
                composes="rollout",
                matrix="globenc",
                residual=0.0,
                normalize_layers=False,
            ),
            MethodSpec(
                "alti",
                "rollout of ALTI's matrices (Ferrando et al. 2022)",
                composes="rollout",
                matrix="alti",
                residual=0.0,
                normalize_layers=True,
            ),
            MethodSpec(
                "direct_logit",
                "each head's direct contribution of each token to the target's logit, summed "
                "over heads and layers (ALTI-Logit's Logit variant)",
                composes="direct_logit",
                target_conditioned=True,
                signed=True,
                uses_target=True,
            ),
            MethodSpec(
                "alti_logit",
                "ALTI-Logit: each layer's direct logit terms carried to the input tokens by "
                "the ALTI rollout below (Ferrando et al. 2023)",
                composes="alti_logit",
                matrix="alti",
                target_conditioned=True,
                signed=True,
                uses_target=True,
            ),
            MethodSpec(
                "ifr",
                "information flow routes at the explained row, summed over layers "
                "(Ferrando & Voita 2024, as FlashTrace aggregates them)",
                composes="ifr",
                target_conditioned=True,
            ),
        )
    }
)
"""Every method by name, in the order help texts list them."""

ATTENTION_METHODS = tuple(
    name for name, spec in METHODS.items() if not spec.value_aware and not spec.target_conditioned
)
"""The methods over attention weights: raw, rollout, flow, gradient_rollout."""
VALUE_AWARE_METHODS = tuple(
    name for name, spec in METHODS.items() if spec.value_aware and not spec.target_conditioned
)
"""The methods over value-aware matrices: norm, globenc, alti."""
TARGET_CONDITIONED_METHODS = tuple(
    name for name, spec in METHODS.items() if spec.target_conditioned
)
"""The target-conditioned methods of causal LMs: direct_logit, alti_logit, ifr."""


_FUNCTIONS: Mapping[Composition, Callable[..., Any]] = MappingProxyType(
    {"raw": raw, "rollout": rollout, "flow": flow, "gradient_rollout": gradient_rollout}
)


def _listed(names: Iterable[str]) -> str:
    quoted = [f'"{name}"' for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def method_spec(
    name: object, *, parameter: str = "`method`", among: Iterable[str] | None = None
) -> MethodSpec:
    """Look `name` up, refusing an unknown one (or one outside `among`) with the choices.

    Examples
    --------
    >>> from attnflow._methods import method_spec
    >>> method_spec("flow").host_only
    True
    >>> method_spec("rolout")
    Traceback (most recent call last):
    ...
    ValueError: `method` must be "raw", "rollout", "flow", "gradient_rollout", "norm", \
"globenc", "alti", "direct_logit", "alti_logit" or "ifr"; got 'rolout'.
    """
    allowed = tuple(METHODS) if among is None else tuple(among)
    if not isinstance(name, str) or name not in allowed:
        msg = f"{parameter} must be {_listed(allowed)}; got {name!r}."
        raise ValueError(msg)
    return METHODS[name]


def check_methods(
    names: object, *, parameter: str = "`methods`", among: Iterable[str] | None = None
) -> list[MethodSpec]:
    """Look up a non-empty sequence of method names (not a string), refusing unknown ones."""
    allowed = tuple(METHODS) if among is None else tuple(among)
    if isinstance(names, str) or not isinstance(names, Iterable):
        msg = f"{parameter} must be a sequence of method names, some of {list(allowed)}; "
        msg += f"got {names!r}."
        raise TypeError(msg)
    chosen = list(names)
    unknown = [name for name in chosen if name not in allowed]
    if not chosen or unknown:
        msg = f"{parameter} must name some of {list(allowed)}; got {chosen!r}."
        raise ValueError(msg)
    return [METHODS[name] for name in chosen]


def method_of_function(function: object) -> MethodSpec | None:
    """Return the attention method a callable composes with (``functools.partial`` too).

    The evaluation takes methods as callables; this tells which need gradients or run on
    the host. None for a callable of the user's own.

    Examples
    --------
    >>> import functools
    >>> from attnflow._flow import flow
    >>> from attnflow._methods import method_of_function
    >>> method_of_function(functools.partial(flow, residual=0.3)).name
    'flow'
    >>> method_of_function(len) is None
    True
    """
    target = getattr(function, "func", function)
    for name in ATTENTION_METHODS:
        spec = METHODS[name]
        if spec.function() is target:
            return spec
    return None
