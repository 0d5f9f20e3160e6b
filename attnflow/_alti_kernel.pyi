"""Type stub of the compiled ALTI distances (attnflow/_alti_kernel.pyx)."""

import numpy as np

def distances(
    alpha: np.ndarray,
    scale: np.ndarray,
    values: np.ndarray,
    y: np.ndarray,
    out: np.ndarray,
    scaled: bool,
) -> None: ...
