"""`attnflow rollout | flow | raw`: files in, the library's result out, clean failures."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from oracle import softmax_attention

import attnflow
from attnflow._cli import EXIT_FAILURE, EXIT_USAGE, main


@pytest.fixture
def weights() -> np.ndarray:
    return softmax_attention(np.random.default_rng(3), (2, 3, 2, 6, 6)).astype(np.float32)


def _safetensors(path: Path, **arrays: np.ndarray) -> Path:
    header: dict[str, object] = {}
    offset = 0
    blobs = []
    for name, array in arrays.items():
        data = np.ascontiguousarray(array).tobytes()
        dtype = {np.dtype("float32"): "F32", np.dtype("bool"): "BOOL"}[array.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
    return path


@pytest.mark.parametrize("method", ["rollout", "flow", "raw"])
@pytest.mark.parametrize("fmt", ["npz", "npy", "safetensors"])
def test_round_trip_equals_the_library(
    tmp_path: Path, weights: np.ndarray, method: str, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mask = np.array([[True] * 6, [True] * 4 + [False] * 2])
    if fmt == "npz":
        source = tmp_path / "x.npz"
        np.savez(source, attentions=weights, mask=mask)
        mask_args = ["--mask", str(source), "--mask-key", "mask"]
    elif fmt == "npy":
        source = tmp_path / "x.npy"
        np.save(source, weights)
        np.save(tmp_path / "m.npy", mask)
        mask_args = ["--mask", str(tmp_path / "m.npy")]
    else:
        source = _safetensors(tmp_path / "x.safetensors", attentions=weights, mask=mask)
        mask_args = ["--mask", str(source), "--mask-key", "mask"]
    out = tmp_path / "out.npz"
    argv = [method, str(source), "-o", str(out), "--rows", "0,3", "--layers", "all", *mask_args]
    if method == "flow":
        argv += ["--jobs", "1", "--no-progress"]
    assert main(argv) == 0
    expected = getattr(attnflow, method)(weights, rows=[0, 3], layers="all", mask=mask)
    with np.load(out, allow_pickle=False) as written:
        np.testing.assert_array_equal(written[method], expected)
    assert f"{method}: {source} -> {out}" in capsys.readouterr().out


def test_options_mirror_the_python_api(tmp_path: Path, weights: np.ndarray) -> None:
    source = tmp_path / "x.npy"
    np.save(source, weights)
    out = tmp_path / "o.npz"
    argv = [
        "rollout",
        str(source),
        "-o",
        str(out),
        "--heads",
        "0.2,0.8",
        "--residual",
        "0.3",
        "--rows",
        "2",
        "--layers",
        "1",
    ]
    assert main(argv) == 0
    expected = attnflow.rollout(weights, heads=[0.2, 0.8], residual=0.3, rows=2, layers=1)
    np.testing.assert_array_equal(np.load(out)["rollout"], expected)


def test_default_output_name_and_token_table(
    tmp_path: Path, weights: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "x.npz"
    np.savez(source, attentions=weights)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("[CLS]\na\nb\nc\nd\n[SEP]\n", encoding="utf-8")
    assert main(["rollout", str(source), "--rows", "0", "--tokens", str(tokens), "--top", "3"]) == 0
    assert (tmp_path / "x.rollout.npz").is_file()
    out = capsys.readouterr().out
    best = int(np.argmax(attnflow.rollout(weights, rows=0)[0]))
    first_row = out.splitlines()[3]  # summary, title, header, then the best token
    assert first_row.split()[:2] == [str(best), ["[CLS]", "a", "b", "c", "d", "[SEP]"][best]]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(pickle.dumps({"attentions": 1})), "never unpickles"),
        (
            lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True),
            "never unpickles",
        ),
        (lambda p: p.write_bytes(b"not an array"), "not a plain NumPy array file"),
        (lambda p: np.save(p, np.ones((3, 3))), "must have shape"),
    ],
    ids=["pickle", "object-array", "garbage", "wrong-shape"],
)
def test_bad_files_fail_in_one_line_and_write_nothing(
    tmp_path: Path, make: object, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "bad.npy"
    make(source)  # type: ignore[operator]
    status = main(["rollout", str(source), "-o", str(tmp_path / "out.npz")])
    assert status in {EXIT_USAGE, EXIT_FAILURE}
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npy"]


def test_existing_output_is_kept_unless_forced(
    tmp_path: Path, weights: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "x.npy"
    np.save(source, weights)
    out = tmp_path / "out.npz"
    out.write_bytes(b"keep me")
    assert main(["raw", str(source), "-o", str(out)]) == EXIT_USAGE
    assert "exists; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    assert main(["raw", str(source), "-o", str(out), "--force"]) == 0
    np.testing.assert_array_equal(np.load(out)["raw"], attnflow.raw(weights))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz", "x.npy"]  # no temp files


def test_ambiguous_npz_needs_a_key(
    tmp_path: Path, weights: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "x.npz"
    np.savez(source, first=weights, second=weights)
    assert main(["rollout", str(source)]) == EXIT_USAGE
    assert "choose one with --key" in capsys.readouterr().err
    assert main(["rollout", str(source), "--key", "second", "--rows", "0"]) == 0


def test_plot_renders_results_to_png_svg_pdf_and_html(
    tmp_path: Path, weights: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    source = tmp_path / "x.npy"
    np.save(source, weights)
    assert (
        main(
            [
                "rollout",
                str(source),
                "--rows",
                "0",
                "--layers",
                "all",
                "-o",
                str(tmp_path / "r.npz"),
            ]
        )
        == 0
    )
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("\n".join(f"t{i}" for i in range(6)), encoding="utf-8")
    page = tmp_path / "row.html"
    argv = [
        "plot",
        str(tmp_path / "r.npz"),
        "--kind",
        "tokens",
        "--index",
        "1,2",
        "--tokens",
        str(tokens),
        "-o",
        str(page),
    ]
    assert main(argv) == 0
    text = page.read_text(encoding="utf-8")
    expected = attnflow.rollout(weights, rows=0, layers="all")[1, 2]
    assert f'title="t{int(np.argmax(expected))}: ' in text
    assert main(argv) == EXIT_USAGE  # the page exists: kept without --force
    if importlib.util.find_spec("matplotlib") is None:
        assert main([*argv[:-1], str(tmp_path / "x.png")]) == EXIT_USAGE
        assert "attnflow[plot]" in capsys.readouterr().err
        return
    drawn = (("l.png", "layers", "0"), ("t.svg", "tokens", "0,1"), ("p.pdf", "layers", "1"))
    for name, kind, index in drawn:
        out = tmp_path / name
        assert (
            main(
                ["plot", str(tmp_path / "r.npz"), "--kind", kind, "--index", index, "-o", str(out)]
            )
            == 0
        )
        assert out.stat().st_size > 1000
    assert (tmp_path / "l.png").read_bytes()[:4] == b"\x89PNG"
    assert b"<svg" in (tmp_path / "t.svg").read_bytes()[:500]
    assert (tmp_path / "p.pdf").read_bytes()[:5] == b"%PDF-"
    assert (
        main(["plot", str(tmp_path / "r.npz"), "--kind", "layers", "-o", str(tmp_path / "bad.png")])
        == EXIT_USAGE
    )
    assert "select with --index" in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()
