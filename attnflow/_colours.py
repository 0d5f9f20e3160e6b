r"""The diverging colour scale of signed scores, shared by the figures and the HTML pages.

A signed method (``MethodSpec.signed``: ``direct_logit``, ``alti_logit``) gives tokens
that push the target's logit *down* a negative score; a scale that starts at 0 draws them
blank. They are drawn on a diverging scale centred at 0 instead, with symmetric limits
:math:`\pm \max_j |s_j|`: blue for negative, red for positive, near white at 0.

The scale is built here, in CIELAB (a perceptually uniform space): each half keeps one hue
(blue at :math:`h = 285^\circ`, red at :math:`35^\circ`) and moves along a straight line
from the light grey centre (:math:`L^* = 97`, no chroma) to its end (:math:`L^* = 40`,
:math:`C^* = 58`), so equal steps of the score are equal steps of colour (constant
:math:`\Delta E^*_{ab}`), the lightness falls steadily with :math:`|s|` (readable in grey
print) and both ends are in the sRGB gamut. Matplotlib's own diverging maps of 3.10
("berlin", "managua", "vanimo") are uniform too but dark at 0, which would paint every
token of a light page black; "RdBu"/"coolwarm" are not uniform.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "NEGATIVE_HUE",
    "POSITIVE_HUE",
    "SIGNED_STOPS",
    "is_signed",
    "signed_lab",
    "signed_palette",
    "signed_rgb",
]

#: CIELAB hue angles (degrees) of the negative and the positive half.
NEGATIVE_HUE, POSITIVE_HUE = 285.0, 35.0
_CENTRE_L, _END_L, _END_C = 97.0, 40.0, 58.0

#: CIE D65 white and the XYZ -> linear sRGB matrix (IEC 61966-2-1).
_WHITE = (0.95047, 1.0, 1.08883)
_XYZ_TO_RGB = np.array(
    [
        [3.2404542, -1.5371385, -0.4985314],
        [-0.9692660, 1.8760108, 0.0415560],
        [0.0556434, -0.2040259, 1.0572252],
    ]
)


def _lab_to_srgb(lab: np.ndarray) -> np.ndarray:
    """CIELAB ``(..., 3)`` to sRGB in [0, 1] ``(..., 3)`` (D65)."""
    lightness, a, b = lab[..., 0], lab[..., 1], lab[..., 2]
    fy = (lightness + 16.0) / 116.0
    delta = 6.0 / 29.0

    def inverse(t: np.ndarray) -> np.ndarray:
        return np.where(t > delta, t**3, 3.0 * delta * delta * (t - 4.0 / 29.0))

    xyz = np.stack(
        [
            _WHITE[0] * inverse(fy + a / 500.0),
            _WHITE[1] * inverse(fy),
            _WHITE[2] * inverse(fy - b / 200.0),
        ],
        axis=-1,
    )
    linear = np.clip(xyz @ _XYZ_TO_RGB.T, 0.0, 1.0)
    srgb: np.ndarray = np.where(
        linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1.0 / 2.4) - 0.055
    )
    return srgb


def signed_lab(positions: np.ndarray) -> np.ndarray:
    """CIELAB colours ``(k, 3)`` of scale positions in [-1, 1] (-1 the most negative)."""
    t = np.clip(np.asarray(positions, dtype=np.float64), -1.0, 1.0)
    size = np.abs(t)
    hue = np.radians(np.where(t < 0, NEGATIVE_HUE, POSITIVE_HUE))
    chroma = _END_C * size
    return np.stack(
        [_CENTRE_L - (_CENTRE_L - _END_L) * size, chroma * np.cos(hue), chroma * np.sin(hue)],
        axis=-1,
    )


def signed_palette(count: int = 256) -> np.ndarray:
    """``count`` sRGB colours in [0, 1] ``(count, 3)`` from -1 to 1 (an odd count has 0)."""
    return _lab_to_srgb(signed_lab(np.linspace(-1.0, 1.0, count)))


#: The scale as 0-255 sRGB stops from -1 to 1 (the middle one at 0), for the HTML pages:
#: a score's colour is the linear blend of the two stops around it (the page's script
#: blends the same stops, so a page looks the same before and after it runs).
SIGNED_STOPS: tuple[tuple[int, int, int], ...] = tuple(
    (int(r), int(g), int(b)) for r, g, b in np.floor(255.0 * signed_palette(33) + 0.5)
)


def signed_rgb(value: float, top: float) -> tuple[int, int, int]:
    """0-255 sRGB of `value` on the scale from ``-top`` to ``top`` (clipped; 0 if top <= 0)."""
    share = min(1.0, max(-1.0, value / top)) if top > 0 else 0.0
    place = (share + 1.0) / 2.0 * (len(SIGNED_STOPS) - 1)
    low = min(math.floor(place), len(SIGNED_STOPS) - 2)
    fraction = place - low
    first, second = SIGNED_STOPS[low], SIGNED_STOPS[low + 1]
    red, green, blue = (
        math.floor(a + (b - a) * fraction + 0.5) for a, b in zip(first, second, strict=True)
    )
    return red, green, blue


def is_signed(method: str) -> bool:
    """Whether a registered method's scores are signed (``MethodSpec.signed``; else False)."""
    from ._methods import METHODS

    spec = METHODS.get(method)
    return bool(spec is not None and spec.signed)
