"""Reading the pages attnflow.html writes: a checking parser and the colour scale's formula.

Shared by the HTML tests (tests/test_html.py) and their property tests
(property_tests/test_html_properties.py).
"""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

VOID = {"meta", "br", "hr", "img", "input", "link"}


class Page(HTMLParser):
    """Parse a page, check tags nest, and collect the token spans and the grid cells."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.tags: list[str] = []
        self.errors: list[str] = []
        self.tokens: list[dict[str, str]] = []  # attributes plus "text"
        self.labels: list[str] = []
        self.cells: list[dict[str, str]] = []  # attributes plus "text"
        self.grids: list[dict[str, str]] = []  # the grids' attributes
        self._in_token: dict[str, str] | None = None
        self._in_label = False
        self._in_cell: dict[str, str] | None = None
        self._cell_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        attributes = {name: value or "" for name, value in attrs}
        classes = attributes.get("class", "").split()
        if "attnflow-tok" in classes:
            self._in_token = {**attributes, "text": ""}
        if self._in_cell is not None and tag not in VOID:
            self._cell_depth += 1
        if "attnflow-cell" in classes:
            self._in_cell, self._cell_depth = {**attributes, "text": ""}, 1
        if "attnflow-grid" in classes:
            self.grids.append(attributes)
        if "attnflow-label" in classes:
            self._in_label = True
            self.labels.append("")
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.open[-1] if self.open else None}>")
            return
        self.open.pop()
        if self._in_cell is not None:
            self._cell_depth -= 1
            if not self._cell_depth:
                self.cells.append(self._in_cell)
                self._in_cell = None
        if tag == "span" and self._in_token is not None:
            self.tokens.append(self._in_token)
            self._in_token = None
        self._in_label = False

    def handle_data(self, data: str) -> None:
        if self._in_token is not None:
            self._in_token["text"] += data
        if self._in_cell is not None:
            self._in_cell["text"] += data
        if self._in_label:
            self.labels[-1] += data


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    assert page.errors == []
    assert page.open == []
    return page


def rgb(style: str) -> tuple[int, int, int]:
    match = re.search(r"background-color: rgb\((\d+), (\d+), (\d+)\)", style)
    assert match, style
    red, green, blue = (int(group) for group in match.groups())
    return red, green, blue


def ramp(
    value: float, top: float, hue: tuple[int, int, int], *, half_up: bool = False
) -> tuple[int, int, int]:
    """The scale's colour of `value`: white to `hue` by value / top, clipped to [0, 1].

    TokenView rounds with Python's round(); the interactive view as its script does,
    halves up (`half_up`).
    """
    strength = min(1.0, max(0.0, value / top)) if top > 0 else 0.0
    levels = [255 + (c - 255) * strength for c in hue]
    red, green, blue = (math.floor(x + 0.5) if half_up else round(x) for x in levels)
    return red, green, blue


def unscaled(span: dict[str, str]) -> bool:
    """Whether a token span has the out-of-scale look: the class, and no colour inline."""
    marked = "attnflow-unscaled" in span["class"].split()
    if marked:
        assert "style" not in span, span  # no colour of the ramp, nor any other
    return marked


def scale_legend(text: str) -> str:
    """The text of the (first) colour scale legend of a page."""
    found = re.search(r'<div class="attnflow-scale">(.*?)</div>', text)
    assert found, text
    return re.sub(r"<[^>]*>", "", found.group(1))
