r"""Value-aware token-mixing matrices: norm-based, GlobEnc and ALTI.

One attention block (multi-head attention, its residual connection and, in post-LN
blocks, the LayerNorm after the sum) is split exactly into one vector per input token,

.. math::

    y_i = \sum_j T_i(x_j) + b_i ,

and each method turns these vectors into a row of a token-mixing matrix (rows = receiving
token). The matrices are what rollout and flow compose across layers instead of the
attention weights (``heads=None``; rows renormalised for the norm-based matrix and ALTI,
raw products for GlobEnc as its authors compute them, :func:`compose_unnormalized`).

Everything here is written once against the array API standard. The ``(n, n, d)`` tensor
of one layer's terms is never formed whole when it is large. The Euclidean rules (norm,
GlobEnc) never form it at all: ``‖Σ_h α^h_ij v^h_j‖² = a_ij^T G_j a_ij`` with each key's
Gram matrix ``G_j[h, h'] = v^h_j · v^h'_j`` (see docs/maths.md, "Cost: Gram matrices
instead of terms"). ALTI's Manhattan distance has no such form: on host memory a compiled
kernel (``attnflow._contributions_fused``) forms each term in registers and reduces it
at once, and computes the Euclidean rules from the Gram matrices too; elsewhere the terms
are built for a block of receiving tokens at a time and reduced before the next block.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, NoReturn, TypeAlias

from . import _contributions_fused
from ._namespace import Boundary, array_device, enter_boundary, resolve_namespace
from ._typing import ArrayT, Namespace
from ._validation import describe

__all__ = [
    "LayerNormParameters",
    "Method",
    "attention_terms",
    "compose_unnormalized",
    "contributions",
    "contributions_and_outputs",
    "head_values",
    "uses_second_norm",
]

#: The token-mixing rule: Kobayashi et al.'s norm, GlobEnc or ALTI.
Method: TypeAlias = Literal["norm", "globenc", "alti"]
#: A LayerNorm as ``(weight, bias, eps)``; weight and bias may be None (no affine part).
LayerNormParameters: TypeAlias = tuple[Any | None, Any | None, float]

_METHODS = ("norm", "globenc", "alti")


def uses_second_norm(kind: Method) -> bool:
    """Whether the matrix `kind` reads a post-LN block's second LayerNorm (GlobEnc's)."""
    return kind == "globenc"


#: Elements of one block of ALTI's terms ``(*batch, rows, n, d)`` (or of the Gram path's
#: ``(*batch, n, rows, H)`` products, all rows at once for MiniLM): 2**22 is 16 MiB in float32,
#: so MiniLM on 4 x 256 tokens (d = 384) takes 10 receiving tokens at a time. Blocks that
#: stay in cache between the matmul and the reductions after it are faster: on one CPU
#: thread 10 rows ran 1.6x faster than 42 (2**24 elements), and 1 or 2 rows slower.
_CHUNK_ELEMENTS = 1 << 22


def _fail(name: str, expected: str, given: str, fix: str, kind: type[Exception]) -> NoReturn:
    msg = f"`{name}` must {expected}; got {given}. {fix}"
    raise kind(msg)


# -- the value pathway ---------------------------------------------------------------------
def head_values(
    inputs: ArrayT,
    value_weight: Any,
    output_weight: Any,
    /,
    *,
    heads: int,
    value_heads: int | None = None,
    value_bias: Any | None = None,
    xp: Namespace | None = None,
) -> ArrayT:
    r"""Each head's transformed value vectors :math:`f^h(z_j)`.

    Kobayashi et al. (2020) write the output of multi-head attention at position
    :math:`i` as :math:`\sum_h \sum_j \alpha^h_{ij} f^h(z_j) + b_O` with

    .. math::

        f^h(z_j) = \left(z_j W_V^h + b_V^h\right) W_O^h ,

    where :math:`W_V^h` (``d_in x d_head``) and :math:`b_V^h` are head :math:`h`'s
    columns of the value projection and :math:`W_O^h` (``d_head x d``) its rows of the
    output projection. :math:`z_j` is what the attention reads: the block input
    :math:`x_j` in post-LN blocks (BERT), :math:`\mathrm{LN}_1(x_j)` in pre-LN blocks
    (GPT-2, ViT), :math:`\mathrm{RMSNorm}(x_j)` in Llama-family blocks. The value bias
    is part of :math:`f^h`, as in the paper.

    With grouped-query attention (Llama, Mistral, Qwen2: `value_heads` below `heads`)
    the query heads are split into `value_heads` consecutive groups of
    :math:`g = \text{heads} / \text{value\_heads}` that share one value head, and

    .. math::

        f^h(z_j) = \left(z_j W_V^{\lfloor h / g \rfloor} + b_V^{\lfloor h / g \rfloor}\right)
        W_O^h ,

    computed without repeating the value heads (Ainslie et al. 2023; Hugging Face's
    ``repeat_kv`` repeats them in this order).

    Parameters
    ----------
    inputs : array of shape ``(*batch, n, d_in)``
        The attention's input :math:`z`.
    value_weight : array of shape ``(d_in, heads * d_head)``
        The value projection, applied as ``z @ value_weight`` (a ``torch.nn.Linear``
        stores its transpose).
    output_weight : array of shape ``(heads * d_head, d)``
        The output projection, applied as ``context @ output_weight``.
    heads : int
        The number of (query) heads; head :math:`h` owns rows
        ``h * d_head : (h + 1) * d_head`` of `output_weight` and, without grouped-query
        attention, the same columns of `value_weight`.
    value_heads : int, optional
        The number of value (key-value) heads, a divisor of `heads`; None (the default)
        for `heads`. `value_weight` then has ``value_heads * d_head`` columns and value
        head :math:`k` serves query heads ``k * g`` to ``(k + 1) * g - 1``.
    value_bias : array of shape ``(value_heads * d_head,)``, optional
        The value projection's bias :math:`b_V`.
    xp : namespace, optional
        The array namespace; inferred from the arrays by default.

    Returns
    -------
    array of shape ``(*batch, heads, n, d)``
        :math:`f^h(z_j)`, in the library, dtype and device of `inputs`.

    Raises
    ------
    ValueError
        On shapes that do not fit together, a `heads` below 1 or not dividing the output
        projection's input width, or a `value_heads` below 1 or not dividing `heads`.
    TypeError
        On non-floating or mixed dtypes, or a `heads` or `value_heads` that is not an int.

    References
    ----------
    .. [1] G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a
       Weight: Analyzing Transformers with Vector Norms", EMNLP 2020,
       https://arxiv.org/abs/2004.10102
    .. [2] J. Ainslie, J. Lee-Thorp, M. de Jong, Y. Zemlyanskiy, F. Lebrón and S. Sanghai,
       "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
       Checkpoints", EMNLP 2023, https://arxiv.org/abs/2305.13245

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> z = np.array([[1.0, 0.0], [0.0, 2.0]])  # n = 2 tokens, d_in = 2
    >>> w_v, w_o = np.eye(2), np.array([[1.0, 1.0], [0.0, 1.0]])  # 2 heads of width 1
    >>> attnflow.head_values(z, w_v, w_o, heads=2)  # (heads, n, d)
    array([[[1., 1.],
            [0., 0.]],
    <BLANKLINE>
           [[0., 0.],
            [0., 2.]]])

    Grouped-query attention: two query heads share one value head of width 1.

    >>> attnflow.head_values(z, w_v[:, :1], w_o, heads=2, value_heads=1)
    array([[[1., 1.],
            [0., 0.]],
    <BLANKLINE>
           [[0., 1.],
            [0., 0.]]])
    """
    values, _ = _value_pathway(
        None,
        inputs,
        value_weight,
        output_weight,
        heads=heads,
        value_heads=value_heads,
        value_bias=value_bias,
        xp=xp,
    )
    return values  # type: ignore[no-any-return]


def head_values_and_attention_output(
    weights: Any,
    inputs: Any,
    value_weight: Any,
    output_weight: Any,
    /,
    *,
    heads: int,
    value_heads: int | None = None,
    value_bias: Any | None = None,
    centred_by: Sequence[Any | None] = (),
    projected: bool = False,
    xp: Namespace | None = None,
) -> tuple[Any, Any | None]:
    r"""Return :func:`head_values` and the attention's output before its bias, one projection.

    The output is

    .. math::

        \sum_h \sum_j \alpha^h_{ij} f^h(z_j)
        = \sum_h \Big(\sum_j \alpha^h_{ij} (z_j W_V^h + b_V^h)\Big) W_O^h ,

    the heads' contexts concatenated and projected once: :math:`H n^2 d_{head}` products
    for the contexts and :math:`n H d_{head} d` for the projection, where the sum over
    :func:`head_values` takes :math:`H n^2 d` (12 times more for MiniLM, as much as its
    whole layer). The values :math:`z_j W_V + b_V` are projected once for both results.
    The arguments are those of :func:`head_values` and the weights ``(*batch, heads, n,
    n)``; the results are ``(*batch, heads, n, d)`` and ``(*batch, n, d)``.

    `centred_by` lists the gains :math:`\gamma_1, \dots, \gamma_k` (``(d,)`` arrays, or
    None for a LayerNorm without an affine weight) of LayerNorms whose linear part, the
    centring :math:`C = I - \tfrac{1}{d} \mathbf{1}\mathbf{1}^\top` and the gain
    :math:`\Gamma = \operatorname{diag}(\gamma)`, is to be applied to the head values,
    in order. Both are linear maps of the :math:`d` coordinates, so they fold into the
    output projection, once per layer (:math:`H d_{head} d` products), instead of passes
    over the ``(*batch, heads, n, d)`` values:

    .. math::

        v^h_j = f^h(z_j)\, C \Gamma_1 \cdots C \Gamma_k
        = \left(z_j W_V^h + b_V^h\right) \left(W_O^h C \Gamma_1 \cdots C \Gamma_k\right),

    where :math:`W_O^h C` is :math:`W_O^h` with each row's mean subtracted. The values
    returned are then these :math:`v^h_j` (what a post-LN block's terms are made of: pass
    them to :func:`contributions_and_outputs` with ``normalised_values=True``); the
    attention's output stays :math:`\sum_h \alpha^h f^h`, from :math:`W_O` itself.

    `projected` True says that `inputs` are the values already projected,
    :math:`z_j W_V + b_V` ``(*batch, n, value_heads * d_head)``, as the model's own value
    projection computed them (the torch adapter reads them from its forward hook): they
    are not projected again, `value_weight` only gives their width and `value_bias` must
    be None. `weights` None skips the attention's output (returned as None): an adapter
    that reads it from the model's output projection needs only the values.
    """
    values, attended = _value_pathway(
        weights,
        inputs,
        value_weight,
        output_weight,
        heads=heads,
        value_heads=value_heads,
        value_bias=value_bias,
        xp=xp,
        centred_by=centred_by,
        projected=projected,
    )
    return values, attended


def _value_pathway(
    weights: Any | None,
    inputs: Any,
    value_weight: Any,
    output_weight: Any,
    /,
    *,
    heads: int,
    value_heads: int | None,
    value_bias: Any | None,
    xp: Namespace | None,
    centred_by: Sequence[Any | None] = (),
    projected: bool = False,
) -> tuple[Any, Any | None]:
    """:func:`head_values`, and with `weights` the attention's output, the values projected once.

    With `centred_by`, the head values are those of the folded output projection
    (:func:`head_values_and_attention_output`).
    """
    gains = list(centred_by)
    gain_names = [f"centred_by[{k}]" for k in range(len(gains))]
    names = ["inputs", "value_weight", "output_weight", "value_bias", *gain_names]
    arrays, boundary = enter_boundary(
        [inputs, value_weight, output_weight, value_bias, *gains], names
    )
    z, w_v, w_o, b_v = arrays[:4]
    namespace = resolve_namespace(*arrays, xp=xp, names=names)
    _check_dtypes(namespace, list(zip(names, arrays, strict=True)))
    n_heads = _positive_int("heads", heads, "Pass the number of (query) heads.")
    n_value = n_heads
    if value_heads is not None:
        n_value = _positive_int(
            "value_heads",
            value_heads,
            "Pass the number of key-value heads (num_key_value_heads), or None.",
        )
    if z.ndim < 2 or w_v.ndim != 2 or w_o.ndim != 2:
        _fail(
            "inputs, value_weight, output_weight",
            "have shapes (*batch, n, d_in), (d_in, value_heads * d_head), (heads * d_head, d)",
            f"{tuple(z.shape)}, {tuple(w_v.shape)}, {tuple(w_o.shape)}",
            "Transpose torch.nn.Linear weights (they are stored as (out, in)).",
            ValueError,
        )
    if n_heads % n_value != 0:
        _fail(
            "value_heads",
            f"divide `heads` ({n_heads}): each value head serves a group of query heads",
            repr(value_heads),
            "Pass the model's number of key-value heads.",
            ValueError,
        )
    width = w_o.shape[0]
    d_head = width // n_heads
    read = w_v.shape[1] if projected else w_v.shape[0]  # the width `inputs` must have
    if read != z.shape[-1] or width % n_heads != 0 or w_v.shape[1] != n_value * d_head:
        _fail(
            "value_weight",
            f"have shape (d_in, value_heads * d_head) = ({z.shape[-1]}, {n_value} * k) with "
            f"output_weight (heads * d_head, d) = ({n_heads} * k, d)",
            f"value_weight {tuple(w_v.shape)} and output_weight {tuple(w_o.shape)} for inputs "
            f"{tuple(z.shape)}",
            "Transpose torch.nn.Linear weights (they are stored as (out, in)).",
            ValueError,
        )
    if b_v is not None and projected:
        _fail(
            "value_bias",
            "be None with projected=True (the projected values include it)",
            describe(b_v),
            "Pass value_bias=None, or the attention's input with projected=False.",
            ValueError,
        )
    if b_v is not None and tuple(b_v.shape) != (w_v.shape[1],):
        _fail("value_bias", f"have shape ({w_v.shape[1]},)", describe(b_v), "Pass b_V.", ValueError)
    for name, gain in zip(gain_names, arrays[4:], strict=True):
        if gain is not None and tuple(gain.shape) != (w_o.shape[1],):
            _fail(
                name,
                f"be None or a LayerNorm gain of shape ({w_o.shape[1]},)",
                describe(gain),
                "Pass the post-LN LayerNorm's weight (and GlobEnc's second one), or None.",
                ValueError,
            )
    group = n_heads // n_value
    values = z if projected else namespace.matmul(z, w_v)
    if b_v is not None:
        values = values + b_v
    batch = tuple(values.shape[:-2])
    n = values.shape[-2]
    values = namespace.reshape(values, (*batch, n, n_value, d_head))
    nb = len(batch)
    values = namespace.permute_dims(values, (*range(nb), nb + 1, nb, nb + 2))  # (*b, kv, n, dh)
    # (*batch, kv, 1, n, d_head) @ (kv, g, d_head, d): one value head meets each output
    # projection of its group, the repeat broadcast rather than materialised.
    folded = _fold_centring(w_o, arrays[4:], namespace)
    per_head = namespace.reshape(folded, (n_value, group, d_head, w_o.shape[1]))
    mixed = namespace.matmul(namespace.reshape(values, (*batch, n_value, 1, n, d_head)), per_head)
    out = namespace.reshape(mixed, (*batch, n_heads, n, w_o.shape[1]))
    if weights is None:
        return boundary.restore(out), None
    # The heads' contexts from the same projected values, concatenated and projected once.
    grouped = namespace.reshape(weights, (*batch, n_value, group, n, n))
    context = namespace.matmul(grouped, values[..., None, :, :])  # (*b, kv, g, n, dh)
    context = namespace.reshape(context, (*batch, n_heads, n, d_head))
    context = namespace.permute_dims(context, (*range(nb), nb + 1, nb, nb + 2))  # (*b, n, H, dh)
    context = namespace.reshape(context, (*batch, n, n_heads * d_head))
    return boundary.restore(out), namespace.matmul(context, w_o)


def _fold_centring(output_weight: Any, gains: Sequence[Any | None], xp: Namespace) -> Any:
    r"""``W_O C Γ_1 ⋯ C Γ_k``: LayerNorms' centring and gains folded into the projection.

    :math:`W C` subtracts each row's mean (:math:`C = I - \tfrac{1}{d}\mathbf{1}\mathbf{1}^\top`
    acts on the output coordinates), :math:`W \Gamma` scales column :math:`k` by
    :math:`\gamma_k`; ``(H d_head, d)`` elements each, once per layer.
    """
    folded = output_weight
    for gain in gains:
        folded = _centre(folded, gain, xp)
    return folded


def _positive_int(name: str, given: object, fix: str) -> int:
    """Check a positive int (bools refused): TypeError for other types, ValueError below 1."""
    if isinstance(given, bool) or not isinstance(given, numbers.Integral):
        _fail(name, "be a positive int", repr(given), fix, TypeError)
    if int(given) < 1:
        _fail(name, "be a positive int", repr(given), fix, ValueError)
    return int(given)


# -- the decomposition ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Linear:
    r"""Per-token terms as a linear map: ``T_ij = c_i (Σ_h α^h_ij v^h_j + δ_ij r_j)``.

    A LayerNorm with a fixed std is linear and acts on each vector alone, so its centring
    and gain are applied once to the values and the residual (``O(H n d)``) instead of to
    each of the ``n x n`` terms, and its ``1 / s_i`` scales the attention rows. The
    values are centred when first read: the norm-based rule never reads them.
    """

    source: Any
    """The values before the LayerNorm's centring and gain, ``(*batch, H, n, d)``."""
    residual: Any
    """r_j, ``(*batch, n, d)``."""
    scale: Any | None
    """c_i (``1 / s_i`` for a LayerNorm), ``(*batch, n, 1)``, or None for 1."""
    xp: Namespace | None = None
    """With `xp`, `values` is ``gamma ⊙ (source − mean source)`` (a LayerNorm)."""
    gamma: Any | None = None

    @cached_property
    def values(self) -> Any:
        """v^h_j, ``(*batch, H, n, d)``."""
        if self.xp is None:
            return self.source
        return _centre(self.source, self.gamma, self.xp)


