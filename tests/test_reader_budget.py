"""One reader budget for every array file attnflow reads (issue 40, items 4 and 5).

Every ``.npz`` reader (``Explanation.load``, ``GenerationExplanation.load``, the command
line's array readers, the evaluation store) reads all the headers first and refuses, before
inflating anything, a file whose members together would not fit: a decompression bomb split
into members each under the per-member limit included. Metadata JSON is parsed with a size
and a depth limit, refused with one line naming the file.
"""

from __future__ import annotations

import json
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from attnflow._arrayio import read_arrays
from attnflow._cli import main
from attnflow.evaluate._store import ChunkStore, EvaluationFolderError
from attnflow.explanation import Explanation
from attnflow.generation import GenerationExplanation

EXIT_USAGE = 2
_MEMBERS = 8
_MEMBER_BYTES = 250 * 2**20  # each under the per-member limit of 256 MiB
_TOKENS = 1024
_ZEROS = bytes(2**20)


def _npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    return buffer.getvalue()


def _write_split_bomb(path: Path, names: list[str], extra: dict[str, np.ndarray]) -> None:
    """An .npz of members of 250 MiB of zeros each (a stream of zeros: ~250 KB each)."""
    rows = _MEMBER_BYTES // (8 * _TOKENS)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, array in extra.items():
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, array)
        for name in names:
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                member.write(_npy_header((rows, _TOKENS)))
                for _ in range(_MEMBER_BYTES // len(_ZEROS)):
                    member.write(_ZEROS)


@pytest.fixture(scope="module")
def split_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 x 250 MiB of float64 zeros in ~2 MB: an Explanation's file as far as its headers go."""
    path = tmp_path_factory.mktemp("bomb") / "split.npz"
    meta = {"tokens": [f"t{i}" for i in range(_TOKENS)], "format": "attnflow-generation"}
    names = [f"scores/m{i}" for i in range(_MEMBERS)]
    _write_split_bomb(path, names, {"meta": np.asarray(json.dumps(meta))})
    assert path.stat().st_size < 4 * 2**20
    return path


@pytest.fixture
def inflations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the arrays whose data is read (every reader goes through read_array)."""
    shapes: list[tuple[int, ...]] = []
    original = np.lib.format.read_array

    def recording(stream, *args, **kwargs):  # type: ignore[no-untyped-def]
        array = original(stream, *args, **kwargs)
        shapes.append(array.shape)
        return array

    monkeypatch.setattr(np.lib.format, "read_array", recording)
    return shapes


def _refused_quickly(call, expected: type[Exception], *needles: str) -> str:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    with pytest.raises(expected) as raised:
        call()
    seconds = time.perf_counter() - start
    message = str(raised.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    assert seconds < 0.5, seconds
    return message


def test_explanation_load_refuses_a_split_bomb_before_inflating(
    split_bomb: Path, inflations: list[tuple[int, ...]]
) -> None:
    _refused_quickly(
        lambda: Explanation.load(split_bomb),
        ValueError,
        str(split_bomb),
        "8 compressed arrays together",
        "decompression bomb",
    )
    # Only the small metadata was read, never a score member.
    assert all(shape == () for shape in inflations), inflations


def test_generation_explanation_load_refuses_a_split_bomb_before_inflating(
    split_bomb: Path, inflations: list[tuple[int, ...]]
) -> None:
    _refused_quickly(
        lambda: GenerationExplanation.load(split_bomb),
        ValueError,
        str(split_bomb),
        "compressed arrays together",
    )
    assert inflations == []


def test_the_evaluation_store_refuses_a_split_bomb_chunk_unread(
    tmp_path: Path, split_bomb: Path, inflations: list[tuple[int, ...]]
) -> None:
    settings = {"what": "a test"}
    chunks = [(0, 2)]
    with ChunkStore(tmp_path, settings, chunks).open() as store:
        store.write(0, {"scores": np.ones((2, 3))})
    chunk = tmp_path / "chunk-000000.npz"
    shutil.copyfile(split_bomb, chunk)  # its members: meta and 8 x 250 MiB of zeros
    inflations.clear()
    start = time.perf_counter()
    with (
        pytest.raises(EvaluationFolderError, match="decompression bomb"),
        ChunkStore(tmp_path, settings, chunks).open(),
    ):
        pass
    assert time.perf_counter() - start < 0.5
    assert inflations == []
    assert chunk.exists()  # refused, not removed: only `force` discards a damaged chunk


def test_a_genuine_multi_member_file_is_still_read(tmp_path: Path) -> None:
    # Random floats compress little: far from a bomb's ratio, read as before.
    rng = np.random.default_rng(0)
    path = tmp_path / "fine.npz"
    arrays = {f"a{i}": rng.random((64, 64)) for i in range(8)}
    np.savez_compressed(path, **arrays)
    read = read_arrays(path)
    assert all(np.array_equal(read[name], arrays[name]) for name in arrays)


def _metadata_file(path: Path, meta_text: str) -> Path:
    np.savez(path, meta=np.asarray(meta_text))
    return path


@pytest.mark.parametrize("reader", [Explanation.load, GenerationExplanation.load])
def test_deeply_nested_metadata_is_refused_naming_the_file(tmp_path: Path, reader) -> None:  # type: ignore[no-untyped-def]
    path = _metadata_file(tmp_path / "deep.npz", "[" * 100_000 + "]" * 100_000)
    _refused_quickly(lambda: reader(path), ValueError, str(path), "100,000 levels deep")


@pytest.mark.parametrize("reader", [Explanation.load, GenerationExplanation.load])
def test_a_fifty_million_character_prompt_is_refused_from_its_header(  # type: ignore[no-untyped-def]
    tmp_path: Path, reader, inflations: list[tuple[int, ...]]
) -> None:
    # Written by hand (header + zeros): the member declares a 50-million-character string.
    path = tmp_path / "long.npz"
    with (
        zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive,
        archive.open("meta.npy", "w", force_zip64=True) as member,
    ):
        member.write(_npy_header((), "<U50000000"))
        for _ in range(200):
            member.write(_ZEROS)
    _refused_quickly(lambda: reader(path), ValueError, str(path), "meta")
    assert inflations == []


def test_the_evaluation_manifest_is_read_with_the_same_limits(tmp_path: Path) -> None:
    settings = {"what": "a test"}
    (tmp_path / "evaluation.json").write_text("[" * 100_000 + "]" * 100_000)
    with (
        pytest.raises(EvaluationFolderError, match="100,000 levels deep"),
        ChunkStore(tmp_path, settings, [(0, 1)]).open(),
    ):
        pass


def test_the_cli_refuses_a_split_bomb_before_inflating(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    inflations: list[tuple[int, ...]],
) -> None:
    # `evaluate FILE`: attentions (N, 1, 1, 2, 2) and two references (N, 2), consistent
    # shapes, each member under 256 MiB, 500 MiB together from ~0.5 MB.
    monkeypatch.chdir(tmp_path)
    samples = _MEMBER_BYTES // (8 * 4)
    members = {
        "attentions": (samples, 1, 1, 2, 2),
        "blank_out": (samples, 2),
        "input_gradients": (samples, 2),
    }
    with zipfile.ZipFile("saved.npz", "w", compression=zipfile.ZIP_DEFLATED) as a:
        for name, shape in members.items():
            with a.open(f"{name}.npy", "w", force_zip64=True) as member:
                member.write(_npy_header(shape))
                size = 8 * int(np.prod(shape))
                for _ in range(size // len(_ZEROS)):
                    member.write(_ZEROS)
                member.write(bytes(size % len(_ZEROS)))
    start = time.perf_counter()
    assert main(["evaluate", "saved.npz", "-o", "run", "--quiet"]) == EXIT_USAGE
    assert time.perf_counter() - start < 1.0
    err = capsys.readouterr().err.strip()
    assert "saved.npz" in err
    assert "decompression bomb" in err
    assert inflations == []
