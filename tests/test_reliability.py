"""Reliability under hostile input (issue 11): each bad input gets a clear error or an
honest result, never silent garbage, a clobbered file or a runaway process.

The fault-injection tests (concurrent writers, decompression bombs) are fast and bounded:
each runs in well under a second of work on a noisy 2-core machine.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import multiprocessing
import os
import re
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backends import Variant
from oracle import softmax_attention

import attnflow
from attnflow._arrayio import ArrayFileError, write_atomically

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="a PyTorch-specific input"
)


def _attention(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return softmax_attention(np.random.default_rng(seed), shape)


# -- silent garbage (item 6) ------------------------------------------------------------


@pytest.mark.parametrize("method", [attnflow.rollout, attnflow.flow, attnflow.fuse_heads])
@pytest.mark.parametrize(
    ("bad", "what"),
    [(lambda w: w.mean(axis=-3) * np.nan, "NaN"), (lambda w: w.mean(axis=-3) - 0.5, "negative")],
    ids=["nan", "negative"],
)
def test_a_heads_callable_returning_bad_weights_is_refused(
    method: Any, bad: Any, what: str
) -> None:
    with pytest.raises(ValueError, match=r"`heads` callable must return finite, non-negative"):
        method(_attention((2, 3, 4, 4)), heads=bad)


def test_an_unvalidated_nan_from_a_heads_callable_stays_nan() -> None:
    # Not an identity row: the bad values show in the result.
    result = attnflow.rollout(
        _attention((2, 3, 4, 4)), heads=lambda w: w.mean(axis=-3) * np.nan, validate=False
    )
    assert np.isnan(result).all()


def test_boolean_rows_are_refused_from_every_library(backend: Variant) -> None:
    weights = backend.asarray(_attention((2, 2, 3, 3)))
    selected = backend.asarray(np.array([True, False, True]))
    with pytest.raises(TypeError, match=r"`rows` must hold integer token positions, not a boolean"):
        attnflow.rollout(weights, rows=selected)
    with pytest.raises(TypeError, match=r"`exclude` must hold integer token positions"):
        attnflow.rollout(weights, exclude=selected)


@needs_torch
def test_a_torch_boolean_rows_tensor_is_not_read_as_positions() -> None:
    import torch

    weights = torch.asarray(_attention((2, 2, 3, 3)))
    with pytest.raises(TypeError, match="boolean mask"):
        attnflow.flow(weights, rows=torch.tensor([True, False]))


@pytest.mark.parametrize(
    "options",
    [
        {"normalize_result": False},
        {"normalize_result": False, "layers": "all"},
        {"normalize_result": False, "rows": [3, 1]},
        {"normalize_result": False, "heads": "each"},
        {"normalize_result": False, "rows": 2, "layers": "all"},
    ],
)
def test_unvalidated_flow_gives_nan_where_rollout_does(options: dict[str, Any]) -> None:
    weights = _attention((2, 3, 2, 4, 4))
    weights[0, 0, 1, 1, 1] = np.nan  # first sequence, first layer, second head
    rollout_options = {k: v for k, v in options.items() if k != "normalize_result"}
    expected = np.isnan(attnflow.rollout(weights, validate=False, **rollout_options))
    result = attnflow.flow(weights, validate=False, **options)
    np.testing.assert_array_equal(np.isnan(result), expected)
    assert expected.any()
    # The other sequence is untouched and equals its validated flow.
    np.testing.assert_allclose(result[1], attnflow.flow(weights[1:], **options)[0], atol=1e-12)


def test_unvalidated_flow_with_normalised_rows_gives_nan_rows() -> None:
    weights = _attention((3, 2, 4, 4))
    weights[0, 0, 2, :] = np.nan
    result = attnflow.flow(weights, validate=False)
    assert np.isnan(result).any()
    assert np.all(np.isnan(result).all(axis=-1) | ~np.isnan(result).any(axis=-1))  # whole rows


@pytest.mark.parametrize("max_seconds", [float("nan"), 0.0, -1.0, "1e9", True])
def test_a_bad_max_seconds_is_refused(max_seconds: object) -> None:
    with pytest.raises(ValueError, match=r"`max_seconds` must be a positive number"):
        attnflow.flow(_attention((2, 2, 3, 3)), max_seconds=max_seconds)  # type: ignore[arg-type]


def test_an_infinite_max_seconds_removes_the_limit() -> None:
    assert attnflow.flow(_attention((2, 2, 3, 3)), max_seconds=float("inf")).shape == (3, 3)


def test_the_deprecated_max_work_keeps_its_meaning_one_release() -> None:
    weights = _attention((2, 2, 3, 3))
    with pytest.warns(DeprecationWarning, match=r"`max_work` .* is replaced by `max_seconds`"):
        kept = attnflow.flow(weights, max_work=float("inf"))
    np.testing.assert_array_equal(kept, attnflow.flow(weights))
    with (
        pytest.warns(DeprecationWarning, match=r"`max_work`"),
        pytest.raises(ValueError, match=r"`max_work` must be a positive number"),
    ):
        attnflow.flow(weights, max_work=-1.0)
    with pytest.raises(TypeError, match=r"pass `max_seconds` only"):
        attnflow.flow(weights, max_work=1e9, max_seconds=10.0)


# -- weak messages (item 7, library) ----------------------------------------------------


@pytest.mark.parametrize(
    "method", [attnflow.rollout, attnflow.flow, attnflow.raw, attnflow.fuse_heads]
)
def test_none_is_named_as_the_missing_attention(method: Any) -> None:
    with pytest.raises(TypeError, match=r"^`attentions` must be an array .* got None\."):
        method(None)


# -- bfloat16 (item 4, library) ---------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("method", [attnflow.rollout, attnflow.raw, attnflow.flow])
def test_bfloat16_tensors_are_accepted_and_returned_as_bfloat16(method: Any) -> None:
    import torch

    weights = torch.asarray(_attention((2, 3, 2, 5, 5))).to(torch.bfloat16)
    result = method(weights, rows=0)
    assert result.dtype == torch.bfloat16
    # The same values widened: float32 checks would refuse bf16 rounding of the row sums.
    expected = method(weights.float(), rows=0, validate=False)
    torch.testing.assert_close(result.float(), expected, atol=2e-2, rtol=2e-2)


# -- files: helpers ------------------------------------------------------------------------


def _safetensors_bytes(header: object, data: bytes = b"") -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def _bf16_safetensors(path: Path, array: np.ndarray) -> Path:
    """Store float32 `array` as bfloat16 (round to nearest even), as PyTorch saves it."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    header = {
        "attentions": {
            "dtype": "BF16",
            "shape": list(array.shape),
            "data_offsets": [0, rounded.nbytes],
        }
    }
    path.write_bytes(_safetensors_bytes(header, rounded.tobytes()))
    return path


