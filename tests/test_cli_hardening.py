"""Hostile and damaged input on the command line and in Explanation.load (issue 22).

Every reader checks the headers of its arrays before reading a byte of data (a small
``.npz`` can inflate to gigabytes); text files are read bounded, and never from a FIFO or a
device; a failed command leaves no file behind; ``--layers all`` tables show the last layer.
Data reads are counted by wrapping ``numpy.lib.format.read_array``, which inflates an
``.npz`` member (headers are parsed without it).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import attnflow
from attnflow._cli import EXIT_USAGE, main
from attnflow.explanation import Explanation

RNG = np.random.default_rng(22)


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the ``.npz`` members whose data is read (inflated)."""
    names: list[str] = []
    original = np.lib.format.read_array

    def counted(stream: object, *args: object, **kwargs: object) -> np.ndarray:
        names.append(str(getattr(stream, "name", "?")))
        return original(stream, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(np.lib.format, "read_array", counted)
    return names


def attention(*shape: int) -> np.ndarray:
    return RNG.dirichlet(np.ones(shape[-1]), size=shape[:-1])


def zeros_bomb(shape: tuple[int, ...]) -> np.ndarray:
    """Zeros: a compressed .npz of them is a tiny file that inflates to their full size."""
    return np.zeros(shape, dtype=np.float32)


def one_line(capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    _, err = capsys.readouterr()
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


# -- item 4: every reader checks the headers first -----------------------------------------


def test_plot_refuses_a_bomb_from_its_header(
    tmp_path: Path, reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez_compressed("bomb.npz", scores=zeros_bomb((1, 2048, 2048)))  # 16 MiB in ~16 KiB
    assert (tmp_path / "bomb.npz").stat().st_size < 100_000
    assert main(["plot", "bomb.npz", "-o", "p.html"]) == EXIT_USAGE
    one_line(capsys, "--kind tokens draws an array of 1 dimension(s)", "(1, 2048, 2048)")
    assert reads == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.npz"]


@pytest.fixture
def small_bomb_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnflow import _array_headers

    # 1 MiB here, 256 MiB for real (raising=False: main had no such limit to lower)
    monkeypatch.setattr(_array_headers, "BOMB_SIZE", 2**20, raising=False)


@pytest.mark.parametrize("command", ["rollout", "evaluate"])
def test_a_consistent_but_bomb_like_member_is_refused_by_its_ratio(
    reads: list[str], small_bomb_size: None, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    zeros = np.zeros((16, 2, 2, 64, 64))  # 2 MiB of float64, every shape consistent
    zeros[..., 0] = 1.0
    arrays = {"attentions": zeros, "blank_out": np.zeros((16, 64))}
    np.savez_compressed("bomb.npz", **arrays)
    argv = ["rollout", "bomb.npz", "-o", "r.npz"]
    if command == "evaluate":
        argv = ["evaluate", "bomb.npz", "-o", "run", "--quiet"]
    assert main(argv) == EXIT_USAGE
    one_line(capsys, "bomb.npz: array 'attentions'", "likely decompression bomb", "numpy.savez")
    assert reads == []
    np.savez("plain.npz", **arrays)  # uncompressed: its size is its own
    assert main(["rollout", "plain.npz", "--rows", "0", "-o", "plain.rollout.npz"]) == 0


def test_explanation_load_refuses_bomb_like_scores_by_their_ratio(
    reads: list[str], small_bomb_size: None
) -> None:
    Explanation([str(i) for i in range(64)], {"rollout": np.ones(64) / 64}).save("e.npz")
    with zipfile.ZipFile("e.npz") as archive:
        meta = archive.read("meta.npy")
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((4096, 64)))  # 2 MiB of zeros for the 64 tokens
    with zipfile.ZipFile("bomb.npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("meta.npy", meta)
        archive.writestr("scores/rollout.npy", buffer.getvalue())
    with pytest.raises(ValueError, match=r"'scores/rollout'.*likely decompression bomb"):
        Explanation.load("bomb.npz")
    assert "scores/rollout.npy" not in reads


def test_plot_index_outside_the_array_is_refused_unread(
    reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez_compressed("s.npz", scores=zeros_bomb((3, 8)))
    assert main(["plot", "s.npz", "--index", "5", "-o", "p.html"]) == EXIT_USAGE
    one_line(capsys, "--index 5 does not fit an array of shape (3, 8)")
    assert reads == []
    assert main(["plot", "s.npz", "--index", "2", "-o", "p.html"]) == 0
    assert Path("p.html").is_file()


def test_gradient_rollout_reads_no_data_of_misshapen_gradients(
    reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    a = attention(1, 2, 2, 5, 5)
    np.savez_compressed("a.npz", attentions=a, gradients=zeros_bomb((1, 2, 2, 1024, 1024)))
    assert main(["gradient-rollout", "a.npz"]) == EXIT_USAGE
    one_line(capsys, "shaped as the attention, (1, 2, 2, 5, 5)", "(1, 2, 2, 1024, 1024)")
    assert reads == []


def test_gradient_rollout_reads_only_its_two_arrays(
    reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    a = attention(1, 2, 2, 5, 5)
    g = RNG.normal(size=a.shape)
    np.savez_compressed("a.npz", attentions=a, gradients=g, other=zeros_bomb((4096, 1024)))
    assert main(["gradient-rollout", "a.npz", "--rows", "0"]) == 0
    assert sorted(reads) == ["attentions.npy", "gradients.npy"]
    expected = attnflow.gradient_rollout(a, g, rows=0)
    np.testing.assert_array_equal(np.load("a.gradient_rollout.npz")["gradient_rollout"], expected)


def test_encoder_decoder_reads_no_data_of_a_misshapen_family(
    reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    arrays = {
        "encoder": attention(1, 2, 2, 4, 4),
        "decoder": attention(1, 2, 2, 3, 3),
        "cross": zeros_bomb((1, 2, 2, 3, 100_000)),
    }
    np.savez_compressed("s.npz", **arrays)
    assert main(["encoder-decoder", "s.npz"]) == EXIT_USAGE
    one_line(capsys, "array 'cross' must have shape (1, 2, 2, 3, 4)", "(1, 2, 2, 3, 100000)")
    assert reads == []


def test_encoder_decoder_rows_out_of_range_refused_unread(
    reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    arrays = {
        "encoder": attention(1, 2, 2, 4, 4),
        "decoder": attention(1, 2, 2, 3, 3),
        "cross": attention(1, 2, 2, 3, 4),
    }
    np.savez("s.npz", **arrays)
    assert main(["encoder-decoder", "s.npz", "--rows", "7"]) == EXIT_USAGE
    one_line(capsys, "s.npz: --rows must index the 3 output positions")
    assert reads == []


def saved_outputs(n_samples: int = 4, n: int = 6) -> dict[str, np.ndarray]:
    return {
        "attentions": attention(n_samples, 2, n, n),
        "blank_out": RNG.random((n_samples, n)),
    }


def test_evaluate_file_refuses_misshapen_arrays_unread(
    tmp_path: Path, reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    arrays = saved_outputs() | {"input_gradients": zeros_bomb((4, 2_000_000))}
    np.savez_compressed("outputs.npz", **arrays)
    assert main(["evaluate", "outputs.npz", "-o", "run"]) == EXIT_USAGE
    one_line(capsys, "reference 'input_gradients' must have shape (4, 6)", "(4, 2000000)")
    assert reads == []
    assert not list((tmp_path / "run").rglob("*.json")) if (tmp_path / "run").exists() else True


def test_evaluate_file_refuses_a_row_out_of_range_before_any_work(
    tmp_path: Path, reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez("outputs.npz", **saved_outputs())
    assert main(["evaluate", "outputs.npz", "--rows", "0,9", "-o", "run", "--quiet"]) == EXIT_USAGE
    one_line(capsys, "--rows 9 is out of range for the 6 tokens")
    assert reads == []
    assert not (tmp_path / "run" / "rows-9").exists()
    assert not (tmp_path / "run" / "rows-0").exists()


SCORES = attention(2, 4)


def explanation() -> Explanation:
    return Explanation(["[CLS]", "a", "cat", "[SEP]"], {"rollout": SCORES})


def test_explanation_load_refuses_a_bomb_from_its_headers(tmp_path: Path, reads: list[str]) -> None:
    explanation().save("e.npz")
    with zipfile.ZipFile("e.npz") as archive:
        meta = archive.read("meta.npy")
    with zipfile.ZipFile("bomb.npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("meta.npy", meta)
        buffer = io.BytesIO()
        np.save(buffer, zeros_bomb((1, 4_000_000)))
        archive.writestr("scores/rollout.npy", buffer.getvalue())
    assert (tmp_path / "bomb.npz").stat().st_size < 100_000
    with pytest.raises(ValueError, match=r"bomb\.npz: scores 'scores/rollout' must have shape"):
        Explanation.load("bomb.npz")
    assert "scores/rollout.npy" not in reads


def test_explanation_load_refuses_a_huge_metadata_string_unread(
    tmp_path: Path, reads: list[str]
) -> None:
    header = np.lib.format.header_data_from_array_1_0(np.asarray("x"))
    header["descr"] = "<U500000000"  # 2 GB of text declared
    with zipfile.ZipFile("e.npz", "w") as archive, archive.open("meta.npy", "w") as member:
        np.lib.format.write_array_header_1_0(member, header)
    with pytest.raises(ValueError, match=r"e\.npz: .*'meta' declares"):
        Explanation.load("e.npz")
    assert reads == []


@pytest.mark.parametrize("damage", ["truncated", "no metadata", "not json", "garbage"])
def test_explanation_load_of_a_damaged_file_is_one_line_naming_it(
    tmp_path: Path, damage: str
) -> None:
    good = explanation().save("good.npz")
    path = tmp_path / "bad.npz"
    if damage == "truncated":
        path.write_bytes(good.read_bytes()[:-200])
    elif damage == "no metadata":
        np.savez(path, **{"scores/rollout": attention(2, 4)})
    elif damage == "not json":
        np.savez(path, meta=np.asarray("{not json"), **{"scores/rollout": attention(2, 4)})
    else:
        path.write_bytes(b"PK\x03\x04" + bytes(300))
    with pytest.raises(ValueError, match=r"bad\.npz") as caught:
        Explanation.load(path)
    assert "\n" not in str(caught.value)
    assert not isinstance(caught.value, KeyError | zipfile.BadZipFile | EOFError)
    loaded = Explanation.load(good)
    np.testing.assert_array_equal(loaded.scores["rollout"], explanation().scores["rollout"])


# -- item 8: a missing output folder is found before the work -------------------------------


@pytest.mark.parametrize("command", ["flow", "gradient-rollout", "encoder-decoder", "plot"])
def test_an_output_in_a_missing_folder_is_refused_before_reading(
    command: str, reads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    a = attention(1, 2, 2, 4, 4)
    np.savez(
        "in.npz",
        attentions=a,
        gradients=np.ones_like(a),
        scores=a[0, 0, 0, 0],
        encoder=a,
        decoder=a,
        cross=a,
    )
    output = "missing/out." + ("html" if command == "plot" else "npz")
    assert main([command, "in.npz", "-o", output]) == EXIT_USAGE
    one_line(capsys, "folder missing does not exist")
    assert reads == []


# -- item 5: bounded text reads ------------------------------------------------------------


# The child limits its own memory before attnflow runs: a read without bound fails there at
# 3 GiB instead of taking the machine's memory. (Not via preexec_fn: it forces a fork, which
# JAX, imported by the test session, warns about.)
_LIMITED = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30)); "
    "from attnflow._cli import main; sys.exit(main(sys.argv[1:]))"
)


def run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", _LIMITED, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("command", ["rollout", "plot"])
def test_tokens_from_a_fifo_or_device_is_refused_at_once(
    tmp_path: Path, kind: str, command: str
) -> None:
    np.save("a.npy", attention(1, 2, 2, 4, 4))
    np.save("s.npy", RNG.random(4))
    if kind == "fifo":
        os.mkfifo("tokens")
        tokens = "tokens"
    else:
        tokens = "/dev/zero"
    argv = ["rollout", "a.npy"] if command == "rollout" else ["plot", "s.npy", "-o", "p.html"]
    try:
        done = run_cli(*argv, "--tokens", tokens, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--tokens {kind} hangs")
    assert done.returncode == EXIT_USAGE, done.stderr
    expected = "a named pipe (FIFO)" if kind == "fifo" else "a character device"
    assert f"--tokens: {tokens} is {expected}, not a text file" in done.stderr
    assert done.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != "") == ["a.npy", "s.npy"]


def test_tokens_file_over_the_limit_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow import _textio

    monkeypatch.setattr(_textio, "TEXT_LIMIT", 1000)
    np.save("a.npy", attention(1, 2, 2, 4, 4))
    Path("tokens.txt").write_text("a\n" * 2000, encoding="utf-8")
    assert main(["rollout", "a.npy", "--tokens", "tokens.txt"]) == EXIT_USAGE
    one_line(capsys, "--tokens: tokens.txt holds 4,000 bytes, more than the 1,000")
    Path("ok.txt").write_text("w\nx\ny\nz\n", encoding="utf-8")
    assert main(["rollout", "a.npy", "--tokens", "ok.txt", "-o", "r.npz"]) == 0


# -- item 16: --layers all shows the last layer ----------------------------------------------


@pytest.mark.parametrize("rows", ["0", "0,2", "all"])
@pytest.mark.parametrize("heads", ["mean", "each"])
def test_layers_all_table_shows_the_last_layer(
    rows: str, heads: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a = attention(2, 3, 2, 5, 5)
    a[:, 0] = attention(2, 2, 5, 5) ** 8  # a first layer unlike the last
    a[:, 0] /= a[:, 0].sum(-1, keepdims=True)
    np.save("a.npy", a)
    tables = []
    for layers in ("last", "all"):
        argv = ["rollout", "a.npy", "--rows", rows, "--heads", heads, "--layers", layers]
        assert main([*argv, "-o", f"{layers}.npz", "--top", "5"]) == 0
        tables.append(capsys.readouterr().out.splitlines()[3:])  # the rows of the table
    assert tables[0] == tables[1]
    last = np.asarray(attnflow.rollout(a, heads=heads, layers="last"))
    first_row = last[0, 0, 0] if heads == "each" else last[0, 0]
    best = int(np.argmax(first_row))
    assert tables[1][0].split()[0] == str(best)


def test_layers_all_title_says_which_layer(capsys: pytest.CaptureFixture[str]) -> None:
    np.save("a.npy", attention(1, 3, 2, 4, 4))
    assert main(["raw", "a.npy", "--rows", "0", "--layers", "all"]) == 0
    assert "at the last layer (3 of 3)" in capsys.readouterr().out


# -- item 7: a failed demo leaves nothing --------------------------------------------------


@pytest.mark.parametrize("failure", [RuntimeError("drawing failed"), KeyboardInterrupt()])
def test_a_failed_demo_leaves_no_folder_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    pytest.importorskip("matplotlib")
    import attnflow.plot

    drawn = attnflow.plot.attention_graph
    calls: list[int] = []

    def broken(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) in (2, 3):  # the second run fails at once
            raise failure
        return drawn(*args, **kwargs)

    # The first sentence's two figures are drawn (and saved), then the second's graph fails.
    monkeypatch.setattr(attnflow.plot, "attention_graph", broken)
    assert main(["demo", "-o", "out/demo"]) in (1, 130)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("mine", encoding="utf-8")
    assert main(["demo", "-o", "kept"]) in (1, 130)
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["mine.txt"]


# -- item 9: meta tensors, integer scalars for n_jobs ---------------------------------------


def test_flow_accepts_integer_scalars_for_n_jobs() -> None:
    a = attention(2, 3, 2, 12, 12)
    expected = attnflow.flow(a, n_jobs=2)
    for n_jobs in (np.int64(2), np.int32(2), np.uint8(2)):
        np.testing.assert_array_equal(attnflow.flow(a, n_jobs=n_jobs), expected)
    for bad in (True, np.bool_(True), 2.0, np.float64(2.0), np.int64(0), "2"):
        with pytest.raises(ValueError, match="`n_jobs` must be None"):
            attnflow.flow(a, n_jobs=bad)


@pytest.mark.parametrize("method", ["rollout", "flow", "raw", "gradient_rollout"])
def test_a_meta_tensor_is_refused_by_name_before_work(method: str) -> None:
    torch = pytest.importorskip("torch")
    real = torch.rand(1, 2, 2, 4, 4).softmax(-1)
    meta = torch.empty(1, 2, 2, 4, 4, device="meta")
    if method == "gradient_rollout":
        calls = [((meta, real), "`attentions`"), ((real, meta), "`gradients`")]
        for args, name in calls:
            with pytest.raises(ValueError, match=f"{name} is a PyTorch tensor on the 'meta'"):
                attnflow.gradient_rollout(*args)
        return
    with pytest.raises(ValueError, match="`attentions` is a PyTorch tensor on the 'meta' device"):
        getattr(attnflow, method)(meta)
    meta_mask = torch.ones(1, 4, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="`mask` is a PyTorch tensor on the 'meta' device"):
        getattr(attnflow, method)(real, mask=meta_mask)
