"""Type stub of the compiled max-flow solver (``_maxflow_kernel.pyx``)."""

import numpy as np

def scan_layers(
    mixed: np.ndarray, reach_lo: np.ndarray, reach_hi: np.ndarray, counts: np.ndarray
) -> bool: ...
def build_arcs(
    matrices: np.ndarray,
    start: np.ndarray,
    head: np.ndarray,
    bucket_end: np.ndarray,
    residual: np.ndarray | None = None,
    dense_layers: int = 0,
    self_arcs: bool = False,
    capacity: np.ndarray | None = None,
) -> None: ...
def fill_residuals(
    matrices: np.ndarray,
    start: np.ndarray,
    head: np.ndarray,
    residual: np.ndarray,
    low: int,
    high: int,
    self_arcs: bool = False,
) -> None: ...
def build_backward_arcs(
    start: np.ndarray,
    head: np.ndarray,
    keep: np.ndarray,
    bwd_start: np.ndarray,
    bwd_arc: np.ndarray,
    bwd_tail: np.ndarray,
    self_base: int = -1,
) -> None: ...
def solve(
    mixed: np.ndarray,
    sink_columns: np.ndarray,
    rows: np.ndarray,
    sinks: np.ndarray,
    upper: np.ndarray,
    fwd_start: np.ndarray,
    arc_head: np.ndarray,
    bwd_start: np.ndarray,
    bwd_arc: np.ndarray,
    bwd_tail: np.ndarray,
    bucket_end: np.ndarray,
    sorted_heads: np.ndarray,
    dense_top: np.ndarray,
    src_order: np.ndarray,
    src_count: np.ndarray,
    reach_lo: np.ndarray,
    reach_hi: np.ndarray,
    with_backward: bool,
    tolerance: float,
    residual: np.ndarray,
    values: np.ndarray,
    status: np.ndarray,
    self_base: int = -1,
    arc_cap: np.ndarray | None = None,
) -> None: ...
def solve_push_relabel(
    mixed: np.ndarray,
    middle_t: np.ndarray,
    sink_columns: np.ndarray,
    rows: np.ndarray,
    sinks: np.ndarray,
    upper: np.ndarray,
    fwd_start: np.ndarray,
    arc_head: np.ndarray,
    bucket_end: np.ndarray,
    sorted_heads: np.ndarray,
    reach_lo: np.ndarray,
    reach_hi: np.ndarray,
    tolerance: float,
    values: np.ndarray,
    status: np.ndarray,
    self_base: int = -1,
    arc_cap: np.ndarray | None = None,
    counters: np.ndarray | None = None,
    global_every: int = 6,
) -> None: ...