def _one_line(capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def _without_hard_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this file system one without hard links (some network or FAT ones)."""

    def no_link(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture
def attention_file(tmp_path: Path) -> Path:
    path = tmp_path / "x.npy"
    np.save(path, _attention((2, 3, 2, 6, 6)).astype(np.float32))
    return path


# -- two writers, one output (item 2) ------------------------------------------------------


@pytest.mark.parametrize("hard_links", [True, False], ids=["link", "o_excl"])
def test_two_racing_writers_exactly_one_wins(
    tmp_path: Path, hard_links: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both writers pass the early "exists" check, then meet at a barrier while writing,
    # so both reach the final step together: it must be exclusive. Without hard links
    # (some network file systems) the O_EXCL fallback must be too.
    if not hard_links:
        _without_hard_links(monkeypatch)
    target = tmp_path / "r.npz"
    barrier = threading.Barrier(2, timeout=10)
    outcomes: list[str] = []

    def write(file: Any) -> None:
        barrier.wait()
        file.write(threading.current_thread().name.encode())

    def writer() -> None:
        try:
            write_atomically(target, write, force=False)
            outcomes.append("won")
        except ArrayFileError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=writer, name=f"writer-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(outcomes) == sorted(["won", f"{target} exists; pass --force to replace it"])
    assert target.read_bytes() in {b"writer-0", b"writer-1"}
    assert _leftovers(tmp_path) == []


def test_two_racing_cli_runs_give_one_output_and_one_exists_error(
    attention_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnflow._cli import EXIT_USAGE, main

    barrier = threading.Barrier(2, timeout=10)
    savez = np.savez

    def savez_together(file: Any, **arrays: Any) -> None:
        barrier.wait()  # both runs have passed every check and computed their result
        savez(file, **arrays)

    monkeypatch.setattr(np, "savez", savez_together)
    out = tmp_path / "r.npz"
    statuses: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: statuses.append(main(["raw", str(attention_file), "-o", str(out)]))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(statuses) == [0, EXIT_USAGE]
    with np.load(out) as written:
        assert written["raw"].shape == (2, 6, 6)
    assert _leftovers(tmp_path) == []


def test_a_dangling_symlink_counts_as_an_existing_output(
    attention_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import EXIT_USAGE, main

    out = tmp_path / "r.npz"
    out.symlink_to(tmp_path / "nowhere.npz")
    assert main(["raw", str(attention_file), "-o", str(out)]) == EXIT_USAGE
    _one_line(capsys, f"{out} exists; pass --force")
    assert out.is_symlink()
    assert not (tmp_path / "nowhere.npz").exists()
    # The library's writer refuses it too, even when the caller skipped the early check.
    with pytest.raises(ArrayFileError, match="exists"):
        write_atomically(out, lambda file: file.write(b"x"), force=False)
    assert out.is_symlink()
    assert main(["raw", str(attention_file), "-o", str(out), "--force"]) == 0
    assert not out.is_symlink()
    assert out.is_file()


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
@pytest.mark.parametrize("force", [False, True])
def test_no_temporary_file_is_left_when_writing_fails(
    tmp_path: Path, error: BaseException, force: bool
) -> None:
    def write(file: Any) -> None:
        file.write(b"partial")
        raise error

    with pytest.raises(type(error)):
        write_atomically(tmp_path / "r.npz", write, force=force)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_page_is_published_exclusively_as_arrays_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    # TokenView.save goes through the same writer as the arrays: a page that appears while
    # this one is being written wins, with hard links or without (the O_EXCL claim).
    from attnflow.html import TokenView

    if not hard_links:
        _without_hard_links(monkeypatch)
    target = tmp_path / "view.html"
    view = TokenView(np.array([0.4, 0.6]), ["a", "b"])
    page = view.to_html()

    def render_while_another_writer_wins(self: TokenView) -> str:
        target.write_text("the other writer's page", encoding="utf-8")
        return page

    monkeypatch.setattr(TokenView, "to_html", render_while_another_writer_wins)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        view.save(target)
    assert target.read_text(encoding="utf-8") == "the other writer's page"
    assert _leftovers(tmp_path) == []
    # A dangling link is a file too.
    link = tmp_path / "link.html"
    link.symlink_to(tmp_path / "nowhere.html")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        view.save(link)
    assert link.is_symlink()
    assert not (tmp_path / "nowhere.html").exists()
    assert view.save(link, overwrite=True) == link
    assert not link.is_symlink()
    assert link.read_text(encoding="utf-8") == page
    assert link.stat().st_mode & 0o777 == 0o644
    assert _leftovers(tmp_path) == []


# -- decompression bombs (item 3) ----------------------------------------------------------

_BOMB_SHAPE = (20000, 20000)  # float32: 1.6 GB once inflated


def _deflate_zeros(prefix: bytes, zeros: int) -> bytes:
    """Raw deflate of `prefix` then `zeros` zero bytes, built in well under a second.

    Each 16 MB chunk is compressed after a full flush, which resets the compressor: every
    chunk after the first compresses to the same bytes, so those are repeated, not redone.
    """
    chunk = 16_000_000
    assert zeros % chunk == 0
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = compressor.compress(prefix + bytes(chunk)) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = bytes(chunk)
    repeated = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    assert again == repeated
    tail = compressor.flush()
    return first + repeated * (zeros // chunk - 1) + tail


def _zip_one_member(path: Path, name: str, deflated: bytes, size: int) -> None:
    """A zip archive of one deflated member, written by hand (zipfile cannot take deflated
    bytes). Its CRC is left 0: computing it would mean inflating 1.6 GB; a reader that
    checks headers first never gets that far, one that inflates first fails late."""
    encoded = name.encode()
    local = struct.pack(
        "<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0x21, 0, len(deflated), size, len(encoded), 0
    )
    central = struct.pack(
        "<4s6H3L5H2L",
        b"PK\x01\x02",
        20,
        20,
        0,
        8,
        0,
        0x21,
        0,
        len(deflated),
        size,
        len(encoded),
        0,
        0,
        0,
        0,
        0,
        0,
    )
    offset = len(local) + len(encoded) + len(deflated)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(encoded), offset, 0)
    path.write_bytes(local + encoded + deflated + central + encoded + end)


@pytest.fixture(scope="module")
def bomb_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": _BOMB_SHAPE}
    )
    zeros = 4 * math.prod(_BOMB_SHAPE)
    path = tmp_path_factory.mktemp("bomb") / "bomb.npz"
    deflated = _deflate_zeros(header.getvalue(), zeros)
    _zip_one_member(path, "attentions.npy", deflated, len(header.getvalue()) + zeros)
    assert path.stat().st_size < 3_000_000
    return path


_MEASURE = """
import json, resource, sys, time
import attnflow, attnflow._cli
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
status = attnflow._cli.main(sys.argv[1:])
seconds = time.perf_counter() - start
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"status": status, "seconds": seconds, "grown_kb": grown}))
"""


def _measure_cli(*argv: str) -> tuple[dict[str, Any], str]:
    """Run the command line in a fresh process; its status, time and peak-memory growth."""
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_a_decompression_bomb_is_refused_from_its_header(bomb_npz: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.npz"
    report, err = _measure_cli("rollout", str(bomb_npz), "-o", str(out))
    assert report["status"] == 2, err
    assert str(bomb_npz) in err
    assert "(20000, 20000)" in err
    assert "must have shape" in err
    assert report["seconds"] < 1.0, report
    assert report["grown_kb"] < 100 * 1024, report
    assert not out.exists()


def test_a_bomb_inside_a_valid_shape_is_refused_against_memory(
    bomb_npz: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnflow import _arrayio

    monkeypatch.setattr(_arrayio, "_available_memory", lambda: 1_000_000_000)
    with pytest.raises(ArrayFileError, match=r"1\.49 GiB once loaded, more than the 0\.931 GiB"):
        _arrayio.read_array(bomb_npz, key=None, default="attentions")


def test_a_huge_npy_is_refused_from_its_header(tmp_path: Path) -> None:
    # A sparse file: 1.6 GB of declared data that costs nothing on disk.
    path = tmp_path / "big.npy"
    with path.open("wb") as file:
        np.lib.format.write_array_header_1_0(
            file, {"descr": "<f4", "fortran_order": False, "shape": _BOMB_SHAPE}
        )
        file.truncate(file.tell() + 4 * math.prod(_BOMB_SHAPE))
    report, err = _measure_cli("flow", str(path), "-o", str(tmp_path / "r.npz"))
    assert report["status"] == 2, err
    assert "must have shape" in err
    assert report["seconds"] < 1.0, report
    assert report["grown_kb"] < 100 * 1024, report


def test_a_huge_safetensors_tensor_is_refused_from_its_header(tmp_path: Path) -> None:
    nbytes = 4 * math.prod(_BOMB_SHAPE)
    header = {
        "attentions": {"dtype": "F32", "shape": list(_BOMB_SHAPE), "data_offsets": [0, nbytes]}
    }
    path = tmp_path / "big.safetensors"
    with path.open("wb") as file:
        file.write(_safetensors_bytes(header))
        file.truncate(file.tell() + nbytes)
    report, err = _measure_cli("raw", str(path), "-o", str(tmp_path / "r.npz"))
    assert report["status"] == 2, err
    assert "must have shape" in err
    assert report["seconds"] < 1.0, report
    assert report["grown_kb"] < 100 * 1024, report


# -- bfloat16 files (item 4) ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["rollout", "flow", "raw"])
def test_a_valid_bfloat16_safetensors_file_is_accepted(
    tmp_path: Path, method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import main

    weights = _attention((2, 3, 4, 16, 16))
    source = _bf16_safetensors(tmp_path / "bf16.safetensors", weights)
    assert main([method, str(source), "-o", str(tmp_path / "r.npz")]) == 0, capsys.readouterr()
    with np.load(tmp_path / "r.npz") as written:
        result = written[method]
    expected = getattr(attnflow, method)(weights)
    np.testing.assert_allclose(result, expected, atol=3e-2)


def test_bfloat16_files_still_refuse_rows_that_do_not_sum_to_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import EXIT_FAILURE, main

    weights = _attention((2, 3, 4, 16, 16)) * 1.5  # 50 % off: no rounding explains it
    source = _bf16_safetensors(tmp_path / "bf16.safetensors", weights)
    assert main(["rollout", str(source), "-o", str(tmp_path / "r.npz")]) == EXIT_FAILURE
    _one_line(capsys, "rows must sum to 1", "for bfloat16", "--no-validate")
    assert not (tmp_path / "r.npz").exists()


def test_the_row_sum_tolerance_follows_the_stored_dtype() -> None:
    import array_api_compat.numpy as xp

    from attnflow._validation import row_sum_tolerance, stored_precision

    float32 = row_sum_tolerance(xp, np.float32, 64)
    with stored_precision("bfloat16", 2.0**-7):
        assert row_sum_tolerance(xp, np.float32, 64) == pytest.approx(10 * 8 * 2.0**-7)
        assert row_sum_tolerance(xp, np.float64, 64) > float32
    assert row_sum_tolerance(xp, np.float32, 64) == float32
    assert row_sum_tolerance(xp, np.float16, 64) == pytest.approx(10 * 8 * 2.0**-10)


# -- empty batches (item 5) ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["rollout", "flow", "raw"])
def test_an_empty_batch_works_end_to_end(
    tmp_path: Path, method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import main

    empty = np.zeros((0, 3, 2, 6, 6))
    assert getattr(attnflow, method)(empty).shape == (0, 6, 6)
    assert getattr(attnflow, method)(empty, rows=0, layers="all").shape == (0, 3, 6)
    source = tmp_path / "empty.npy"
    np.save(source, empty)
    out = tmp_path / "r.npz"
    assert main([method, str(source), "-o", str(out)]) == 0
    assert "the result is empty, shape (0, 6, 6)" in capsys.readouterr().out
    with np.load(out) as written:
        assert written[method].shape == (0, 6, 6)


# -- weak messages and codes (item 7) ------------------------------------------------------


def test_a_truncated_npz_is_named_with_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import EXIT_USAGE, main

    whole = tmp_path / "whole.npz"
    np.savez_compressed(whole, attentions=_attention((2, 3, 2, 6, 6)))
    cut = tmp_path / "cut.npz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert main(["rollout", str(cut), "-o", str(tmp_path / "r.npz")]) == EXIT_USAGE
    _one_line(capsys, str(cut), "truncated or not a zip archive")
    assert not (tmp_path / "r.npz").exists()


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ([1, 2], "header must be a JSON object of tensors; got a JSON list"),
        ({"attentions": {"dtype": "F32", "shape": [1]}}, "has no 'data_offsets'"),
        ({"attentions": [1, 2]}, "must be a JSON object with dtype, shape and data_offsets"),
        ({"attentions": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, "has shape"),
        (
            {"attentions": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4000]}},
            "expected [start, end] within the 4 bytes of data",
        ),
        ({"attentions": {"dtype": "C64", "shape": [1], "data_offsets": [0, 4]}}, "'C64'"),
    ],
    ids=["list", "no-offsets", "entry-list", "shape-string", "offsets-outside", "dtype"],
)
def test_a_malformed_safetensors_header_gets_a_clear_message(
    tmp_path: Path, header: object, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import EXIT_USAGE, main

    source = tmp_path / "bad.safetensors"
    source.write_bytes(_safetensors_bytes(header, bytes(4)))
    assert main(["rollout", str(source), "-o", str(tmp_path / "r.npz")]) == EXIT_USAGE
    _one_line(capsys, str(source), fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["rollout", "--residual", "2"], "--residual must be in [0, 1]"),
        (["raw", "--rows", "99"], "--rows must index the 6 output positions"),
        (["flow", "--jobs", "0"], "--jobs must be a positive number of processes"),
        (["flow", "--max-work", "nan"], "--max-work must be a positive number"),
        (["flow", "--max-seconds", "nan"], "--max-seconds must be a positive number"),
        (["rollout", "--layers", "7"], "--layers must index the 3 layers"),
        (["flow", "--exclude", "6"], "--exclude must index the 6 input tokens"),
        (["rollout", "--heads", "1,2,3"], "--heads gives 3 weights for attention with 2 heads"),
    ],
)
def test_bad_option_values_are_usage_errors_checked_before_the_output_exists_check(
    attention_file: Path,
    tmp_path: Path,
    argv: list[str],
    fragment: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from attnflow._cli import EXIT_USAGE, main

    out = tmp_path / "r.npz"
    out.write_bytes(b"kept")  # exists: a bad option must still be reported as such
    command, *options = argv
    assert main([command, str(attention_file), "-o", str(out), *options]) == EXIT_USAGE
    err = _one_line(capsys, fragment)
    assert "exists" not in err
    assert out.read_bytes() == b"kept"


@pytest.mark.parametrize(
    ("argv", "flag", "keyword"),
    [
        (["flow", "--max-seconds", "1e-9"], "--max-seconds inf", "max_seconds=None"),
        (["flow", "--max-seconds", "1e-9"], "--jobs", "executor="),
        (["rollout"], "--no-validate", "validate=False"),
    ],
)
def test_errors_through_the_cli_name_flags_not_python_keywords(
    tmp_path: Path, argv: list[str], flag: str, keyword: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import EXIT_FAILURE, main

    source = tmp_path / "x.npy"
    weights = _attention((2, 3, 2, 6, 6))
    if argv == ["rollout"]:
        weights = weights * 1.5  # rows do not sum to one
    np.save(source, weights)
    command, *options = argv
    assert main([command, str(source), "-o", str(tmp_path / "r.npz"), *options]) == EXIT_FAILURE
    err = _one_line(capsys, flag)
    assert keyword not in err
    assert not (tmp_path / "r.npz").exists()


def test_cli_flag_translation() -> None:
    from attnflow._cli_flags import in_flags

    assert (
        in_flags("pass `max_work=None`, `heads=None` or `rows=0`; `layers=` and `top_k`")
        == "pass --max-work inf, --heads none or --rows 0; --layers and --top-k"
    )
    assert in_flags("`unknown=1` stays") == "`unknown=1` stays"


_UNGUARDED = """
import sys
sys.modules["__main__"].__file__ = sys.argv[1]
from attnflow._lost_workers import lost_workers_message
print(lost_workers_message("attention flow", serial_hint="pass `n_jobs=1`"))
"""


@pytest.mark.parametrize(
    ("script", "blamed"),
    [
        ("import attnflow\nattnflow.flow(w, n_jobs=2)\n", True),
        ('if __name__ == "__main__":\n    main()\n', False),
    ],
    ids=["unguarded", "guarded"],
)
def test_a_lost_worker_blames_the_main_guard_only_when_it_is_missing(
    tmp_path: Path, script: str, blamed: bool
) -> None:
    main_script = tmp_path / "script.py"
    main_script.write_text(script)
    run = subprocess.run(
        [sys.executable, "-c", _UNGUARDED, str(main_script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    message = run.stdout.strip()
    assert ("has no `if __name__" in message) is blamed, message
    assert ("killed by a signal" in message) is not blamed, message
    assert "\n" not in message


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_killed_worker_is_reported_as_died_not_as_a_missing_guard() -> None:
    # Pytest's own main module has the guard: a worker that dies is reported as killed.
    from concurrent.futures import ProcessPoolExecutor

    class KillingPool(ProcessPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            return super().submit(os.abort)  # the worker kills itself (SIGABRT)

    # Never fork the test process: JAX and PyTorch may run threads in it.
    pool = KillingPool(max_workers=1, mp_context=multiprocessing.get_context("forkserver"))
    try:
        with pytest.raises(RuntimeError, match=r"died before finishing \(killed by a signal"):
            attnflow.flow(_attention((2, 3, 2, 6, 6)), executor=pool)
    finally:
        pool.shutdown()


def test_the_reliability_page_names_only_tests_that_exist() -> None:
    # docs/reliability.md cites a test for each row: a renamed test must not leave it stale.
    root = Path(__file__).parents[1]
    page = (root / "docs" / "reliability.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"`(test_\w+)`", page))
    defined = {
        match
        for folder in ("tests", "property_tests")
        for path in (root / folder).rglob("test_*.py")
        # Module-level tests, and the methods of test classes (indented once).
        for match in re.findall(
            r"^(?:    )?def (test_\w+)", path.read_text(encoding="utf-8"), re.MULTILINE
        )
    }
    assert cited, "the page cites no tests"
    assert sorted(cited - defined) == []


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--rows", "99"], "--rows must index the 6 output positions"),
        (["--layers", "7"], "--layers must index the 3 layers"),
        (["--exclude", "6"], "--exclude must index the 6 input tokens"),
    ],
)
def test_gradient_rollout_checks_options_before_the_output_exists_check(
    tmp_path: Path, options: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import EXIT_USAGE, main

    weights = _attention((2, 3, 2, 6, 6))
    source = tmp_path / "g.npz"
    np.savez(source, attentions=weights, gradients=np.ones_like(weights))
    out = tmp_path / "r.npz"
    out.write_bytes(b"kept")
    assert main(["gradient-rollout", str(source), "-o", str(out), *options]) == EXIT_USAGE
    assert "exists" not in _one_line(capsys, fragment)
    assert out.read_bytes() == b"kept"


@pytest.mark.parametrize("fused", [False, True], ids=["heads", "heads-none"])
def test_a_mask_file_is_checked_from_its_header(
    tmp_path: Path, fused: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import EXIT_USAGE, main

    weights = _attention((2, 3, 2, 6, 6))
    source = tmp_path / "x.npy"
    np.save(source, weights.mean(axis=-3) if fused else weights)
    heads = ["--heads", "none"] if fused else []
    mask = np.ones((2, 6), dtype=bool)
    mask[0, 5] = False
    np.save(tmp_path / "m.npy", mask)
    out = tmp_path / "r.npz"
    assert (
        main(["rollout", str(source), "--mask", str(tmp_path / "m.npy"), "-o", str(out), *heads])
        == 0
    )
    np.save(tmp_path / "bad.npy", mask[:, :5])
    bad = [
        "rollout",
        str(source),
        "--mask",
        str(tmp_path / "bad.npy"),
        "-o",
        str(tmp_path / "b.npz"),
    ]
    assert main([*bad, *heads]) == EXIT_USAGE
    _one_line(capsys, "--mask must be a boolean array of shape (*batch, n) = (2, 6)")
    assert not (tmp_path / "b.npz").exists()
