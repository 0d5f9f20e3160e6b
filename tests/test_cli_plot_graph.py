"""``attnflow plot --kind graph`` draws head-fused attention, never heads as layers.

A stored array of 4 or more dimensions is ambiguous (per-head ``(layers, heads, n, n)``
or a batch of fused ``(batch, layers, n, n)``), so it needs ``--heads``; the shipped
MiniLM sample (per-head, ``(3, 6, 12, 10, 10)``) and ``attnflow rollout``'s own output
(fused, ``(3, 6, 10, 10)``) are drawn with 6 layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attnflow
from attnflow._cli import EXIT_USAGE, main

pytest.importorskip("matplotlib", reason="--kind graph draws with matplotlib")

import attnflow.plot

SAMPLE = Path(attnflow.__file__).parent / "data" / "minilm_sample.npz"


@pytest.fixture
def attentions() -> np.ndarray:
    with np.load(SAMPLE, allow_pickle=False) as data:
        return np.asarray(data["attentions"])  # (3, 6, 12, 10, 10): batch, layers, heads


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[tuple[np.ndarray, Any]]:
    """Record what attention_graph is given and the figure it returns."""
    calls: list[tuple[np.ndarray, Any]] = []
    original = attnflow.plot.attention_graph

    def recording(values: Any, /, **options: Any) -> Any:
        figure = original(values, **options)
        calls.append((np.asarray(values), figure))
        return figure

    monkeypatch.setattr(attnflow.plot, "attention_graph", recording)
    return calls


def layer_labels(figure: Any) -> list[str]:
    return [t.get_text() for t in figure.axes[0].get_yticklabels()]


def plot(tmp_path: Path, source: Path, *options: str, name: str = "g.png") -> int:
    return main(["plot", str(source), "--kind", "graph", "-o", str(tmp_path / name), *options])


def test_per_head_input_is_refused_without_heads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], drawn: list
) -> None:
    # --index 0,0 used to give (12, 10, 10), the 12 heads of layer 1, drawn as 12 layers.
    for index in ("0", "0,0"):
        assert plot(tmp_path, SAMPLE, "--index", index) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"holds shape (3, 6, 12, 10, 10) (after --index {index}: " in err
        assert "the shape cannot tell" in err
        assert "Pass --heads mean (or max, min)" in err
        assert "--heads none if the heads are already fused" in err
    assert drawn == []
    assert not (tmp_path / "g.png").exists()


def test_the_fix_draws_the_six_layers(
    tmp_path: Path, attentions: np.ndarray, drawn: list, capsys: pytest.CaptureFixture[str]
) -> None:
    for number, heads in enumerate(("mean", "max")):
        name = f"g{number}.png"
        assert plot(tmp_path, SAMPLE, "--index", "2", "--heads", heads, name=name) == 0
        values, figure = drawn[-1]
        assert values.shape == (6, 10, 10)
        np.testing.assert_array_equal(values, attnflow.fuse_heads(attentions[2], heads=heads))
        assert layer_labels(figure) == ["input"] + [f"layer {i}" for i in range(1, 7)]
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "plot: " in capsys.readouterr().out


def test_heads_refuses_what_has_no_heads_axis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], drawn: list
) -> None:
    # --index 0,0 picks a layer: what is left has no heads axis to fuse.
    assert plot(tmp_path, SAMPLE, "--index", "0,0", "--heads", "mean") == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--heads mean: the input must be per-head attention (layers, heads, n, n)" in err
    assert "(after --index 0,0: (12, 10, 10))" in err
    assert "--index picks batch axes only (not a layer)" in err
    # Without --index the batch is left: pick a sample.
    assert plot(tmp_path, SAMPLE, "--heads", "mean") == EXIT_USAGE
    assert "pick one sample with --index" in capsys.readouterr().err
    # Per-head input declared fused.
    assert plot(tmp_path, SAMPLE, "--index", "0", "--heads", "none") == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--heads none: the input must be fused attention (layers, n, n)" in err
    assert "(after --index 0: (6, 12, 10, 10))" in err
    # --heads belongs to --kind graph.
    argv = ["plot", str(SAMPLE), "--kind", "layers", "--heads", "mean"]
    argv += ["-o", str(tmp_path / "x.png")]
    assert main(argv) == EXIT_USAGE
    assert "--heads applies to --kind graph" in capsys.readouterr().err
    assert drawn == []


def test_the_output_of_attnflow_rollout_and_fused_files(
    tmp_path: Path, attentions: np.ndarray, drawn: list, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "r.npz"
    argv = ["rollout", str(SAMPLE), "--key", "attentions", "--rows", "all", "--layers", "all"]
    assert main([*argv, "-o", str(result)]) == 0
    with np.load(result, allow_pickle=False) as data:
        assert data.files == ["rollout"]
        rollout = data["rollout"]
    assert rollout.shape == (3, 6, 10, 10)  # fused: (batch, layers, n, n)
    capsys.readouterr()
    assert plot(tmp_path, result, "--index", "1") == EXIT_USAGE  # 4-D: say which
    assert "holds shape (3, 6, 10, 10)" in capsys.readouterr().err
    assert plot(tmp_path, result, "--index", "1", "--heads", "none") == 0
    values, figure = drawn[-1]
    np.testing.assert_array_equal(values, rollout[1])
    assert len(layer_labels(figure)) == 1 + 6
    # A 3-D file is (layers, n, n): drawn as it is.
    fused = tmp_path / "fused.npy"
    np.save(fused, attnflow.fuse_heads(attentions[0]))
    assert plot(tmp_path, fused, name="f.png") == 0
    values, figure = drawn[-1]
    assert values.shape == (6, 10, 10)
    assert len(layer_labels(figure)) == 1 + 6
