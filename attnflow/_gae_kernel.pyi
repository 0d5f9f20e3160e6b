"""Type stub of the compiled fused pass of gradient-weighted rollout (``_gae_kernel.pyx``)."""

import numpy as np

def fuse(
    a: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray,
    keys: np.ndarray,
    out: np.ndarray,
    sums: np.ndarray,
    stats: np.ndarray,
    check: bool,
) -> None: ...
def masked_mean(
    a: np.ndarray,
    rows: np.ndarray,
    keys: np.ndarray,
    weights: np.ndarray,
    out: np.ndarray,
    sums: np.ndarray,
    stats: np.ndarray,
    check: bool,
) -> None: ...
