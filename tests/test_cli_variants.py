"""`attnflow gradient-rollout | encoder-decoder`: files in, the library's result out, clean failures."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from oracle import softmax_attention

import attnflow
from attnflow._cli import EXIT_FAILURE, EXIT_USAGE, main

MASK = np.array([[True] * 6, [True] * 4 + [False] * 2])


def _causal(weights: np.ndarray) -> np.ndarray:
    weights = np.tril(weights)
    return weights / weights.sum(axis=-1, keepdims=True)


@pytest.fixture
def pair() -> tuple[np.ndarray, np.ndarray]:
    """Attention (batch 2, 3 layers, 2 heads, 6 tokens) and gradients of its shape."""
    rng = np.random.default_rng(9)
    weights = softmax_attention(rng, (2, 3, 2, 6, 6))
    return weights, rng.normal(size=weights.shape)


@pytest.fixture
def seq2seq() -> dict[str, np.ndarray]:
    """Encoder (S = 5), causal decoder (T = 4) and cross attention, masks and gradients."""
    rng = np.random.default_rng(6)
    arrays = {
        "encoder": softmax_attention(rng, (2, 2, 3, 5, 5)),
        "decoder": _causal(softmax_attention(rng, (2, 3, 3, 4, 4))),
        "cross": softmax_attention(rng, (2, 3, 3, 4, 5)),
        "source_mask": np.array([[True] * 5, [True] * 3 + [False] * 2]),
        "target_mask": np.array([[True] * 4, [True] * 3 + [False]]),
    }
    for name in ("encoder", "decoder", "cross"):
        arrays[f"{name}_gradients"] = rng.normal(size=arrays[name].shape)
    return arrays


def _safetensors(path: Path, **arrays: np.ndarray) -> Path:
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, array in arrays.items():
        data = np.ascontiguousarray(array).tobytes()
        dtype = {"float64": "F64", "float32": "F32", "bool": "BOOL"}[array.dtype.name]
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


def _one_line_error(capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    out, err = capsys.readouterr()
    assert out == "", out
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


# -- gradient-rollout ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["two-npy", "one-npz", "one-safetensors", "npz-and-npz"])
def test_gradient_rollout_equals_the_library(
    tmp_path: Path,
    pair: tuple[np.ndarray, np.ndarray],
    layout: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    weights, grads = pair
    np.save(tmp_path / "m.npy", MASK)
    if layout == "two-npy":
        np.save(tmp_path / "a.npy", weights)
        np.save(tmp_path / "g.npy", grads)
        files = ["a.npy", "--gradients", str(tmp_path / "g.npy")]
    elif layout == "one-npz":
        np.savez(tmp_path / "a.npz", attentions=weights, gradients=grads, mask=MASK)
        files = ["a.npz"]
    elif layout == "one-safetensors":
        _safetensors(tmp_path / "a.safetensors", attentions=weights, gradients=grads)
        files = ["a.safetensors"]
    else:  # arrays under other names, chosen with --key and --gradients-key
        np.savez(tmp_path / "a.npz", w=weights)
        np.savez(tmp_path / "g.npz", dw=grads, other=grads)
        files = ["a.npz", "--key", "w", "--gradients", str(tmp_path / "g.npz")]
        files += ["--gradients-key", "dw"]
    source = tmp_path / files[0]
    out = tmp_path / "out.npz"
    argv = ["gradient-rollout", str(source), *files[1:], "-o", str(out), "--rows", "0,3"]
    argv += ["--layers", "all", "--mask", str(tmp_path / "m.npy")]
    assert main(argv) == 0
    expected = attnflow.gradient_rollout(weights, grads, rows=[0, 3], layers="all", mask=MASK)
    with np.load(out, allow_pickle=False) as written:
        assert written.files == ["gradient_rollout"]
        np.testing.assert_array_equal(written["gradient_rollout"], expected)
    assert f"gradient_rollout: {source} -> {out}, shape (2, 3, 2, 6)" in capsys.readouterr().out


def test_the_old_normalize_flag_still_works_with_a_note(
    tmp_path: Path, pair: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    # --normalize was renamed --normalize-result (issue 25.5); it works until 0.2.
    weights, grads = pair
    np.savez(tmp_path / "x.npz", attentions=weights, gradients=grads)
    for flag in ("--normalize-result", "--normalize"):
        out = tmp_path / f"{flag[2:]}.npz"
        assert main(["gradient-rollout", str(tmp_path / "x.npz"), flag, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("--normalize is renamed --normalize-result (same meaning)") == 1
    expected = attnflow.gradient_rollout(weights, grads, normalize_result=True)
    assert not np.allclose(expected, attnflow.gradient_rollout(weights, grads))  # it matters
    for name in ("normalize-result", "normalize"):
        with np.load(tmp_path / f"{name}.npz", allow_pickle=False) as written:
            np.testing.assert_array_equal(written["gradient_rollout"], expected)


GRADIENT_OPTIONS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "weighted": (
        ["--rule", "weighted", "--residual", "0.3"],
        {"rule": "weighted", "residual": 0.3},
    ),
    "cls-without-cls": (
        ["--rows", "0", "--exclude-self", "--normalize-result"],
        {"rows": 0, "exclude_self": True, "normalize_result": True},
    ),
    "layer": (["--layers", "1", "--rows", "2"], {"layers": 1, "rows": 2}),
    "sink": (["--exclude", "0", "--rule", "weighted"], {"exclude": 0, "rule": "weighted"}),
    "sinks": (["--exclude", "0,5"], {"exclude": [0, 5]}),
    "receptive-field": (["--receptive-field"], {"receptive_field": True}),
    "receptive-field-weighted": (
        ["--receptive-field", "--rule", "weighted", "--layers", "all"],
        {"receptive_field": True, "rule": "weighted", "layers": "all"},
    ),
}


@pytest.mark.parametrize("case", GRADIENT_OPTIONS)
def test_gradient_rollout_options_reach_the_library(
    tmp_path: Path, pair: tuple[np.ndarray, np.ndarray], case: str
) -> None:
    weights, grads = pair
    if "receptive-field" in case:
        weights = _causal(weights)  # the API refuses non-causal attention here
    np.savez(tmp_path / "x.npz", attentions=weights, gradients=grads)
    flags, options = GRADIENT_OPTIONS[case]
    assert main(["gradient-rollout", str(tmp_path / "x.npz"), *flags]) == 0
    expected = attnflow.gradient_rollout(weights, grads, **options)
    default = attnflow.gradient_rollout(weights, grads)
    with np.load(tmp_path / "x.gradient_rollout.npz", allow_pickle=False) as written:
        np.testing.assert_array_equal(written["gradient_rollout"], expected)
        if expected.shape == default.shape:  # the option changed something
            assert not np.array_equal(written["gradient_rollout"], default)


def test_gradient_rollout_table_names_the_best_token(
    tmp_path: Path, pair: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    weights, grads = pair
    np.savez(tmp_path / "x.npz", attentions=weights, gradients=grads)
    names = ["[CLS]", "a", "b", "c", "d", "[SEP]"]
    (tmp_path / "t.txt").write_text("\n".join(names), encoding="utf-8")
    argv = ["gradient-rollout", str(tmp_path / "x.npz"), "--rows", "0", "--exclude-self"]
    assert main([*argv, "--tokens", str(tmp_path / "t.txt"), "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    best = int(np.argmax(attnflow.gradient_rollout(weights, grads, rows=0, exclude_self=True)[0]))
    assert lines[1] == "top tokens of the first row of the first sequence:"
    assert lines[3].split()[:2] == [str(best), names[best]]
    assert len(lines) == 3 + 3


def test_gradient_rollout_keeps_an_existing_output_unless_forced(
    tmp_path: Path, pair: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    weights, grads = pair
    np.savez(tmp_path / "x.npz", attentions=weights, gradients=grads)
    out = tmp_path / "x.gradient_rollout.npz"
    out.write_bytes(b"keep me")
    assert main(["gradient-rollout", str(tmp_path / "x.npz")]) == EXIT_USAGE
    _one_line_error(capsys, f"{out} exists; pass --force to replace it")
    assert out.read_bytes() == b"keep me"
    assert main(["gradient-rollout", str(tmp_path / "x.npz"), "--force"]) == 0
    np.testing.assert_array_equal(
        np.load(out)["gradient_rollout"], attnflow.gradient_rollout(weights, grads)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gradient_rollout.npz", "x.npz"]


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (
            ["--rule", "chefer"],
            ["argument --rule: invalid choice: 'chefer'", "'gae'", "'weighted'"],
        ),
        (["--rows", "first"], ["--rows must be", "got 'first'"]),
        (["--layers", "top"], ["--layers must be", "got 'top'"]),
        (["--exclude", "bos"], ["--exclude must be", "got 'bos'"]),
        (["--residual", "0.3"], ["--residual applies to --rule weighted", "--rule gae"]),
        (
            ["--rule", "weighted", "--residual", "2"],
            ["--residual must be a number in [0, 1]", "2.0"],
        ),
    ],
    ids=["rule", "rows", "layers", "exclude", "residual-with-gae", "residual-range"],
)
def test_gradient_rollout_bad_options_fail_before_reading(
    tmp_path: Path, flags: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # The input does not exist: the option is refused before any file is opened.
    argv = ["gradient-rollout", str(tmp_path / "absent.npz"), *flags]
    assert main(argv) == EXIT_USAGE
    err = _one_line_error(capsys, *fragments)
    assert "absent" not in err
    assert list(tmp_path.iterdir()) == []


def test_gradient_rollout_npy_needs_gradients(
    tmp_path: Path, pair: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "a.npy", pair[0])
    assert main(["gradient-rollout", str(tmp_path / "a.npy")]) == EXIT_USAGE
    _one_line_error(capsys, "holds one array: pass --gradients GRADS")


def test_gradient_rollout_missing_array_lists_the_file(
    tmp_path: Path, pair: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "x.npz", attentions=pair[0], grads=pair[1])
    assert main(["gradient-rollout", str(tmp_path / "x.npz")]) == EXIT_USAGE
    _one_line_error(capsys, "has no array named 'gradients'", "it holds ['attentions', 'grads']")
    assert main(["gradient-rollout", str(tmp_path / "x.npz"), "--key", "attn"]) == EXIT_USAGE
    _one_line_error(capsys, "has no array named 'attn'", "it holds ['attentions', 'grads']")
    assert main(["gradient-rollout", str(tmp_path / "x.npz"), "--gradients-key", "grads"]) == 0


def test_gradient_rollout_shape_mismatch_is_one_line(
    tmp_path: Path, pair: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    weights, grads = pair
    np.savez(tmp_path / "x.npz", attentions=weights, gradients=grads[:, ::-1][:, :2])
    # Refused from the headers, before any data is read: a usage error.
    assert main(["gradient-rollout", str(tmp_path / "x.npz")]) == EXIT_USAGE
    _one_line_error(
        capsys,
        "attnflow gradient-rollout: error:",
        "the gradients 'gradients' must be floating point and shaped as the attention",
        "(2, 3, 2, 6, 6)",
        "(2, 2, 2, 6, 6)",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npz"]


# -- encoder-decoder ----------------------------------------------------------------------


def _api(arrays: dict[str, np.ndarray], **options: Any) -> Any:
    if options.get("rule") == "flow":
        del options["rule"]
        return attnflow.encoder_decoder_flow(
            arrays["encoder"],
            arrays["decoder"],
            arrays["cross"],
            source_mask=arrays.get("source_mask"),
            target_mask=arrays.get("target_mask"),
            **options,
        )
    if options.get("rule") == "gae":
        options["gradients"] = tuple(
            arrays[f"{n}_gradients"] for n in ("encoder", "decoder", "cross")
        )
    return attnflow.encoder_decoder_rollout(
        arrays["encoder"],
        arrays["decoder"],
        arrays["cross"],
        source_mask=arrays.get("source_mask"),
        target_mask=arrays.get("target_mask"),
        **options,
    )


ENCODER_DECODER_OPTIONS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "defaults": ([], {}),
    "gae": (["--rule", "gae"], {"rule": "gae"}),
    "gae-normalized": (
        ["--rule", "gae", "--normalize-result", "--layers", "all"],
        {"rule": "gae", "normalize_result": True, "layers": "all"},
    ),
    "residual": (["--residual", "0.2", "--rows", "1"], {"residual": 0.2, "rows": 1}),
    "flow": (["--rule", "flow", "--rows", "0,3"], {"rule": "flow", "rows": [0, 3]}),
    "flow-raw": (
        ["--rule", "flow", "--raw-values", "--residual", "0.3", "--layers", "all", "--rows", "2"],
        {"rule": "flow", "normalize_result": False, "residual": 0.3, "layers": "all", "rows": 2},
    ),
    "flow-jobs-max-seconds": (
        ["--rule", "flow", "--jobs", "2", "--max-seconds", "30", "--rows", "1"],
        {"rule": "flow", "n_jobs": 2, "max_seconds": 30.0, "rows": 1},
    ),
    "heads-max": (["--heads", "max", "--rows", "0,2"], {"heads": "max", "rows": [0, 2]}),
    "head-weights": (
        ["--heads", "0.2,0.3,0.5", "--layers", "1"],
        {"heads": [0.2, 0.3, 0.5], "layers": 1},
    ),
}


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
@pytest.mark.parametrize("case", ENCODER_DECODER_OPTIONS)
def test_encoder_decoder_equals_the_library(
    tmp_path: Path,
    seq2seq: dict[str, np.ndarray],
    case: str,
    fmt: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if fmt == "npz":
        source = tmp_path / "s2s.npz"
        np.savez(source, **seq2seq)
    else:
        source = _safetensors(tmp_path / "s2s.safetensors", **seq2seq)
    flags, options = ENCODER_DECODER_OPTIONS[case]
    assert main(["encoder-decoder", str(source), *flags]) == 0
    expected = _api(seq2seq, **options)
    with np.load(tmp_path / "s2s.encoder_decoder.npz", allow_pickle=False) as written:
        assert sorted(written.files) == ["source", "target"]
        np.testing.assert_array_equal(written["source"], expected.source)
        np.testing.assert_array_equal(written["target"], expected.target)
    out = capsys.readouterr().out
    assert f"encoder-decoder: {source} -> {tmp_path / 's2s.encoder_decoder.npz'}, source " in out
    assert "top source tokens of" in out
    assert "top target tokens of" in out


def test_encoder_decoder_masks_are_optional_and_fused_input(
    tmp_path: Path, seq2seq: dict[str, np.ndarray]
) -> None:
    fused = {name: seq2seq[name].mean(axis=-3) for name in ("encoder", "decoder", "cross")}
    np.savez(tmp_path / "f.npz", **fused)
    out = tmp_path / "r.npz"
    assert (
        main(["encoder-decoder", str(tmp_path / "f.npz"), "--heads", "none", "-o", str(out)]) == 0
    )
    expected = _api(fused, heads=None)
    np.testing.assert_array_equal(np.load(out)["source"], expected.source)
    np.testing.assert_array_equal(np.load(out)["target"], expected.target)


def test_encoder_decoder_tokens_label_the_tables(
    tmp_path: Path, seq2seq: dict[str, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "s.npz", **seq2seq)
    (tmp_path / "src.txt").write_text("\n".join(f"src{i}" for i in range(5)), encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("\n".join(f"tgt{i}" for i in range(4)), encoding="utf-8")
    argv = ["encoder-decoder", str(tmp_path / "s.npz"), "--rows", "3", "--top", "1"]
    argv += [
        "--source-tokens",
        str(tmp_path / "src.txt"),
        "--target-tokens",
        str(tmp_path / "tgt.txt"),
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    result = _api(seq2seq, rows=3)
    assert lines[3].split()[:2] == [
        str(int(np.argmax(result.source[0]))),
        f"src{np.argmax(result.source[0])}",
    ]
    assert lines[6].split()[:2] == [
        str(int(np.argmax(result.target[0]))),
        f"tgt{np.argmax(result.target[0])}",
    ]
    bad = tmp_path / "short.txt"
    bad.write_text("a\nb\n", encoding="utf-8")
    assert main([*argv[:6], "--source-tokens", str(bad), "--force"]) == EXIT_USAGE
    _one_line_error(capsys, "--source-tokens has 2 lines but the attention has 5 tokens")


def test_encoder_decoder_keeps_an_existing_output_unless_forced(
    tmp_path: Path, seq2seq: dict[str, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "s.npz", **seq2seq)
    out = tmp_path / "mine.npz"
    out.write_bytes(b"keep me")
    assert main(["encoder-decoder", str(tmp_path / "s.npz"), "-o", str(out)]) == EXIT_USAGE
    _one_line_error(capsys, f"{out} exists; pass --force to replace it")
    assert out.read_bytes() == b"keep me"
    assert main(["encoder-decoder", str(tmp_path / "s.npz"), "-o", str(out), "--force"]) == 0
    np.testing.assert_array_equal(np.load(out)["source"], _api(seq2seq).source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.npz", "s.npz"]


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--rule", "chefer"], ["argument --rule: invalid choice: 'chefer'", "'rollout'", "'gae'"]),
        (["--rows", "x"], ["--rows must be", "got 'x'"]),
        (["--layers", "top"], ["--layers must be", "got 'top'"]),
        (["--heads", "median"], ["--heads must be", "got 'median'"]),
        (["--heads", "each"], ["--heads must be", "(no per-head maps); got 'each'"]),
        (
            ["--rule", "gae", "--heads", "max"],
            ["--heads must be 'mean' with --rule gae", "got --heads max"],
        ),
        (
            ["--rule", "gae", "--residual", "0.3"],
            ["--residual applies to --rule rollout or --rule flow only", "--rule gae"],
        ),
        (["--residual", "-1"], ["--residual must be a number in [0, 1]", "-1.0"]),
        (
            ["--rule", "flow", "--normalize-result"],
            ["--normalize-result applies to --rule rollout or gae", "unless --raw-values"],
        ),
        (["--raw-values"], ["--raw-values applies to --rule flow only", "--rule rollout"]),
        (["--jobs", "2"], ["--jobs applies to --rule flow only", "--rule rollout"]),
        (
            ["--rule", "gae", "--max-seconds", "5"],
            ["--max-seconds applies to --rule flow only", "--rule gae"],
        ),
        (
            ["--rule", "flow", "--jobs", "0"],
            ["--jobs must be a positive number of processes or -1", "got 0"],
        ),
        (
            ["--rule", "flow", "--max-seconds", "nan"],
            ["--max-seconds must be a positive number of seconds", "got nan"],
        ),
    ],
    ids=[
        "rule",
        "rows",
        "layers",
        "heads",
        "heads-each",
        "gae-heads",
        "gae-residual",
        "residual-range",
        "flow-normalize",
        "raw-values",
        "jobs-rollout",
        "max-seconds-gae",
        "jobs-zero",
        "max-seconds-nan",
    ],
)
def test_encoder_decoder_bad_options_fail_before_reading(
    tmp_path: Path, flags: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["encoder-decoder", str(tmp_path / "absent.npz"), *flags]
    assert main(argv) == EXIT_USAGE
    err = _one_line_error(capsys, *fragments)
    assert "absent" not in err
    assert list(tmp_path.iterdir()) == []


def test_encoder_decoder_flow_limit_is_the_librarys_in_flags(
    tmp_path: Path, seq2seq: dict[str, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-seconds reaches encoder_decoder_flow; its refusal names the flags, not keywords."""
    source = tmp_path / "s2s.npz"
    np.savez(source, **seq2seq)
    argv = ["encoder-decoder", str(source), "--rule", "flow", "--max-seconds", "1e-12"]
    assert main(argv) == EXIT_FAILURE
    err = _one_line_error(capsys, "above --max-seconds 1e-12", "--max-seconds inf")
    assert "`max_seconds" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s2s.npz"]  # nothing written
    assert main([*argv[:-1], "inf"]) == 0


