"""Type stub of the compiled proximities of IFR (attnflow/_ifr_kernel.pyx)."""

import numpy as np

def proximities(
    weights: np.ndarray,
    transformed: np.ndarray,
    whole: np.ndarray,
    out: np.ndarray,
    first: int,
    last: int,
) -> None: ...
