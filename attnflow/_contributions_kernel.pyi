"""Type stub of the compiled token-mixing rules (attnflow/_contributions_kernel.pyx)."""

import numpy as np

def distances(
    alpha: np.ndarray,
    scale: np.ndarray,
    values: np.ndarray,
    y: np.ndarray,
    residual: np.ndarray,
    out: np.ndarray,
    totals: np.ndarray,
    scaled: bool,
    with_residual: bool,
    bounds: np.ndarray,
    parallel: int = 0,
    threads: int = 1,
    shares: bool = False,
) -> None: ...
def gram_norms(
    alpha: np.ndarray,
    scale: np.ndarray,
    values: np.ndarray,
    residual: np.ndarray,
    out: np.ndarray,
    scaled: bool,
    with_residual: bool,
    bounds: np.ndarray,
    parallel: int = 0,
    threads: int = 1,
) -> None: ...
def _allow_avx512(allowed: bool) -> bool: ...
