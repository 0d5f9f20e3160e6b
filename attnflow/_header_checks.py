"""Checks of array headers against each other, before any data is read.

A file may declare arrays of any shape; inflating them (a small ``.npz`` can hold gigabytes
of zeros) before finding that they cannot be used is a decompression bomb. Each reader of
several arrays checks their headers together here (shape, dtype, agreement between arrays)
and only then reads data. Each function raises ``ValueError`` or ``TypeError`` with one
line; the caller names the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ._array_headers import ArrayHeader
from ._json_limits import MAX_JSON_CHARS

__all__ = [
    "check_encoder_decoder",
    "check_explanation",
    "check_saved_outputs",
    "require_floating",
    "require_shape",
]

MAX_TEXT_BYTES = 4 * MAX_JSON_CHARS
"""The largest JSON text (an explanation's metadata) read from an array file: 64 MiB, four
bytes a character in NumPy's unicode strings."""
MAX_IMAGE_BYTES = 2**30
"""The largest image an explanation may hold once loaded."""
MAX_VOCABULARY = 2**24
"""The most class probabilities an explanation may hold (a language model's vocabulary)."""


def require_floating(header: ArrayHeader, what: str) -> None:
    """Refuse an array that is not floating point."""
    if header.dtype.kind != "f":
        msg = f"{what} {header.name!r} must be floating point; the file stores {header.stored}"
        raise TypeError(msg)


def require_shape(header: ArrayHeader, expected: tuple[int, ...], what: str) -> None:
    """Refuse an array whose shape is not `expected`."""
    if header.shape != expected:
        msg = (
            f"{what} {header.name!r} must have shape {expected} to match the others; the "
            f"file declares {header.shape}"
        )
        raise ValueError(msg)


def _require_mask(header: ArrayHeader, expected: tuple[int, ...], what: str) -> None:
    if header.dtype != np.dtype(bool) or header.shape != expected:
        msg = (
            f"{what} {header.name!r} must be a boolean array of shape {expected}; the file "
            f"stores {header.stored} of shape {header.shape}"
        )
        raise ValueError(msg)


def check_saved_outputs(
    headers: Mapping[str, ArrayHeader], references: Sequence[str], rows: Sequence[int | str]
) -> None:
    """``attnflow evaluate FILE``: attentions (N, L, [H,] n, n), references (N, n) and more.

    Also the explained rows against the `n` tokens, so that no row folder is made for a
    row that does not exist.
    """
    attentions = headers["attentions"]
    require_floating(attentions, "array")
    shape = attentions.shape
    if len(shape) not in (4, 5) or shape[-1] != shape[-2]:
        msg = (
            "array 'attentions' must have shape (N, layers, heads, n, n) or (N, layers, n, n); "
            f"the file declares {shape}"
        )
        raise ValueError(msg)
    samples, n = shape[0], shape[-1]
    given = [name for name in references if name in headers]
    if not given:
        msg = (
            "holds no reference scores: add 'blank_out' and/or 'input_gradients' arrays "
            f"(N, n) = {(samples, n)}"
        )
        raise ValueError(msg)
    for name in given:
        require_shape(headers[name], (samples, n), "reference")
    if "mask" in headers:
        require_shape(headers["mask"], (samples, n), "array")
    if "where" in headers and headers["where"].shape not in ((samples, n), (n,)):
        msg = (
            f"array 'where' must have shape {(samples, n)} or {(n,)}; the file declares "
            f"{headers['where'].shape}"
        )
        raise ValueError(msg)
    for name in ("predictions", "labels"):
        if name in headers:
            require_shape(headers[name], (samples,), "array")
    for row in rows:
        if isinstance(row, int) and not -n <= row < n:
            msg = f"--rows {row} is out of range for the {n} tokens of 'attentions'"
            raise ValueError(msg)


def check_encoder_decoder(
    headers: Mapping[str, ArrayHeader], *, fused: bool, gradients: bool
) -> tuple[int, int]:
    """``attnflow encoder-decoder``: the three families (and gradients, masks) agree.

    ``encoder`` (*batch, L_e, [heads,] S, S), ``decoder`` (*batch, L_d, [heads,] T, T),
    ``cross`` (*batch, L_d, [heads,] T, S); each gradient shaped as its attention;
    ``source_mask`` (*batch, S) and ``target_mask`` (*batch, T) booleans.

    Returns
    -------
    tuple of int
        The decoder's layers and target length, for ``--layers`` and ``--rows``.
    """
    from ._validation import check_attention_layout

    layouts = {}
    for name in ("encoder", "decoder"):
        require_floating(headers[name], "array")
        layouts[name] = check_attention_layout(headers[name].shape, fused=fused, name=name)
    encoder, decoder = layouts["encoder"], layouts["decoder"]
    if encoder.batch_shape != decoder.batch_shape:
        msg = (
            f"'encoder' and 'decoder' must share their batch axes; the file declares "
            f"{headers['encoder'].shape} and {headers['decoder'].shape}"
        )
        raise ValueError(msg)
    batch, target, source = decoder.batch_shape, decoder.n_tokens, encoder.n_tokens
    heads = () if fused else (headers["cross"].shape[-3:-2] or (0,))
    require_floating(headers["cross"], "array")
    require_shape(headers["cross"], (*batch, decoder.n_layers, *heads, target, source), "array")
    if gradients:
        for name in ("encoder", "decoder", "cross"):
            gradient = headers[f"{name}_gradients"]
            require_floating(gradient, "array")
            require_shape(gradient, headers[name].shape, "array")
    if "source_mask" in headers:
        _require_mask(headers["source_mask"], (*batch, source), "array")
    if "target_mask" in headers:
        _require_mask(headers["target_mask"], (*batch, target), "array")
    return decoder.n_layers, target


def check_explanation(headers: Mapping[str, ArrayHeader], *, n: int | None = None) -> None:
    """:meth:`attnflow.Explanation.load`: shapes and sizes, before any data is read.

    The metadata ``meta`` is one JSON string of bounded size (read first); the scores
    ``scores/NAME`` are (layers, n) or (n,) floats, `n` the tokens the metadata lists; the
    image (H, W[, 3 or 4]) and the probabilities (classes,) are bounded in size.
    """
    meta = headers.get("meta")
    if meta is not None and (meta.dtype.kind != "U" or meta.shape != ()):
        msg = f"'meta' must be one JSON string; the file stores {meta.stored} of shape {meta.shape}"
        raise ValueError(msg)
    if meta is not None and meta.nbytes > MAX_TEXT_BYTES:
        msg = f"'meta' declares {meta.nbytes:,} bytes of text, more than {MAX_TEXT_BYTES:,}"
        raise ValueError(msg)
    for name, header in headers.items():
        if not name.startswith("scores/"):
            continue
        require_floating(header, "scores")
        if len(header.shape) not in (1, 2) or header.shape[-1] != n:
            msg = (
                f"scores {name!r} must have shape (layers, {n}) or ({n},) for the {n} tokens "
                f"its metadata lists; the file declares {header.shape}"
            )
            raise ValueError(msg)
    image = headers.get("image")
    if image is not None and (
        len(image.shape) not in (2, 3) or image.dtype.kind not in "biuf"
        or image.nbytes > MAX_IMAGE_BYTES
    ):  # fmt: skip
        msg = (
            f"'image' must be numbers of shape (H, W[, 3 or 4]) of at most {MAX_IMAGE_BYTES:,} "
            f"bytes; the file stores {image.stored} of shape {image.shape}"
        )
        raise ValueError(msg)
    probabilities = headers.get("probabilities")
    if probabilities is not None and (
        len(probabilities.shape) != 1 or probabilities.shape[0] > MAX_VOCABULARY
    ):
        msg = (
            f"'probabilities' must be one per class, (classes,) with at most {MAX_VOCABULARY:,} "
            f"classes; the file declares {probabilities.shape}"
        )
        raise ValueError(msg)