@dataclass(frozen=True)
class _Block:
    """Checked pieces of one attention block, with its terms as a linear map."""

    xp: Namespace
    boundary: Boundary
    weights: Any
    """α, ``(*batch, H, n, n)``."""
    values: Any
    """f^h(z_j), ``(*batch, H, n, d)``: the attention alone (the norm-based rule)."""
    terms: _Linear
    """T_i(x_j): residual and LayerNorm included."""
    offset: Any
    """b_i, ``(*batch, n, d)``."""
    attended: Any
    """``Σ_h α^h f^h``, ``(*batch, n, d)``: the attention's output before its bias."""
    gain: Any | None = None
    """The gain (weight) of the post-LN LayerNorm (None: pre-LN, or no affine part)."""

    @property
    def shape(self) -> tuple[tuple[int, ...], int, int]:
        """``(batch, n, d)``."""
        residual = self.terms.residual
        return tuple(residual.shape[:-2]), residual.shape[-2], residual.shape[-1]


def _check_dtypes(xp: Namespace, named: list[tuple[str, Any]]) -> None:
    """Every given array is floating and of one dtype."""
    present = [(name, array) for name, array in named if array is not None]
    for name, array in present:
        if getattr(array, "shape", None) is None:
            _fail(name, "be an array", describe(array), "Pass an array.", TypeError)
        if not xp.isdtype(array.dtype, "real floating"):
            _fail(name, "have a real floating dtype", str(array.dtype), "Cast it.", TypeError)
    first_name, first = present[0]
    for name, array in present[1:]:
        if array.dtype != first.dtype:
            _fail(
                name,
                f"have the dtype of `{first_name}` ({first.dtype})",
                str(array.dtype),
                "Cast all pieces of the block to one dtype.",
                TypeError,
            )


