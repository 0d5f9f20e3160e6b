"""Token labels for explanations: the text a byte-level BPE token stands for.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, SmolLM2) write each byte as a printable
stand-in: a leading space as ``Ġ``, a newline as ``Ċ``, ``ï`` as ``Ã¯``. Those pieces are
what ``convert_ids_to_tokens`` returns, and not what a reader of an explanation wants to
see; the same tokenizer decodes each piece to its text. WordPiece (``##ing``) and
SentencePiece (``▁is``) pieces are read as they are and are left so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["token_labels"]


def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    r"""One label per token id: its text for a byte-level BPE tokenizer, else its piece.

    A piece's text is what the tokenizer's own byte-level decoder makes of it alone
    (``Ġis`` -> ``" is"``). A piece that holds part of a character's bytes (an emoji
    split over two tokens) decodes to U+FFFD and keeps its piece, so that no two labels
    are made equal by decoding. Control characters are written as escapes (``"\n"``),
    so that a label stays on one line of a table, a figure's axis or a page.

    Examples
    --------
    >>> class Pieces:  # a tokenizer without a byte-level decoder: pieces as they are
    ...     def convert_ids_to_tokens(self, ids):
    ...         return ["[CLS]", "walk", "##ing"][: len(ids)]
    >>> token_labels(Pieces(), [101, 3328, 2075])
    ['[CLS]', 'walk', '##ing']
    """
    pieces = [str(piece) for piece in tokenizer.convert_ids_to_tokens(list(ids))]
    decoder: Any = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        return pieces
    labels = []
    for piece in pieces:
        text = str(decoder.decode([piece]))
        if "\ufffd" in text and "\ufffd" not in piece:
            text = piece
        labels.append(_one_line(text))
    return labels


def _one_line(text: str) -> str:
    """`text` with each control character (newline, tab...) written as its escape."""
    return "".join(
        c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii")
        for c in text
    )
