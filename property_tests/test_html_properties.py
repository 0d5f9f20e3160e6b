"""Properties of the HTML views for any scores and any tokens left out of the scale."""

from __future__ import annotations

import numpy as np
from html_pages import parse, ramp, rgb, scale_legend, unscaled
from hypothesis import given, settings
from hypothesis import strategies as st

from attnflow.html import InteractiveView, TokenView


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1.0, 10.0, allow_nan=False), min_size=1, max_size=7).flatmap(
        lambda values: st.tuples(
            st.just(values), st.lists(st.booleans(), min_size=len(values), max_size=len(values))
        )
    )
)
def test_every_view_draws_excluded_tokens_neutral_and_the_rest_on_the_ramp(
    case: tuple[list[float], list[bool]],
) -> None:
    values, excluded = np.array(case[0]), np.array(case[1])
    tokens = [f"t{i}" for i in range(len(values))]
    positions = [int(i) for i in np.flatnonzero(excluded)]
    top = max(0.0, float(values[~excluded].max(initial=0.0)))
    hue = (30, 90, 200)
    for text, half_up in (
        (TokenView(values, tokens, color="#1e5ac8", scale_exclude=positions).to_html(), False),
        (InteractiveView(values, tokens, color="#1e5ac8", scale_exclude=positions).to_html(), True),
    ):
        spans = parse(text).tokens
        assert [unscaled(span) for span in spans] == excluded.tolist()
        for span, value, out in zip(spans, values, excluded, strict=True):
            assert span["data-value"] == f"{value:.4g}"
            if not out:
                assert rgb(span["style"]) == ramp(float(value), top, hue, half_up=half_up)
        note = f"({len(positions)} token{'s' if len(positions) > 1 else ''} left out of the scale)"
        assert scale_legend(text).endswith(note if positions else f"{top:.4g}")