def _check_norm(
    norm: object, name: str, d: int | None
) -> tuple[Any | None, Any | None, float] | None:
    """Check a ``(weight, bias, eps)`` LayerNorm; shapes too once `d` is known."""
    if norm is None:
        return None
    if not isinstance(norm, tuple) or len(norm) != 3:
        _fail(
            name,
            "be None or a tuple (weight, bias, eps) of a LayerNorm",
            repr(type(norm).__name__),
            "Pass (ln.weight, ln.bias, ln.eps).",
            TypeError,
        )
    weight, bias, eps = norm
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not float(eps) >= 0.0:
        _fail(
            f"{name}[2] (eps)",
            "be a real number >= 0",
            repr(eps),
            "Pass the LayerNorm's eps.",
            ValueError,
        )
    for part, array in (("weight", weight), ("bias", bias)):
        if d is not None and array is not None and tuple(getattr(array, "shape", ())) != (d,):
            _fail(f"{name} {part}", f"have shape ({d},)", describe(array), "", ValueError)
    return weight, bias, float(eps)


def _prepare(
    weights: Any,
    values: Any,
    residual: Any,
    bias: Any | None,
    norm: object,
    second: tuple[Any | None, Any | None],
    xp: Namespace | None,
    attended: Any | None = None,
    normalised: bool = False,
) -> tuple[_Block, tuple[Any | None, Any | None]]:
    """Check the pieces (shapes and dtypes first), then compute the per-row quantities.

    `second` is GlobEnc's ``(second_norm_input, second_norm weight)``, checked and
    converted with the rest and handed back. `attended`, when given, is the caller's
    ``Σ_h α^h f^h`` (see :func:`contributions_and_outputs`). With `normalised`, `values`
    already carry the LayerNorm's centring and gain (its linear part is not applied again).
    """
    gamma_beta: list[Any] = [None, None]
    if isinstance(norm, tuple) and len(norm) == 3:
        gamma_beta = [norm[0], norm[1]]
    names = ["weights", "values", "residual", "bias", "norm weight", "norm bias"]
    names += ["second_norm_input", "second_norm weight", "attended"]
    given = [weights, values, residual, bias, *gamma_beta, *second, attended]
    arrays, boundary = enter_boundary(given, names)
    namespace = resolve_namespace(*arrays, xp=xp, names=names)
    _check_dtypes(namespace, list(zip(names, arrays, strict=True)))
    alpha, f, x, b = arrays[:4]
    if alpha.ndim < 3 or f.ndim < 3 or x.ndim < 2:
        _fail(
            "weights, values, residual",
            "have shapes (*batch, H, n, n), (*batch, H, n, d), (*batch, n, d)",
            f"{tuple(alpha.shape)}, {tuple(f.shape)}, {tuple(x.shape)}",
            "Pass one block's pieces.",
            ValueError,
        )
    batch, (n, d) = tuple(x.shape[:-2]), tuple(x.shape[-2:])
    heads = alpha.shape[-3]
    if tuple(alpha.shape) != (*batch, heads, n, n):
        _fail(
            "weights",
            f"have shape (*batch, heads, n, n) = {(*batch, 'H', n, n)} to match `residual` "
            f"{tuple(x.shape)}",
            f"shape {tuple(alpha.shape)}",
            "Pass per-head self-attention of the same sequence (no KV cache).",
            ValueError,
        )
    if tuple(f.shape) != (*batch, heads, n, d):
        _fail(
            "values",
            f"have shape (*batch, heads, n, d) = {(*batch, heads, n, d)}",
            f"shape {tuple(f.shape)}",
            "Compute them with attnflow.head_values.",
            ValueError,
        )
    if b is not None and tuple(b.shape) != (d,):
        _fail("bias", f"have shape ({d},)", describe(b), "Pass the output bias b_O.", ValueError)
    checked_norm = _check_norm(norm, "norm", d)
    second_input, second_gamma, given_attended = arrays[6:]
    if second_input is not None and tuple(second_input.shape) != (*batch, n, d):
        _fail(
            "second_norm_input",
            f"have shape {(*batch, n, d)}",
            describe(second_input),
            "Pass the second LayerNorm's input in this call.",
            ValueError,
        )
    if second_gamma is not None and tuple(second_gamma.shape) != (d,):
        _fail("second_norm weight", f"have shape ({d},)", describe(second_gamma), "", ValueError)
    if given_attended is not None and tuple(given_attended.shape) != (*batch, n, d):
        _fail(
            "attended",
            f"have shape (*batch, n, d) = {(*batch, n, d)}",
            describe(given_attended),
            "Pass the attention's output before its bias, sum_h weights[h] @ values[h].",
            ValueError,
        )

    # The stream before the LayerNorm (post-LN) or the block output (pre-LN):
    # u_i = Σ_h Σ_j α^h_ij f^h(z_j) + x_i + b_O, computed without any (n, n, d) tensor.
    attended = _head_sum(alpha, f, namespace) if given_attended is None else given_attended
    bias_vector = namespace.zeros((d,), dtype=x.dtype, device=array_device(x)) if b is None else b
    stream = attended + x + bias_vector
    if checked_norm is None:
        offset = namespace.broadcast_to(bias_vector, tuple(x.shape))
        block = _Block(namespace, boundary, alpha, f, _Linear(f, x, None), offset, attended)
        return block, (second_input, second_gamma)
    gamma, beta, eps = checked_norm
    # LayerNorm is linear once the std of the actual pre-LN vector is fixed:
    # LN(Σ_j t_j + b) = Σ_j gamma ⊙ (t_j − mean t_j) / s + gamma ⊙ (b − mean b) / s + beta.
    variance = namespace.var(stream, axis=-1, keepdims=True)
    inverse_std = 1.0 / namespace.sqrt(variance + eps)
    offset = _centre(bias_vector, gamma, namespace) * inverse_std
    if beta is not None:
        offset = offset + beta
    if normalised:  # the centring and gain folded into the output projection
        terms = _Linear(f, _centre(x, gamma, namespace), inverse_std)
    else:
        terms = _Linear(f, _centre(x, gamma, namespace), inverse_std, namespace, gamma)
    block = _Block(namespace, boundary, alpha, f, terms, offset, attended, gamma)
    return block, (second_input, second_gamma)


