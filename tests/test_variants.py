"""Head-specific (``heads="each"``) and pruned (``threshold``, ``top_k``, ``discard``) rollout
and flow (issue 9, items 2 and 3) against the independent oracles of ``oracle.py``.

Rollout runs on every backend of the matrix (under ``jax.jit`` too, Dask without computing);
flow on every backend outside ``jax.jit``. The max-flow oracle is networkx Edmonds-Karp on
the paper's full graph, as in ``test_flow.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import oracle_flow_variant, oracle_rollout_variant, softmax_attention

import attnflow
from attnflow._cli import EXIT_USAGE, main

SHAPE = (3, 3, 4, 7, 7)  # batch, layers, heads, n, n
# Full, right-padded and left-padded sequences: position 0 (the CLS column) is padding in
# the last one, so `discard` has no column to protect there.
MASK = np.array(
    [
        [True] * 7,
        [True] * 5 + [False] * 2,
        [False] * 2 + [True] * 5,
    ]
)


@functools.cache
def _weights(dtype_name: str) -> np.ndarray:
    weights = softmax_attention(np.random.default_rng(20261123), SHAPE, scale=2.0)
    return weights.astype(dtype_name)


def _shape(options: dict[str, Any], *, batch: int = SHAPE[0]) -> tuple[int, ...]:
    shape: tuple[int, ...] = (batch,)
    if options.get("layers") == "all":
        shape += (SHAPE[1],)
    if options.get("heads") == "each":
        shape += (SHAPE[2],)
    rows = options.get("rows")
    if rows is None:
        return (*shape, SHAPE[-1], SHAPE[-1])
    if isinstance(rows, int):
        return (*shape, SHAPE[-1])
    return (*shape, len(rows), SHAPE[-1])


ROLLOUT_CASES: dict[str, dict[str, Any]] = {
    "each": {"heads": "each"},
    "each,layers=all": {"heads": "each", "layers": "all"},
    "each,rows=0": {"heads": "each", "rows": 0},
    "each,rows=[4,1],layers=all": {"heads": "each", "rows": [4, 1], "layers": "all"},
    "each,layers=1,rows=[6,2]": {"heads": "each", "layers": 1, "rows": [6, 2]},
    "each,residual=0": {"heads": "each", "residual": 0.0, "layers": "all"},
    "threshold=0.1": {"threshold": 0.1},
    "threshold=0.2,rows=0,layers=all": {"threshold": 0.2, "rows": 0, "layers": "all"},
    "top_k=2": {"top_k": 2},
    "top_k=3,rows=[3,0],residual=0.3": {"top_k": 3, "rows": [3, 0], "residual": 0.3},
    "discard=0.7": {"discard": 0.7},
    "discard=0.5,layers=all,rows=2": {"discard": 0.5, "layers": "all", "rows": 2},
    "each,top_k=2,layers=all": {"heads": "each", "top_k": 2, "layers": "all"},
    "each,discard=0.6,rows=0": {"heads": "each", "discard": 0.6, "rows": 0},
    "each,threshold=0.15": {"heads": "each", "threshold": 0.15, "layers": "all", "rows": [1]},
}


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("case", list(ROLLOUT_CASES))
def test_rollout_variants_match_the_oracle(
    backend: Variant, dtype_name: str, case: str, masked: bool
) -> None:
    options = ROLLOUT_CASES[case]
    data = _weights(dtype_name)
    extra = {"mask": backend.asarray(MASK)} if masked else {}
    result = backend.run(attnflow.rollout, backend.asarray(data), **options, **extra)
    values = backend.check(result, dtype_name=dtype_name, shape=_shape(options))
    expected = oracle_rollout_variant(data, mask=MASK if masked else None, **options)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)
    if masked:  # padded positions get nothing and (full matrices) carry nothing
        assert np.all(values[1, ..., 5:] == 0)
        assert np.all(values[2, ..., :2] == 0)


FLOW_CASES: dict[str, dict[str, Any]] = {
    "each,rows=[0,3],layers=all": {"heads": "each", "rows": [0, 3], "layers": "all"},
    "each,normalize_result=False": {"heads": "each", "normalize_result": False, "rows": [6, 2]},
    "threshold=0.1": {"threshold": 0.1, "rows": 0, "layers": "all"},
    "top_k=2,normalize_result=False": {"top_k": 2, "normalize_result": False, "rows": [0, 4]},
    "discard=0.6": {"discard": 0.6},
    "each,top_k=3,rows=0": {"heads": "each", "top_k": 3, "rows": 0, "layers": "all"},
    "each,discard=0.5,layers=1": {"heads": "each", "discard": 0.5, "layers": 1, "rows": [2]},
}


@functools.cache
def _flow_oracle(case: str, dtype_name: str) -> np.ndarray:
    return oracle_flow_variant(_weights(dtype_name), mask=MASK, **FLOW_CASES[case])


@pytest.mark.parametrize("case", list(FLOW_CASES))
def test_flow_variants_match_the_independent_max_flow(
    backend: Variant, dtype_name: str, case: str
) -> None:
    options = FLOW_CASES[case]
    native = backend.asarray(_weights(dtype_name))
    mask = backend.asarray(MASK)
    if backend.refuses_jit("flow", native, mask=mask, **options):  # on the host: refused clearly
        return
    result = attnflow.flow(native, mask=mask, n_jobs=1, **options)
    values = backend.check(result, dtype_name=dtype_name, shape=_shape(options))
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, _flow_oracle(case, dtype_name), rtol=tol, atol=tol)


# -- properties ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options", [{}, {"layers": "all"}, {"rows": [0, 5], "layers": "all"}, {"rows": 3}]
)
@pytest.mark.parametrize("residual", [0.0, 0.5, 0.8])
def test_head_maps_averaged_over_heads_are_the_fused_rollout(
    backend: Variant, options: dict[str, Any], residual: float
) -> None:
    # mean_k (Ã_{i,k} R̄_{i-1}) = ((1-α) mean_k W_{i,k} + α I) R̄_{i-1} = R̄_i, exactly.
    native = backend.asarray(_weights("float64"))
    mask = backend.asarray(MASK)
    each = backend.run(
        attnflow.rollout, native, heads="each", residual=residual, mask=mask, **options
    )
    fused = backend.run(attnflow.rollout, native, residual=residual, mask=mask, **options)
    head_axis = -2 if isinstance(options.get("rows"), int) else -3
    averaged = backend.to_numpy(each).mean(axis=head_axis)
    np.testing.assert_allclose(averaged, backend.to_numpy(fused), rtol=1e-12, atol=1e-12)


def test_head_flows_averaged_are_at_most_the_fused_flow_and_equal_at_the_first_layer() -> None:
    # Max-flow is concave in the capacities (a minimum over cuts of linear functions), and
    # the fused top layer is the mean of the heads' top layers: the mean of the head flows
    # is at most the fused flow. At the first layer both are the single edge, Ã_1.
    weights = _weights("float64")
    each = attnflow.flow(weights, heads="each", layers="all", mask=MASK, normalize_result=False)
    fused = attnflow.flow(weights, layers="all", mask=MASK, normalize_result=False)
    averaged = each.mean(axis=-3)
    assert np.all(averaged <= fused + 1e-12)
    np.testing.assert_allclose(averaged[:, 0], fused[:, 0], atol=1e-15)
    assert np.max(fused[:, -1] - averaged[:, -1]) > 1e-3  # strictly below somewhere
    # ... and at the first layer each head's flow is its own mixed attention Ã_{1,k}.
    first = attnflow.rollout(weights, heads="each", layers=0, mask=MASK)
    np.testing.assert_allclose(each[:, 0], first, atol=1e-15)


@pytest.mark.parametrize(
    "plain", [{"threshold": 0}, {"threshold": 0.0}, {"top_k": 7}, {"top_k": 100}, {"discard": 0}]
)
@pytest.mark.parametrize("heads", ["mean", "each"])
def test_pruning_that_drops_nothing_is_plain(
    backend: Variant, dtype_name: str, plain: dict[str, Any], heads: str
) -> None:
    native = backend.asarray(_weights(dtype_name))
    mask = backend.asarray(MASK)
    options = {"heads": heads, "mask": mask, "layers": "all", "rows": [0, 3]}
    pruned = backend.run(attnflow.rollout, native, **options, **plain)
    unpruned = backend.run(attnflow.rollout, native, **options)
    np.testing.assert_array_equal(backend.to_numpy(pruned), backend.to_numpy(unpruned))


@pytest.mark.parametrize(
    "plain", [{"threshold": 0.0}, {"top_k": 7}, {"discard": 0.0}], ids=["t0", "k=n", "d0"]
)
def test_flow_pruning_that_drops_nothing_is_plain_flow(plain: dict[str, Any]) -> None:
    weights = _weights("float64")
    for heads in ("mean", "each"):
        options = {"heads": heads, "mask": MASK, "rows": [0, 4], "layers": "all", "n_jobs": 1}
        np.testing.assert_array_equal(
            attnflow.flow(weights, **options, **plain), attnflow.flow(weights, **options)
        )


@pytest.mark.parametrize(
    "options",
    [
        {"heads": "each", "layers": "all"},
        {"threshold": 0.3},
        {"top_k": 1},
        {"discard": 0.9, "heads": "each"},
    ],
)
def test_rows_sum_to_one_for_real_tokens_and_zero_for_padding(options: dict[str, Any]) -> None:
    weights = _weights("float64")
    rolled = attnflow.rollout(weights, mask=MASK, **options)
    flowed = attnflow.flow(weights, mask=MASK, n_jobs=1, **options)
    real = MASK.reshape(3, *([1] * (rolled.ndim - 3)), 7)
    for result in (rolled, flowed):
        sums = result.sum(axis=-1)
        expected = np.broadcast_to(np.where(real, 1.0, 0.0), sums.shape)
        np.testing.assert_allclose(sums, expected, atol=1e-12)


def test_top_k_keeps_k_entries_per_row_of_the_mixed_layer() -> None:
    weights = _weights("float64")
    for residual, k in ((0.0, 1), (0.0, 3), (0.5, 2)):
        first = attnflow.rollout(weights, top_k=k, residual=residual, layers=0)
        assert np.all(np.count_nonzero(first, axis=-1) == k)
        # With α = 0.5 the diagonal (at least 0.5) is always among the kept entries.
        if residual == 0.5:
            assert np.all(np.diagonal(first, axis1=-2, axis2=-1) > 0)


def test_discard_drops_the_lowest_fraction_and_never_the_first_column() -> None:
    weights = _weights("float64")
    fused = weights.mean(axis=2)[:, 0]  # layer 1, every token real
    first = attnflow.rollout(weights, discard=0.6, residual=0.0, layers=0)
    dropped = (first == 0).reshape(3, -1).sum(axis=-1)
    assert np.all(dropped == int(np.floor(0.6 * (7 * 7 - 7))))  # m = n² - n eligible
    assert np.all(first[..., 0] > 0)  # column 0 is never eligible
    # Exactly the smallest entries outside column 0 went, per sequence (not batch 0 only).
    for item in range(3):
        eligible = np.sort(fused[item][:, 1:].ravel())
        cutoff = eligible[int(np.floor(0.6 * 42))]
        np.testing.assert_array_equal(first[item][:, 1:] == 0, fused[item][:, 1:] < cutoff)


def test_discard_counts_only_real_tokens_and_each_sequence_on_its_own() -> None:
    # The batch equals its sequences one by one, each cropped to its real tokens: padded
    # entries are never eligible nor counted (vit-explain discards in batch element 0 only).
    weights = _weights("float64")
    batched = attnflow.rollout(weights, discard=0.8, mask=MASK, layers="all")
    for item in range(3):
        keep = MASK[item]
        cropped = weights[item][..., keep, :][..., keep]
        cropped = cropped / cropped.sum(axis=-1, keepdims=True)
        # A cropped left-padded sequence starts at its first real token, whose column
        # would be protected on its own: compare with the oracle there instead.
        if keep[0]:
            alone = attnflow.rollout(cropped, discard=0.8, layers="all")
            np.testing.assert_allclose(batched[item][..., keep, :][..., keep], alone, atol=1e-14)
    expected = oracle_rollout_variant(weights, discard=0.8, mask=MASK, layers="all")
    np.testing.assert_allclose(batched, expected, atol=1e-14)


def test_ties_at_a_cutoff_are_kept() -> None:
    uniform = np.full((2, 2, 4, 4), 0.25)  # L=2, H=2: every entry ties
    plain = attnflow.rollout(uniform, residual=0.0)
    for option in ({"top_k": 1}, {"discard": 0.9}, {"threshold": 0.25}):
        np.testing.assert_array_equal(attnflow.rollout(uniform, residual=0.0, **option), plain)
    # Above every weight: each row empties and becomes a self-attention row (identity).
    np.testing.assert_array_equal(attnflow.rollout(uniform, threshold=0.3), np.eye(4))


@pytest.mark.parametrize("options", [{"heads": "each"}, {"heads": "each", "discard": 0.5}])
def test_per_layer_sequence_equals_stacked(backend: Variant, options: dict[str, Any]) -> None:
    # What Hugging Face returns: one (*batch, heads, n, n) array per layer. (Eager in the
    # jax-jit cell too: a Python list of arrays is not a jit argument.)
    data = _weights("float64")
    sequence = [backend.asarray(data[:, layer]) for layer in range(SHAPE[1])]
    mask = backend.asarray(MASK)
    run = attnflow.rollout if backend.jit else functools.partial(backend.run, attnflow.rollout)
    stacked = run(backend.asarray(data), mask=mask, **options)
    listed = run(sequence, mask=mask, **options)
    np.testing.assert_array_equal(backend.to_numpy(listed), backend.to_numpy(stacked))


def test_flow_cost_counts_every_head() -> None:
    weights = _weights("float64")
    fused = attnflow.flow_cost(weights, rows=0, layers="all", mask=MASK)
    each = attnflow.flow_cost(weights, heads="each", rows=0, layers="all", mask=MASK)
    assert each.max_flows == SHAPE[2] * fused.max_flows
    assert each.largest_graph_edges == fused.largest_graph_edges
    assert each.edge_visits == SHAPE[2] * fused.edge_visits


def test_head_specific_flow_uses_the_compiled_solver_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With pruned capacities (exact zeros) and per-head top layers the compiled solver must
    # still equal igraph's max-flow on the whole graph.
    import attnflow._maxflow as engine

    weights = softmax_attention(np.random.default_rng(4), (4, 2, 40, 40), scale=1.5)
    options = {"heads": "each", "top_k": 12, "rows": [0, 9], "normalize_result": False, "n_jobs": 1}
    fast = attnflow.flow(weights, **options)
    monkeypatch.setattr(engine, "ENGINE", "igraph")
    np.testing.assert_allclose(fast, attnflow.flow(weights, **options), atol=1e-12, rtol=0)


def test_torch_head_specific_and_pruned_rollout_stay_differentiable() -> None:
    torch = pytest.importorskip("torch")
    data = torch.asarray(_weights("float64"), requires_grad=True)
    result = attnflow.rollout(data, heads="each", top_k=3, rows=0, mask=torch.asarray(MASK))
    result[:, 1, 3].sum().backward()
    assert data.grad is not None
    assert torch.all(torch.isfinite(data.grad))


# -- bad input: one test per message --------------------------------------------------------

METHODS = [attnflow.rollout, attnflow.flow]


@pytest.mark.parametrize("method", METHODS, ids=["rollout", "flow"])
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"threshold": "0.1"}, TypeError, r"`threshold` must be a real number.*got '0.1'"),
        ({"threshold": True}, TypeError, r"`threshold` must be a real number.*got True"),
        ({"threshold": -0.1}, ValueError, r"`threshold` must be finite and non-negative"),
        ({"threshold": float("nan")}, ValueError, r"`threshold` must be finite and non-neg"),
        ({"threshold": float("inf")}, ValueError, r"`threshold` must be finite and non-neg"),
        ({"top_k": 2.5}, TypeError, r"`top_k` must be an integer.*got 2.5 of type float"),
        ({"top_k": True}, TypeError, r"`top_k` must be an integer"),
        ({"top_k": 0}, ValueError, r"`top_k` must be at least 1.*got 0"),
        ({"discard": "high"}, TypeError, r"`discard` must be a real number in \[0, 1\)"),
        ({"discard": 1.0}, ValueError, r"`discard` must be in \[0, 1\).*got 1.0"),
        ({"discard": -0.2}, ValueError, r"`discard` must be in \[0, 1\)"),
        ({"discard": float("nan")}, ValueError, r"`discard` must be in \[0, 1\)"),
        (
            {"threshold": 0.1, "top_k": 2},
            ValueError,
            r"at most one of `threshold`, `top_k` and `discard`.*threshold=0.1, top_k=2",
        ),
        ({"heads": "every"}, ValueError, r"`heads` must be one of 'mean', 'max', 'min', 'each'"),
    ],
)
def test_bad_pruning_and_head_options(
    method: Any, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        method(_weights("float64"), **options)


@pytest.mark.parametrize(
    "call",
    [
        lambda w: attnflow.raw(w, heads="each"),
        lambda w: attnflow.fuse_heads(w, heads="each"),
    ],
    ids=["raw", "fuse_heads"],
)
def test_each_is_refused_where_heads_are_fused(call: Any) -> None:
    with pytest.raises(ValueError, match=r"`heads='each'` .* option of `rollout` and `flow`"):
        call(_weights("float64"))


# -- the command line -----------------------------------------------------------------------


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "x.npz"
    np.savez(path, attentions=_weights("float32"), mask=MASK)
    return path


@pytest.mark.parametrize("method", ["rollout", "flow"])
@pytest.mark.parametrize(
    ("argv", "options"),
    [
        (["--heads", "each"], {"heads": "each"}),
        (["--threshold", "0.1"], {"threshold": 0.1}),
        (["--top-k", "2", "--heads", "each"], {"top_k": 2, "heads": "each"}),
        (["--discard", "0.6", "--residual", "0.3"], {"discard": 0.6, "residual": 0.3}),
    ],
    ids=["each", "threshold", "top-k", "discard"],
)
def test_cli_options_mirror_the_python_api(
    tmp_path: Path, source: Path, method: str, argv: list[str], options: dict[str, Any]
) -> None:
    out = tmp_path / "out.npz"
    common = ["--rows", "0,3", "--layers", "all", "--mask", str(source), "--mask-key", "mask"]
    if method == "flow":
        common += ["--jobs", "1", "--no-progress"]
    assert main([method, str(source), "-o", str(out), *common, *argv]) == 0
    expected = getattr(attnflow, method)(
        _weights("float32"), rows=[0, 3], layers="all", mask=MASK, **options
    )
    with np.load(out, allow_pickle=False) as written:
        np.testing.assert_array_equal(written[method], expected)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top-k", "0"], "`--top-k` must be at least 1"),
        (["--discard", "1.5"], "`--discard` must be in [0, 1)"),
        (["--threshold", "-1"], "`--threshold` must be finite and non-negative"),
        (["--top-k", "2", "--discard", "0.5"], "--discard: not allowed with argument --top-k"),
        (["--top-k", "two"], "argument --top-k: invalid int value: 'two'"),
    ],
    ids=["top-k", "discard", "threshold", "two-options", "not-a-number"],
)
def test_cli_bad_pruning_options_fail_in_one_line_and_write_nothing(
    tmp_path: Path,
    source: Path,
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out.npz"
    status = main(["rollout", str(source), "-o", str(out), *argv])
    assert status == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_raw_has_no_pruning_options(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["raw", str(source), "--top-k", "2"]) == EXIT_USAGE
    assert "unrecognized arguments: --top-k" in capsys.readouterr().err


def test_cli_raw_refuses_heads_each(
    tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.npz"
    assert main(["raw", str(source), "--heads", "each", "-o", str(out)]) == EXIT_USAGE
    assert "--heads each (one map per head) is an option of 'attnflow rollout'" in (
        capsys.readouterr().err
    )
    assert not out.exists()
