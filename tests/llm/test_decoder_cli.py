"""``attnflow explain`` on a causal LM (issue 39, item 3): --target WORD, --chat, --blockwise,
--generate N, --spans; each checked against the library call it stands for, on SmolLM2.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from attnflow.adapters import torch as adapter
from attnflow.explanation import Explanation
from attnflow.generation import GenerationExplanation

TEXT = "The Eiffel Tower is in the city of"


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from llm_models import smollm2_folder

    from attnflow._cli import main

    code = main(["explain", "--model", str(smollm2_folder()), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_target_is_a_word_of_one_token(smollm2, tmp_path, capsys):
    models, tokenizer = smollm2
    saved = tmp_path / "paris.npz"
    code, out, err = _main(
        capsys, TEXT, "--method", "gradient_rollout", "--target", " Paris", "--save", str(saved)
    )
    assert code == 0, err
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    assert f"target {paris[0]} (' Paris')" in out.splitlines()[0]
    e = Explanation.load(saved)
    expected = adapter.explain(
        models["sdpa"],
        dict(tokenizer(TEXT, return_tensors="pt")),
        method="gradient_rollout",
        rows=-1,
        target=paris[0],
        layers="all",
        exclude_self=True,
    )
    np.testing.assert_allclose(e.scores["gradient_rollout"], expected[0].numpy(), atol=1e-6)


def test_a_target_of_several_tokens_is_refused_with_the_pieces(smollm2, capsys):
    code, _, err = _main(capsys, TEXT, "--target", "Parisians")
    assert code == 2
    assert "--target 'Parisians' is 2 tokens ('Paris', 'ians'), not one" in err


def test_chat_uses_the_template_and_generate_explains_each_token(smollm2, tmp_path, capsys):
    models, tokenizer = smollm2
    saved, page = tmp_path / "chat.npz", tmp_path / "chat.html"
    code, out, err = _main(
        capsys,
        "What is the capital of France?",
        "--chat",
        "--generate",
        "2",
        "--method",
        "rollout",
        "--save",
        str(saved),
        "-o",
        str(page),
    )
    assert code == 0, err
    g = GenerationExplanation.load(saved)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    expected_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert g.prompt_ids.tolist() == expected_ids
    reference = adapter.explain_generation(
        models["sdpa"],
        tokenizer,
        {"input_ids": torch.tensor([expected_ids])},
        max_new_tokens=2,
        methods="rollout",
    )
    assert g.generated_ids.tolist() == reference.generated_ids.tolist()
    np.testing.assert_allclose(g.scores["rollout"], reference.scores["rollout"], atol=1e-6)
    assert g.self_excluded
    assert "predicted at position" in out
    assert "Attention sinks left out" in page.read_text(encoding="utf-8")


def test_blockwise_rows_equal_the_captured_ones(smollm2, tmp_path, capsys):
    saved = tmp_path / "block.npz"
    code, _, err = _main(capsys, TEXT, "--blockwise", "--save", str(saved))
    assert code == 0, err
    blockwise = Explanation.load(saved)
    captured = adapter.explain_text(
        smollm2[0]["sdpa"],
        smollm2[1],
        TEXT,
        methods=["direct_logit", "gradient_rollout", "rollout"],
    )
    assert list(blockwise.scores) == ["direct_logit", "gradient_rollout", "rollout"]
    for method in blockwise.scores:
        reference = captured.scores[method]
        np.testing.assert_allclose(
            blockwise.scores[method], reference, rtol=0, atol=1e-4 * np.abs(reference).max()
        )
    assert blockwise.predicted == captured.predicted


def test_spans_show_words(smollm2, capsys):
    code, out, err = _main(capsys, TEXT, "--method", "gradient_rollout", "--spans", "words")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[4:12]] == TEXT.split()
    assert "sinks, explained" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--generate", "0"], "--generate must be >= 1"),
        (["--generate", "2", "--rows", "1"], "drop --rows"),
        (
            ["--generate", "2", "--method", "flow"],
            "--generate computes direct_logit, alti_logit, ifr, gradient_rollout",
        ),
        (
            ["--blockwise", "--method", "raw"],
            "--blockwise computes direct_logit, ifr, gradient_rollout, rollout",
        ),
        (["--blockwise", "--heads", "max"], "drop --heads"),
    ],
)
def test_bad_combinations_are_refused_before_loading(
    argv: list[str], message: str, capsys: Any, monkeypatch: Any
):
    from attnflow._cli import main

    code = main(["explain", "--model", "/nonexistent", TEXT, *argv])
    assert code == 2
    assert message in capsys.readouterr().err
