"""Type stub of the compiled max-flow solver (``_maxflow_kernel.pyx``)."""

import numpy as np

def solve(
    mixed: np.ndarray,
    rows: np.ndarray,
    sinks: np.ndarray,
    upper: np.ndarray,
    fwd_order: np.ndarray,
    fwd_count: np.ndarray,
    bwd_order: np.ndarray,
    bwd_count: np.ndarray,
    src_order: np.ndarray,
    src_count: np.ndarray,
    tolerance: float,
    values: np.ndarray,
    status: np.ndarray,
) -> None: ...