def test_encoder_decoder_needs_a_file_of_named_arrays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "x.npy", np.ones((1, 1, 2, 2)))
    assert main(["encoder-decoder", str(tmp_path / "x.npy")]) == EXIT_USAGE
    _one_line_error(capsys, "INPUT must be an .npz or .safetensors file", "got 'x.npy'")


@pytest.mark.parametrize(
    ("drop", "flags", "fragments"),
    [
        ("cross", [], ["has no array named 'cross' (needed by every rule)"]),
        (
            "decoder_gradients",
            ["--rule", "gae"],
            ["has no array named 'decoder_gradients' (needed by --rule gae)"],
        ),
    ],
    ids=["cross", "gradients"],
)
def test_encoder_decoder_missing_array_lists_the_file(
    tmp_path: Path,
    seq2seq: dict[str, np.ndarray],
    drop: str,
    flags: list[str],
    fragments: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    kept = {name: value for name, value in seq2seq.items() if name != drop}
    np.savez(tmp_path / "s.npz", **kept)
    assert main(["encoder-decoder", str(tmp_path / "s.npz"), *flags]) == EXIT_USAGE
    _one_line_error(capsys, *fragments, f"it holds {sorted(kept)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]


def test_encoder_decoder_shape_mismatch_is_one_line(
    tmp_path: Path, seq2seq: dict[str, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    bad = dict(seq2seq, cross=seq2seq["cross"][..., :4])  # S = 4 columns for S = 5 sources
    np.savez(tmp_path / "s.npz", **bad)
    # Refused from the headers, before any data is read: a usage error.
    assert main(["encoder-decoder", str(tmp_path / "s.npz")]) == EXIT_USAGE
    _one_line_error(
        capsys,
        "attnflow encoder-decoder: error:",
        "array 'cross' must have shape (2, 3, 3, 4, 5) to match the others",
        "the file declares (2, 3, 3, 4, 4)",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]


def test_help_lists_both_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "gradient-rollout" in out
    assert "encoder-decoder" in out
    for name in ("gradient-rollout", "encoder-decoder"):
        assert main([name, "--help"]) == 0
        assert f"usage: attnflow {name}" in capsys.readouterr().out


def test_the_shared_flags_are_one_definition_in_every_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--receptive-field, --exclude, --mask, --mask-key, --tokens, --jobs, --max-seconds."""
    from attnflow._cli import build_parser

    parser = build_parser()
    files = ["--mask", "m.npy", "--mask-key", "k", "--tokens", "t.txt"]
    decoder = ["--receptive-field", "--exclude", "0,2"]
    for command in ("rollout", "flow", "gradient-rollout", "raw"):
        args = parser.parse_args([command, "x.npy", *files])
        assert (args.mask, args.mask_key, args.tokens) == ("m.npy", "k", "t.txt")
    for argv in (
        ["rollout", "x.npy"],
        ["flow", "x.npy"],
        ["gradient-rollout", "x.npz"],
        ["explain", "--model", "folder", "text"],
    ):
        args = parser.parse_args([*argv, *decoder])
        assert (args.receptive_field, args.exclude) == (True, "0,2")
    for argv in (["flow", "x.npy"], ["encoder-decoder", "x.npz", "--rule", "flow"]):
        args = parser.parse_args([*argv, "--jobs", "2", "--max-seconds", "inf"])
        assert (args.jobs, args.max_seconds) == (2, float("inf"))
    capsys.readouterr()
    for command in ("rollout", "gradient-rollout", "explain"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert "0 for a [CLS] or BOS attention sink" in " ".join(capsys.readouterr().out.split())