def _centre(vectors: Any, gamma: Any | None, xp: Namespace) -> Any:
    """``gamma ⊙ (v − mean v)``: LayerNorm's linear part, before dividing by the std."""
    centred = vectors - xp.mean(vectors, axis=-1, keepdims=True)
    return centred if gamma is None else centred * gamma


def _rows_per_chunk(batch: tuple[int, ...], n: int, d: int) -> int:
    per_row = max(1, math.prod(batch) * n * d)
    return max(1, min(n, _CHUNK_ELEMENTS // per_row))


def _head_sum(alpha: Any, values: Any, xp: Namespace) -> Any:
    """``Σ_h α^h v^h``, ``(*batch, n, d)``, as one matmul over the (head, key) pairs.

    ``(*batch, n, H n) @ (*batch, H n, d)``: one large product instead of H products and
    a ``(*batch, H, n, d)`` temporary summed afterwards.
    """
    nb = alpha.ndim - 3
    batch = tuple(alpha.shape[:-3])
    heads, rows, n = alpha.shape[-3], alpha.shape[-2], alpha.shape[-1]
    by_row = xp.permute_dims(alpha, (*range(nb), nb + 1, nb, nb + 2))  # (*batch, r, H, n)
    by_row = xp.reshape(by_row, (*batch, rows, heads * n))
    flat = xp.reshape(values, (*batch, heads * n, values.shape[-1]))
    return xp.matmul(by_row, flat)


def _gram(values: Any, xp: Namespace) -> Any:
    """Each key's Gram matrix of its head vectors, ``G_j[h, h'] = v^h_j · v^h'_j``.

    ``(*batch, H, n, d)`` to ``(*batch, n, H, H)``.
    """
    keyed = _by_key(values, xp)  # (*batch, n, H, d)
    return xp.matmul(keyed, xp.matrix_transpose(keyed))


def _gram_norms(alpha: Any, gram: Any, xp: Namespace) -> Any:
    r"""``‖Σ_h α^h_ij v^h_j‖₂`` for a block of rows from the Gram matrices, ``(*batch, r, n)``.

    ``‖Σ_h α^h v^h‖² = Σ_{h,h'} α^h α^{h'} (v^h · v^{h'}) = a^T G_j a`` with
    :math:`a = (α^1_{ij}, …, α^H_{ij})`: ``H²`` products per pair of tokens instead of
    ``H d`` (and no ``(r, n, d)`` block). `alpha` holds the rows ``(*batch, H, r, n)``,
    scaled by their ``c_i`` where there is one (``c_i ≥ 0`` factors out of the norm).
    Rounding can leave a tiny negative square where heads cancel: it is clipped to 0.
    """
    nb = alpha.ndim - 3
    by_key = xp.permute_dims(alpha, (*range(nb), nb + 2, nb + 1, nb))  # (*batch, n, r, H)
    squares = xp.sum(xp.matmul(by_key, gram) * by_key, axis=-1)  # (*batch, n, r)
    squares = xp.maximum(squares, xp.zeros_like(squares))
    return _to_rows(xp.sqrt(squares), xp)


def _by_key(values: Any, xp: Namespace) -> Any:
    """Values ``(*batch, H, n, d)`` laid out key-major, ``(*batch, n, H, d)``, once a layer."""
    nb = values.ndim - 3
    return xp.permute_dims(values, (*range(nb), nb + 1, nb, nb + 2))


def _mix(alpha: Any, keyed: Any, xp: Namespace) -> Any:
    """``Σ_h α^h_ij v^h_j`` for a block of rows, key-major: ``(*batch, n, r, d)``.

    `alpha` holds the rows ``(*batch, H, r, n)`` and `keyed` the values key-major
    (:func:`_by_key`). The sum over heads is a matmul batched over the keys j,
    ``(n, r, H) @ (n, H, d)``, so no ``(H, r, n, d)`` intermediate is formed; the result
    stays key-major because the reductions over d that follow are faster on it than on a
    permuted copy.
    """
    nb = alpha.ndim - 3
    by_key = xp.permute_dims(alpha, (*range(nb), nb + 2, nb + 1, nb))  # (*batch, n, r, H)
    return xp.matmul(by_key, keyed)


def _to_rows(matrix: Any, xp: Namespace) -> Any:
    """Swap the last two axes: key-major ``(..., n, r)`` to receiving rows ``(..., r, n)``."""
    nb = matrix.ndim - 2
    return xp.permute_dims(matrix, (*range(nb), nb + 1, nb))


def _rows(alpha: Any, start: int, stop: int, scale: Any | None) -> Any:
    """Rows ``start:stop`` of every head, times their ``c_i``: ``(*batch, H, r, n)``."""
    rows = alpha[..., :, start:stop, :]
    return rows if scale is None else rows * scale[..., None, start:stop, :]


def _off_diagonal(
    linear: _Linear, keyed: Any, alpha: Any, start: int, stop: int, xp: Namespace
) -> Any:
    """``T_i(x_j)`` for rows ``start:stop`` without the residual: exact off the diagonal.

    Key-major, ``(*batch, n, r, d)``.
    """
    return _mix(_rows(alpha, start, stop, linear.scale), keyed, xp)


def _key_terms(by_key: Any, keyed: Any, start: int, stop: int, xp: Namespace) -> Any:
    """``T_i(x_j)`` without the residual for keys ``start:stop`` and every i: exact off the diagonal.

    `by_key` holds ``c_i α^h_ij`` key-major, ``(*batch, n_j, n_i, H)``, `keyed` the values
    ``(*batch, n_j, H, d)``; the result is ``(*batch, k, n_i, d)``.
    """
    return xp.matmul(by_key[..., start:stop, :, :], keyed[..., start:stop, :, :])


def _diagonal(linear: _Linear, alpha: Any, xp: Namespace) -> Any:
    """``T_i(x_i)`` for every i, ``(*batch, n, d)``: the only terms with the residual."""
    n = alpha.shape[-1]
    # α^h_ii, (*batch, H, n): every (n + 1)-th weight of the flattened matrices, read
    # without a pass over all n² weights of every head.
    own = xp.reshape(alpha, (*alpha.shape[:-2], n * n))[..., :: n + 1]
    # Head by head into one (*batch, n, d) sum, in the order of a sum over the head axis:
    # no (*batch, H, n, d) product is written.
    values = linear.values
    terms = own[..., 0, :, None] * values[..., 0, :, :]
    for head in range(1, values.shape[-3]):
        terms = terms + own[..., head, :, None] * values[..., head, :, :]
    terms = terms + linear.residual
    return terms if linear.scale is None else terms * linear.scale


def _summed(block: _Block, xp: Namespace) -> Any:
    """``Σ_j T_i(x_j)``, ``(*batch, n, d)``, without forming the terms.

    From the attention's head sum ``u = Σ_h α^h f^h``: a post-LN block's centring and gain
    are linear, so ``Σ_h α^h g ⊙ (f^h − mean f^h) = g ⊙ (u − mean u)`` (``g`` the gain),
    and no second product with the weights is needed.
    """
    linear = block.terms
    if linear.scale is None:  # pre-LN: the terms are the values and the residual as given
        return block.attended + linear.residual
    return (_centre(block.attended, block.gain, xp) + linear.residual) * linear.scale


def _is_diagonal(start: int, stop: int, n: int, xp: Namespace, device: Any) -> Any:
    """Bool ``(r, n)``, True at ``(i - start, i)``.

    Built by comparing indices, not with ``eye``: Dask's ``eye`` with an offset ``k``
    makes a graph with a missing key.
    """
    receiving = xp.arange(start, stop, device=device)[:, None]
    return receiving == xp.arange(n, device=device)[None, :]


def _with_diagonal(matrix: Any, own: Any, start: int, stop: int, xp: Namespace, device: Any) -> Any:
    """Put ``own[..., i]`` (rows start:stop) on the diagonal of a ``(*batch, r, n)`` block."""
    n = matrix.shape[-1]
    return xp.where(_is_diagonal(start, stop, n, xp, device), own[..., start:stop, None], matrix)


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


def _manhattan(vectors: Any, xp: Namespace) -> Any:
    """Manhattan norms over the last axis.

    ``sum(abs(v))``, not the linalg extension's ``vector_norm(ord=1)``: in torch 2.13 on CPU
    that ran slower and, in float32, put ALTI 7x further from the float64 result (3e-4
    against 4e-5 on a MiniLM-sized block), ALTI's difference of two large norms being
    sensitive to how the sums are rounded.
    """
    return xp.sum(xp.abs(vectors), axis=-1)


def _l2(vectors: Any, xp: Namespace) -> Any:
    """Euclidean norms over the last axis (the linalg extension's fused one if present)."""
    norm = getattr(getattr(xp, "linalg", None), "vector_norm", None)
    if norm is not None:
        return norm(vectors, axis=-1)
    return xp.sqrt(xp.sum(vectors * vectors, axis=-1))


def attention_terms(
    weights: ArrayT,
    values: Any,
    residual: Any,
    /,
    *,
    bias: Any | None = None,
    norm: LayerNormParameters | None = None,
    xp: Namespace | None = None,
) -> tuple[ArrayT, ArrayT]:
    r"""Decompose an attention block's output exactly into per-token terms.

    For multi-head attention with weights :math:`\alpha^h_{ij}`, transformed values
    :math:`f^h(z_j)` (:func:`head_values`), output bias :math:`b_O` and the residual
    stream :math:`x`, the block output is

    .. math::

        y_i = \sum_j T_i(x_j) + b_i, \qquad
        t_{ij} = \sum_h \alpha^h_{ij} f^h(z_j) + \delta_{ij} x_j .

    Pre-LN blocks (GPT-2, ViT: :math:`y = x + \mathrm{Attn}(\mathrm{LN}_1(x))`, `norm`
    None): :math:`T_i(x_j) = t_{ij}` and :math:`b_i = b_O`; :math:`\mathrm{LN}_1` acts on
    each token alone and is inside :math:`f^h`. Post-LN blocks (BERT:
    :math:`y = \mathrm{LN}(x + \mathrm{Attn}(x))`, `norm` given): LayerNorm is linear once
    the standard deviation :math:`s_i = \sqrt{\operatorname{Var}(u_i) + \varepsilon}` of
    the actual pre-LN vector :math:`u_i = \sum_j t_{ij} + b_O` is fixed, so

    .. math::

        T_i(x_j) = \gamma \odot \frac{t_{ij} - \overline{t_{ij}}}{s_i}, \qquad
        b_i = \gamma \odot \frac{b_O - \overline{b_O}}{s_i} + \beta ,

    with :math:`\overline{v}` the mean of the coordinates of :math:`v` (Kobayashi et al.
    2021; Ferrando et al. 2022, eq. 6-8).

    This returns the whole ``(n, n, d)`` tensor of terms; :func:`contributions` reduces
    it to token-mixing matrices a block of rows at a time instead.

    Parameters
    ----------
    weights : array of shape ``(*batch, heads, n, n)``
        The attention probabilities :math:`\alpha^h` (rows = receiving token).
    values : array of shape ``(*batch, heads, n, d)``
        :math:`f^h(z_j)`, from :func:`head_values`.
    residual : array of shape ``(*batch, n, d)``
        :math:`x`, the block input that the residual connection adds.
    bias : array of shape ``(d,)``, optional
        The output projection's bias :math:`b_O`.
    norm : tuple (weight, bias, eps), optional
        The LayerNorm applied to :math:`x + \mathrm{Attn}` in a post-LN block; weight and
        bias (shape ``(d,)``) may be None. None for pre-LN blocks.
    xp : namespace, optional
        The array namespace; inferred from the arrays by default.

    Returns
    -------
    terms : array of shape ``(*batch, n, n, d)``
        :math:`T_i(x_j)` at ``[..., i, j, :]``.
    offset : array of shape ``(*batch, n, d)``
        :math:`b_i`.

    Raises
    ------
    ValueError
        On shapes that do not fit together or a bad `norm`.
    TypeError
        On non-floating or mixed dtypes.

    See Also
    --------
    contributions : The token-mixing matrices built from these terms.

    References
    ----------
    .. [1] G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Incorporating Residual
       and Normalization Layers into Analysis of Masked Language Models", EMNLP 2021,
       https://arxiv.org/abs/2109.07152
    .. [2] J. Ferrando, G. I. Gállego and M. R. Costa-jussà, "Measuring the Mixing of
       Contextual Information in the Transformer", EMNLP 2022,
       https://arxiv.org/abs/2203.04212

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> rng = np.random.default_rng(0)
    >>> alpha = rng.dirichlet(np.ones(3), size=(2, 3))  # (heads, n, n)
    >>> f, x = rng.normal(size=(2, 3, 4)), rng.normal(size=(3, 4))
    >>> terms, offset = attnflow.attention_terms(alpha, f, x, bias=np.ones(4))
    >>> y = x + (alpha @ f).sum(0) + 1.0  # the pre-LN block output
    >>> bool(np.allclose(terms.sum(-2) + offset, y))
    True
    """
    block, _ = _prepare(weights, values, residual, bias, norm, (None, None), xp)
    namespace, linear = block.xp, block.terms
    n = block.shape[1]
    device = array_device(block.weights)
    keyed = _by_key(linear.values, namespace)
    terms = _off_diagonal(linear, keyed, block.weights, 0, n, namespace)
    nb = terms.ndim - 3
    terms = namespace.permute_dims(terms, (*range(nb), nb + 1, nb, nb + 2))  # rows first
    own = _diagonal(linear, block.weights, namespace)[..., :, None, :]  # (*batch, n, 1, d)
    diagonal = _is_diagonal(0, n, n, namespace, device)[:, :, None]
    terms = namespace.where(diagonal, own, terms)
    return block.boundary.restore(terms), block.boundary.restore(block.offset)


def contributions_and_outputs(
    weights: Any,
    values: Any,
    residual: Any,
    *,
    method: Method,
    bias: Any | None = None,
    norm: LayerNormParameters | None = None,
    second_norm: LayerNormParameters | None = None,
    second_norm_input: Any | None = None,
    attended: Any | None = None,
    normalised_values: bool = False,
    threads: int | None = None,
    team: _contributions_fused.OpenMPTeam | None = None,
    xp: Namespace | None = None,
) -> tuple[Any, Any]:
    r""":func:`contributions` and the block output rebuilt as ``Σ_j T_i(x_j) + b_i``.

    The output is summed from the same blocks of terms that the matrices are read from,
    so comparing it with the model's own output checks the decomposition the matrices
    rest on (the adapters' ``cap.outputs``).

    `attended` ``(*batch, n, d)``, optional, is the attention's output before its bias,
    :math:`\sum_h \alpha^h f^h`. From `values` it costs :math:`H n^2 d` products, as many
    as a whole MiniLM layer's forward pass; an adapter that holds the head-space values
    :math:`z W_V^h + b_V^h` computes it in :math:`H n^2 d_{head} + n H d_{head} d`
    (:func:`head_values_and_attention_output`) and passes it here.

    `normalised_values` True says that `values` are not :math:`f^h(z_j)` but the
    :math:`v^h_j` of a post-LN block's terms, with `norm`'s centring and gain (and, for
    GlobEnc, `second_norm`'s after them) already applied, as
    :func:`head_values_and_attention_output` returns them with ``centred_by`` (folded into
    the output projection once per layer instead of two passes over the values). It needs
    `attended`, `norm`, and the method ``"globenc"`` or ``"alti"`` (the norm-based rule
    reads the values before any LayerNorm).

    `threads` is the number of threads the compiled kernel splits the receiving rows
    between on host memory (None: the CPUs this process may use); the matrices do not
    depend on it. The torch adapter passes ``torch.get_num_threads()``. With `team`
    (:func:`attnflow._contributions_fused.openmp_team`) those threads are the calling
    thread's OpenMP team rather than attnflow's own pool: the torch adapter passes it
    where PyTorch's intra-op threads are that runtime's, so the kernel runs on the threads
    that wait between PyTorch's operations (the same bits).
    """
    if normalised_values and (method not in ("globenc", "alti") or norm is None):
        _fail(
            "normalised_values",
            'be False unless `method` is "globenc" or "alti" and `norm` is given',
            f"True with method={method!r}, norm={'None' if norm is None else 'given'}",
            "Pass f^h(z_j) (attnflow.head_values) and normalised_values=False.",
            ValueError,
        )
    if normalised_values and attended is None:
        _fail(
            "attended",
            "be given with normalised_values=True",
            "None",
            "Pass the attention's output from head_values_and_attention_output.",
            ValueError,
        )
    if threads is not None:
        _positive_int("threads", threads, "Pass a number of threads, or None for every CPU.")
    if method not in _METHODS:
        _fail(
            "method",
            'be "norm", "globenc" or "alti"',
            repr(method),
            "Pick one of the three token-mixing rules.",
            ValueError,
        )
    if second_norm is not None and norm is None:
        _fail(
            "second_norm",
            "be None for a pre-LN block (no `norm`)",
            "a LayerNorm",
            "GlobEnc's second LayerNorm applies to post-LN blocks, whose residual stream it "
            "normalises; pre-LN blocks normalise only the FFN's input.",
            ValueError,
        )
    if (second_norm is None) != (second_norm_input is None):
        _fail(
            "second_norm_input",
            "be given exactly when `second_norm` is",
            "one without the other",
            "Pass both the second LayerNorm and its actual input, or neither.",
            ValueError,
        )
    second = _check_norm(second_norm, "second_norm", None)
    second_weight = None if second is None else second[0]
    block, (second_input, gamma2) = _prepare(
        weights,
        values,
        residual,
        bias,
        norm,
        (second_norm_input, second_weight),
        xp,
        attended,
        normalised_values,
    )
    namespace = block.xp
    batch, n, d = block.shape
    alpha, linear = block.weights, block.terms
    device = array_device(alpha)
    if method == "globenc" and second is not None and second_input is not None:
        # GlobEnc's second LayerNorm, linear given the std s2_i of its actual input: its
        # centring and gain go to the values and residual, 1 / s2_i to the row scale.
        variance = namespace.var(second_input, axis=-1, keepdims=True)
        inverse_std = 1.0 / namespace.sqrt(variance + second[2])
        scale = inverse_std if linear.scale is None else linear.scale * inverse_std
        linear = _Linear(
            linear.values if normalised_values else _centre(linear.values, gamma2, namespace),
            _centre(linear.residual, gamma2, namespace),
            scale,
        )
    outputs = _summed(block, namespace) + block.offset
    rows: list[Any] = []
    if method != "alti":
        # ‖Σ_h α^h_ij v^h_j‖ from each key's Gram matrix of its head vectors: no (n, n, d)
        # terms at all. GlobEnc's residual sits only on the diagonal, set apart.
        values = block.values if method == "norm" else linear.values
        scale = None if method == "norm" else linear.scale
        residual = None if method == "norm" else linear.residual
        # On host memory the compiled kernel (GlobEnc's diagonal with the residual
        # included); elsewhere the array-API blocks below.
        norms = _contributions_fused.gram_norms(
            alpha, values, scale, namespace, threads, residual, team
        )
        if norms is not None:
            rows.append(norms)
        else:
            own_norms = (
                None if method == "norm" else _l2(_diagonal(linear, alpha, namespace), namespace)
            )
            gram = _gram(values, namespace)
            heads = alpha.shape[-3]
            for start, stop in _chunks(n, _rows_per_chunk(batch, n, heads)):
                norms = _gram_norms(_rows(alpha, start, stop, scale), gram, namespace)
                if own_norms is not None:
                    norms = _with_diagonal(norms, own_norms, start, stop, namespace, device)
                rows.append(norms)
    else:
        # On host memory the compiled kernel forms each term in registers and reduces it
        # at once (no (n, n, d) block is stored), the diagonal with the residual; elsewhere,
        # the array-API blocks below.
        # The shares max(‖y_i‖₁ − D_ij, 0) too, ‖y_i‖₁ summed in the distances' order.
        fused = _contributions_fused.distances(
            alpha,
            linear.values,
            linear.scale,
            outputs,
            namespace,
            threads,
            linear.residual,
            team,
            shares=True,
        )
        if fused is not None:
            rows = [fused[0]]
    if method == "alti" and not rows:
        own_rest = _manhattan(outputs - _diagonal(linear, alpha, namespace), namespace)
        total = _manhattan(outputs, namespace)[..., None, :]  # ‖y_i‖₁, (*batch, 1, n)
        # ALTI's Manhattan distance needs the terms themselves: built a block of keys at a
        # time, all receiving tokens at once, key-major (a few large products per block,
        # not one tiny product per key and receiving block), then transposed once.
        scaled = alpha if linear.scale is None else alpha * linear.scale[..., None, :, :]
        nb = alpha.ndim - 3
        by_key = namespace.permute_dims(scaled, (*range(nb), nb + 2, nb + 1, nb))  # (*b, n, n, H)
        keyed = _by_key(linear.values, namespace)  # (*batch, n, H, d)
        y = outputs[..., None, :, :]
        for start, stop in _chunks(n, _rows_per_chunk(batch, n, d)):
            terms = _key_terms(by_key, keyed, start, stop, namespace)  # (*batch, k, n, d)
            rest = _with_diagonal(
                _manhattan(y - terms, namespace), own_rest, start, stop, namespace, device
            )  # ‖y_i − T_i(x_j)‖₁ at [j, i], the diagonal's own term set apart
            rows.append(namespace.maximum(total - rest, namespace.zeros_like(rest)))
        rows = [_to_rows(namespace.concat(rows, axis=-2), namespace)]
    matrices = rows[0] if len(rows) == 1 else namespace.concat(rows, axis=-2)
    if method == "alti":
        sums = namespace.sum(matrices, axis=-1, keepdims=True)
        safe = namespace.where(sums > 0, sums, namespace.ones_like(sums))
        matrices = matrices / safe
    return block.boundary.restore(matrices), block.boundary.restore(outputs)


def contributions(
    weights: ArrayT,
    values: Any,
    residual: Any,
    /,
    *,
    method: Method = "alti",
    bias: Any | None = None,
    norm: LayerNormParameters | None = None,
    second_norm: LayerNormParameters | None = None,
    second_norm_input: Any | None = None,
    xp: Namespace | None = None,
) -> ArrayT:
    r"""Value-aware token-mixing matrix of one attention block (rows = receiving token).

    From the exact decomposition :math:`y_i = \sum_j T_i(x_j) + b_i` of the block output
    (see :func:`attention_terms`; :math:`t_{ij}` is the token's term before the LayerNorm),
    entry :math:`c_{ij}`, the share of input token :math:`j` in output :math:`i`, is:

    ``"norm"`` (Kobayashi et al. 2020), the attention alone, no residual, no LayerNorm:

    .. math::

        c_{ij} = \Big\lVert \sum_h \alpha^h_{ij} f^h(z_j) \Big\rVert_2 ;

    ``"globenc"`` (Modarressi et al. 2022), the norm of each token's term after the
    residual connection and the LayerNorm(s), the feed-forward network skipped:

    .. math::

        c_{ij} = \lVert T_i(x_j) \rVert_2 \quad\text{or, with `second_norm`,}\quad
        c_{ij} = \Big\lVert \gamma_2 \odot
        \frac{T_i(x_j) - \overline{T_i(x_j)}}{s^{(2)}_i} \Big\rVert_2 ,

    where :math:`s^{(2)}_i = \sqrt{\operatorname{Var}(v_i) + \varepsilon_2}` is the std of
    the second LayerNorm's actual input :math:`v_i` (attention block output plus FFN
    output). GlobEnc's :math:`N_{\mathrm{Enc}}` is defined for post-LN encoders (BERT),
    where the second LayerNorm normalises the residual stream: pass it as `second_norm`
    with its input. In a pre-LN block (GPT-2, ViT) the stream is never normalised (the
    second LayerNorm feeds only the FFN), so GlobEnc is :math:`\lVert T_i(x_j) \rVert_2`
    with :math:`T_i(x_j) = t_{ij}` (residual included);

    ``"alti"`` (Ferrando et al. 2022), the Manhattan-distance contribution, rows
    normalised to sum to one:

    .. math::

        \tilde c_{ij} = \max\left(0, \lVert y_i \rVert_1 - \lVert y_i - T_i(x_j) \rVert_1
        \right), \qquad c_{ij} = \tilde c_{ij} \Big/ \sum_k \tilde c_{ik} .

    As in the authors' code, :math:`y_i` is the whole block output, bias terms
    :math:`b_i` included (``resultant`` in ``mt-upc/transformer-contributions``), so the
    bias counts as a source that no token gets credit for. A row with no positive entry
    stays zero.

    ``"norm"`` and ``"globenc"`` are returned as norms (rows do not sum to one). Roll
    them out as their authors do: ALTI with ``attnflow.rollout(c, heads=None,
    residual=0.0, normalize_layers=True)`` (its matrices carry the residual), the norm-based
    matrix with rows renormalised and the paper's ``0.5`` identity mix (it has no
    residual), and GlobEnc *without* renormalising its rows,
    ``attnflow.rollout(c, heads=None, residual=0.0, validate=False)`` (the authors'
    ``AttentionRollout`` multiplies the raw :math:`N_{\mathrm{Enc}}` matrices; with
    padding use :func:`compose_unnormalized`, since a mask renormalises rows).
    ``normalize_layers=True`` gives the renormalised GlobEnc variant.

    ``"norm"`` and ``"globenc"`` never build the ``(n, n, d)`` tensor of terms: the
    squared norm of :math:`\sum_h \alpha^h_{ij} v^h_j` is :math:`a^\top G_j a` with
    :math:`a_h = \alpha^h_{ij}` and each key's Gram matrix
    :math:`G_j[h, h'] = v^h_j \cdot v^{h'}_j` (:math:`H^2` products per pair of tokens
    instead of :math:`H d`). ``"alti"``'s Manhattan distance has no such form: on host
    memory (NumPy, PyTorch CPU tensors) a compiled kernel forms each term in registers and
    reduces it at once; elsewhere the terms are built for a block of receiving tokens at a
    time (at most 2**22 elements). Memory stays near one layer's attention weights.

    Parameters
    ----------
    weights : array of shape ``(*batch, heads, n, n)``
        The attention probabilities :math:`\alpha^h`.
    values : array of shape ``(*batch, heads, n, d)``
        :math:`f^h(z_j)` from :func:`head_values` (:math:`z = x` in post-LN blocks,
        :math:`\mathrm{LN}_1(x)` in pre-LN ones).
    residual : array of shape ``(*batch, n, d)``
        :math:`x`, the block input added by the residual connection.
    method : {"norm", "globenc", "alti"}, default "alti"
        The rule (see above).
    bias : array of shape ``(d,)``, optional
        The output projection's bias :math:`b_O`.
    norm : tuple (weight, bias, eps), optional
        The LayerNorm after the residual sum (post-LN blocks); None for pre-LN blocks.
    second_norm : tuple (weight, bias, eps), optional
        ``"globenc"`` on post-LN blocks: the layer's second LayerNorm (after the FFN). Its
        bias does not change any term.
    second_norm_input : array of shape ``(*batch, n, d)``, optional
        The actual input of `second_norm` in the model call (its std is used).
    xp : namespace, optional
        The array namespace; inferred from the arrays by default.

    Returns
    -------
    array of shape ``(*batch, n, n)``
        :math:`c_{ij}`, non-negative, in the library, dtype and device of `weights`.
        Padded keys (weight 0 in every head) get exactly 0 in every row but their own.

    Raises
    ------
    ValueError
        On an unknown `method`, shapes that do not fit together, or `second_norm`
        without its input (or on a pre-LN block).
    TypeError
        On non-floating or mixed dtypes.

    See Also
    --------
    attention_terms : The decomposition.
    head_values : :math:`f^h(z_j)` from the projection weights.
    rollout, flow : Compose the matrices across layers.

    References
    ----------
    .. [1] G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a
       Weight: Analyzing Transformers with Vector Norms", EMNLP 2020,
       https://arxiv.org/abs/2004.10102
    .. [2] A. Modarressi, M. Fayyaz, Y. Yaghoobzadeh and M. T. Pilehvar, "GlobEnc:
       Quantifying Global Token Attribution by Incorporating the Whole Encoder Layer in
       Transformers", NAACL 2022, https://arxiv.org/abs/2205.03286
    .. [3] J. Ferrando, G. I. Gállego and M. R. Costa-jussà, "Measuring the Mixing of
       Contextual Information in the Transformer", EMNLP 2022,
       https://arxiv.org/abs/2203.04212

    Examples
    --------
    A pre-LN block with two heads over three tokens:

    >>> import numpy as np
    >>> import attnflow
    >>> rng = np.random.default_rng(0)
    >>> alpha = rng.dirichlet(np.ones(3), size=(2, 3))  # (heads, n, n)
    >>> f, x = rng.normal(size=(2, 3, 4)), rng.normal(size=(3, 4))
    >>> c = attnflow.contributions(alpha, f, x, method="alti")
    >>> c.shape, bool(np.allclose(c.sum(-1), 1.0))
    ((3, 3), True)
    >>> norms = attnflow.contributions(alpha, f, x, method="norm")
    >>> bool(np.allclose(norms[0, 1], np.linalg.norm(alpha[:, 0, 1] @ f[:, 1])))
    True

    Stack the layers' matrices and roll them out; ALTI carries the residual itself:

    >>> layers = np.stack([c, c])  # (L, n, n)
    >>> attnflow.rollout(layers, heads=None, residual=0.0, normalize_layers=True).shape
    (3, 3)
    """
    matrices, _ = contributions_and_outputs(
        weights,
        values,
        residual,
        method=method,
        bias=bias,
        norm=norm,
        second_norm=second_norm,
        second_norm_input=second_norm_input,
        xp=xp,
    )
    return matrices  # type: ignore[no-any-return]


def compose_unnormalized(
    function: Callable[..., Any], matrices: Any, /, *, mask: Any | None = None, **options: Any
) -> Any:
    r"""Roll out (or flow through) raw token-mixing matrices, rows never renormalised.

    GlobEnc as its authors aggregate it (Modarressi et al. 2022; ``mohsenfayyaz/GlobEnc``,
    ``src/attention_rollout.py``): the :math:`N_{\mathrm{Enc}}` matrices of the layers
    are multiplied as they are, :math:`R_L = C_L \cdots C_1`, with no residual mixed in
    and no row divided by its sum, so a layer whose norms are larger weighs more. This
    is ``function(matrices, residual=0, validate=False, **options)`` with the padding
    handled here rather than by `function`: :func:`attnflow.rollout` and
    :func:`attnflow.flow` renormalise each row over the real keys when given a mask, so
    the padded rows and columns are zeroed here and no mask is passed on. Padded tokens
    then get exactly zero and carry nothing.

    Parameters
    ----------
    function : callable
        :func:`attnflow.rollout` or :func:`attnflow.flow` (or a function with their
        signature).
    matrices : array of shape ``(*batch, layers, [1,] n, n)``
        The raw matrices, e.g. ``capture(model, contributions="globenc").contributions``.
    mask : bool array of shape ``(*batch, n)``, optional
        True for real tokens.
    **options
        Passed on to `function` (``rows``, ``layers``, ``heads``...); ``residual``
        defaults to 0 and ``validate`` to False.

    Returns
    -------
    array
        What `function` returns, in the library of `matrices`.

    Raises
    ------
    ValueError
        On a mask that does not fit the matrices, or (with padding present) on
        ``receptive_field``, ``discard`` or ``mask`` among the options: those read the
        mask inside `function`, which would renormalise the rows.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> from attnflow._contributions import compose_unnormalized
    >>> c = np.array([[[2.0, 1.0], [0.0, 3.0]], [[1.0, 1.0], [1.0, 0.0]]])  # (L, n, n)
    >>> compose_unnormalized(attnflow.rollout, c, heads=None)
    array([[2., 4.],
           [2., 1.]])
    """
    if "mask" in options:
        msg = "`mask` is given twice; pass it once, as `mask`."
        raise ValueError(msg)
    options.setdefault("residual", 0.0)
    options.setdefault("validate", False)
    if mask is None:
        return function(matrices, mask=None, **options)
    (converted, converted_mask), boundary = enter_boundary(
        [matrices, mask], ["contributions", "mask"]
    )
    xp = resolve_namespace(converted, converted_mask, xp=None, names=["contributions", "mask"])
    shape = tuple(converted.shape)
    mask_shape = tuple(converted_mask.shape)
    batch = len(mask_shape) - 1
    if (
        not xp.isdtype(converted_mask.dtype, "bool")
        or batch < 0
        or len(shape) < batch + 3
        or mask_shape != (*shape[:batch], shape[-1])
    ):
        msg = (
            f"`mask` must be a boolean array of shape (*batch, n) = "
            f"({', '.join(map(str, shape[: max(batch, 0)]))}, {shape[-1]}) for matrices of "
            f"shape {shape}; got {describe(mask)}."
        )
        raise ValueError(msg)
    # Read the mask's values only when an option needs them (the zeroing below traces).
    reads_mask = [name for name in ("receptive_field", "discard") if options.get(name)]
    if reads_mask and not bool(xp.all(converted_mask)):
        msg = (
            f"{', '.join(reads_mask)} reads the padding mask, which renormalises every row; "
            "with unnormalised matrices and padding, explain one sequence at a time (no "
            "padding), or pass normalize_layers=True for the renormalised variant."
        )
        raise ValueError(msg)
    extra = len(shape) - batch - 2  # the layers (and heads) axes
    keys = xp.reshape(converted_mask, (*shape[:batch], *([1] * extra), 1, shape[-1]))
    queries = xp.reshape(converted_mask, (*shape[:batch], *([1] * extra), shape[-1], 1))
    zeroed = xp.where(keys & queries, converted, xp.zeros_like(converted))
    return boundary.restore(function(zeroed, mask=None, **options))
