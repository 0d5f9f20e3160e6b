"""explain_generation (issue 21, item 4): every generated token's row equals its prefix's.

The rollout rows come from a causal rollout cache fed step by step while the model
generates with its KV cache; the reference explains each generated token on its prefix
alone, with no cache and no generation:

- ``attnflow.adapters.torch.explain`` on the prefix (capture, then rollout);
- Hugging Face's own eager ``output_attentions=True`` on the prefix, rolled out by
  ``attnflow.rollout`` / ``attnflow.raw``; for GAE, ``torch.autograd.grad`` of the
  generated token's logit (or log-probability) at the last prefix position by those
  attentions, rolled out by ``attnflow.gradient_rollout``.

On the pretrained SmolLM2 (float32, a short prompt, T = 3) and on a small random Llama in
float64 (GQA, RoPE; sdpa and eager; greedy, sampling and ``use_cache=False``; head
fusions, ``layers``, ``receptive_field`` and ``exclude``). Then the errors, each raised
before the model runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnflow
from attnflow.adapters import torch as adapter
from attnflow.generation import GenerationExplanation


def _reference(
    eager: Any, ids: list[int], n_prompt: int, *, gradients: bool, **options: Any
) -> dict[str, np.ndarray]:
    """Each generated token explained on its prefix alone, from HF's own eager attentions."""
    n_generated = len(ids) - n_prompt
    width = len(ids) - 1
    rollout_options = {k: v for k, v in options.items() if k in ("residual", "heads", "layers")}
    decoder = {k: v for k, v in options.items() if k in ("receptive_field", "exclude")}
    raw_options = {k: v for k, v in options.items() if k in ("heads", "layers")}
    out = {name: np.zeros((n_generated, width)) for name in ("rollout", "raw", "gae")}
    for step in range(n_generated):
        end = n_prompt + step
        prefix = torch.tensor([ids[:end]])
        with torch.enable_grad():
            result = eager(input_ids=prefix, output_attentions=True)
            attentions = torch.stack(result.attentions, dim=1)  # (1, L, H, n, n)
            rollout = attnflow.rollout(attentions.detach(), rows=-1, **rollout_options, **decoder)
            raw = attnflow.raw(attentions.detach(), rows=-1, **raw_options)
            out["rollout"][step, :end] = rollout[0].double().numpy()
            out["raw"][step, :end] = raw[0].double().numpy()
            if gradients:
                at_row = result.logits[0, -1]
                if options.get("target_score") == "log_probability":
                    at_row = torch.log_softmax(at_row, dim=-1)
                grads = torch.autograd.grad(at_row[ids[end]], result.attentions)
                gae = attnflow.gradient_rollout(
                    attentions.detach(),
                    torch.stack(grads, dim=1),
                    rows=-1,
                    **{k: v for k, v in options.items() if k in ("residual", "layers")},
                    **decoder,
                )
                out["gae"][step, :end] = gae[0].double().numpy()
    return out


def _check_structure(explained: GenerationExplanation, n_prompt: int, n_generated: int) -> None:
    width = n_prompt + n_generated - 1
    assert explained.prompt_length == n_prompt
    assert len(explained.tokens) == n_prompt + n_generated
    for values in explained.scores.values():
        assert values.shape == (n_generated, width)
        for step in range(n_generated):
            assert not values[step, n_prompt + step :].any()  # zero beyond the prefix


# -- SmolLM2 -------------------------------------------------------------------------------
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol_explained(smollm2):
    models, tokenizer = smollm2
    return explain_smol(models["sdpa"], tokenizer)


def explain_smol(model: Any, tokenizer: Any, **options: Any) -> GenerationExplanation:
    return adapter.explain_generation(
        model,
        tokenizer,
        PROMPT,
        max_new_tokens=3,
        methods=options.pop("methods", ("rollout", "gradient_rollout", "raw")),
        exclude_self=options.pop("exclude_self", False),  # explain's rows, as they are
        **options,
    )


def test_smollm2_generates_what_generate_does(smollm2, smol_explained):
    models, tokenizer = smollm2
    encoded = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        plain = models["sdpa"].generate(**encoded, max_new_tokens=3, do_sample=False)
    n_prompt = encoded["input_ids"].shape[1]
    assert smol_explained.generated_ids.tolist() == plain[0, n_prompt:].tolist()
    assert smol_explained.generated_text.startswith(" Paris")
    assert smol_explained.prompt == PROMPT
    _check_structure(smol_explained, n_prompt, 3)


def test_smollm2_rows_equal_explain_on_each_prefix(smollm2, smol_explained):
    models, _ = smollm2
    ids = [*smol_explained.prompt_ids.tolist(), *smol_explained.generated_ids.tolist()]
    n_prompt = smol_explained.prompt_length
    reference = _reference(models["eager"], ids, n_prompt, gradients=True)
    for step in range(3):
        end = n_prompt + step
        prefix = torch.tensor([ids[:end]])
        expected = adapter.explain(models["sdpa"], {"input_ids": prefix}, rows=-1)[0]
        got = smol_explained.scores["rollout"][step, :end]
        np.testing.assert_allclose(got, expected.double().numpy(), rtol=0, atol=2e-5)
    np.testing.assert_allclose(smol_explained.scores["rollout"], reference["rollout"], atol=2e-5)
    np.testing.assert_allclose(smol_explained.scores["raw"], reference["raw"], atol=2e-5)
    gae = smol_explained.scores["gradient_rollout"]
    np.testing.assert_allclose(gae, reference["gae"], rtol=1e-4, atol=1e-4 * np.abs(gae).max())
    assert (gae[:, 0] > 0).all()  # not all zero: the rows carry relevance


def test_smollm2_receptive_field_and_sink_per_row(smollm2):
    models, tokenizer = smollm2
    explained = explain_smol(
        models["sdpa"], tokenizer, methods="rollout", receptive_field=True, exclude=0
    )
    ids = [*explained.prompt_ids.tolist(), *explained.generated_ids.tolist()]
    reference = _reference(
        models["eager"],
        ids,
        explained.prompt_length,
        gradients=False,
        receptive_field=True,
        exclude=0,
    )
    np.testing.assert_allclose(explained.scores["rollout"], reference["rollout"], atol=2e-5)
    assert not explained.scores["rollout"][:, 0].any()
    np.testing.assert_allclose(explained.scores["rollout"].sum(axis=1), 1.0, atol=1e-5)


# -- a small random Llama in float64 ---------------------------------------------------------
class _Tokenizer:
    """A stand-in for a Hugging Face tokenizer over ids 0..31 (1 is BOS)."""

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, Any]:
        ids = torch.tensor([[1, *(2 + ord(c) % 30 for c in text)]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]

    def get_special_tokens_mask(
        self, ids: list[int], already_has_special_tokens: bool
    ) -> list[int]:
        assert already_has_special_tokens
        return [int(i == 1) for i in ids]

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    torch.manual_seed(21)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=1,
        pad_token_id=0,
    )
    sdpa = transformers.LlamaForCausalLM(config).double().eval()
    eager = transformers.LlamaForCausalLM(config).double().eval()
    eager.load_state_dict(sdpa.state_dict())
    eager.set_attn_implementation("eager")
    return {"sdpa": sdpa, "eager": eager}


CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "eager": {"implementation": "eager"},
    "sampling": {"generate_kwargs": {"do_sample": True, "top_k": 8}, "seed": 3},
    "no KV cache": {"generate_kwargs": {"do_sample": False, "use_cache": False}},
    "heads=max,layers=1": {"heads": "max", "layers": 1},
    "heads=weights": {"heads": [[1.0, 2.0, 0.0, 1.0]] * 3, "residual": 0.3},
    "receptive_field,exclude": {"receptive_field": True, "exclude": [0, 2]},
    "log-probability": {"target_score": "log_probability", "residual": 0.3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_llama_rows_equal_each_prefix(llama, case):
    options = dict(CASES[case])
    model = llama[options.pop("implementation", "sdpa")]
    seed = options.pop("seed", 0)
    generate_kwargs = options.pop("generate_kwargs", None)
    methods = ["rollout", "raw"]
    if "heads" not in options:  # heads is for rollout and raw, not for gradient rollout
        methods.append("gradient_rollout")
    if "receptive_field" in options:
        methods.remove("raw")
    torch.manual_seed(seed)
    explained = adapter.explain_generation(
        model,
        _Tokenizer(),
        "abcd",
        max_new_tokens=5,
        methods=methods,
        generate_kwargs=generate_kwargs,
        exclude_self=False,  # explain's rows on each prefix, as they are
        **options,
    )
    n_prompt = 5
    _check_structure(explained, n_prompt, 5)
    ids = [*explained.prompt_ids.tolist(), *explained.generated_ids.tolist()]
    if generate_kwargs is not None and generate_kwargs.get("do_sample"):
        torch.manual_seed(seed)  # the same draw without attnflow
        encoded = _Tokenizer()("abcd")
        with torch.no_grad():
            plain = model.generate(**encoded, max_new_tokens=5, **generate_kwargs)
        assert plain[0].tolist() == ids
    reference = _reference(
        llama["eager"], ids, n_prompt, gradients="gradient_rollout" in methods, **options
    )
    # GAE goes through a backward pass: eager and SDPA order their sums differently, and
    # the gradients carry that rounding (about 1e-10 here) into the rows.
    checks = (
        ("rollout", "rollout", 1e-10),
        ("raw", "raw", 1e-10),
        ("gradient_rollout", "gae", 1e-8),
    )
    for method, key, tol in checks:
        if method in methods:
            np.testing.assert_allclose(explained.scores[method], reference[key], rtol=0, atol=tol)
    assert explained.special.tolist() == [True] + [False] * 9  # BOS


def test_half_precision_model_rolls_out_in_float32(llama):
    model = llama["sdpa"]
    full = adapter.explain_generation(
        model, _Tokenizer(), "abcd", max_new_tokens=4, methods="rollout"
    )
    half = adapter.explain_generation(
        model.to(torch.bfloat16),
        _Tokenizer(),
        "abcd",
        max_new_tokens=4,
        methods="rollout",
        generate_kwargs={"do_sample": False, "min_new_tokens": 4},
    )
    model.to(torch.float64)
    # bfloat16 rows are checked against bfloat16's rounding, not float32's, and rolled
    # out in float32: within bfloat16's error of the float64 model's rows.
    assert half.generated_ids.tolist() == full.generated_ids.tolist()
    np.testing.assert_allclose(half.scores["rollout"], full.scores["rollout"], atol=3e-2)


# -- errors, each before the model runs ----------------------------------------------------
@pytest.fixture
def untouched(llama, monkeypatch):
    """The sdpa model, whose generate and forward fail the test if called."""
    model = llama["sdpa"]

    def ran(*args: Any, **kwargs: Any) -> None:
        msg = "the model ran before the arguments were checked"
        raise AssertionError(msg)

    monkeypatch.setattr(model, "generate", ran)
    monkeypatch.setattr(model, "forward", ran)
    return model


ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"max_new_tokens": 0}, ValueError, r"`max_new_tokens` must be >= 1"),
    ({"max_new_tokens": 2.0}, TypeError, r"`max_new_tokens` must be an int >= 1"),
    ({"methods": ("rollout", "flow")}, ValueError, r"`methods` must name some of"),
    ({"methods": ()}, ValueError, r"`methods` must name some of"),
    ({"methods": ("raw", "raw")}, ValueError, r"each once"),
    ({"rows": 0}, ValueError, r"does not take `rows`: each generated token is explained"),
    ({"threshold": 0.1}, ValueError, r"does not take `threshold`: pruning"),
    ({"discard": 0.1}, ValueError, r"a row would change as tokens arrive"),
    ({"target": 3}, ValueError, r"its own id"),
    ({"target_score": "probability"}, ValueError, r'`target_score` must be "logit"'),
    (
        {"methods": "rollout", "target_score": "log_probability"},
        ValueError,
        r"`target_score` applies to \['gradient_rollout'\]",
    ),
    ({"colour": "red"}, TypeError, r"unknown option `colour`; the options are"),
    (
        {"methods": "rollout", "rule": "gae"},
        ValueError,
        r"`rule` applies to \['gradient_rollout'\]",
    ),
    ({"heads": "each"}, ValueError, r"not one row per generated token"),
    ({"layers": "all"}, ValueError, r"`layers` must be 'last' or an int"),
    ({"layers": 3}, IndexError, r"the model's 3 layers"),
    ({"residual": 1.5}, ValueError, r"`residual` must be in \[0, 1\]"),
    ({"heads": [1.0, 2.0]}, ValueError, r"weights must have shape \(4,\) or \(3, 4\)"),
    ({"validate": "yes"}, TypeError, r"`validate` must be True"),
    ({"exclude_self": 1}, TypeError, r"`exclude_self` must be True or False"),
    ({"exclude": -1}, ValueError, r"non-negative positions .* a different token in each row"),
    ({"exclude": 9}, IndexError, r"0 to 8 for this prompt and max_new_tokens"),
    ({"generate_kwargs": {"num_beams": 2}}, ValueError, r"num_beams=2: .* follows one sequence"),
    ({"generate_kwargs": {"max_length": 9}}, ValueError, r"must not set 'max_length'"),
    ({"generate_kwargs": [("do_sample", True)]}, TypeError, r"`generate_kwargs` must be None"),
    (
        {"generate_kwargs": {"prompt_lookup_num_tokens": 2}},
        ValueError,
        r"assisted decoding",
    ),
    # Issue 40: what cannot fit is refused before any work ("abcd" is 5 tokens of 64).
    ({"max_new_tokens": 10**18}, ValueError, r"`max_new_tokens` must be at most 59 .* got 10+\."),
    ({"max_new_tokens": 60}, ValueError, r"`max_new_tokens` must be at most 59"),
    (
        {"generate_kwargs": {"stop_strings": [3]}},
        TypeError,
        r"stop_strings'\]` must be a non-empty",
    ),
    ({"generate_kwargs": {"stop_strings": ""}}, TypeError, r"stop_strings'\]` must be a non-empty"),
]


@pytest.mark.parametrize(("options", "error", "message"), ERRORS)
def test_errors_before_any_work(untouched, options, error, message):
    settings = {"max_new_tokens": 5, **options}
    with pytest.raises(error, match=message):
        adapter.explain_generation(untouched, _Tokenizer(), "abcd", **settings)


def test_the_models_own_beam_search_is_refused(untouched, monkeypatch):
    monkeypatch.setattr(untouched.generation_config, "num_beams", 2)
    with pytest.raises(ValueError, match=r"num_beams=2: .* follows one sequence"):
        adapter.explain_generation(
            untouched, _Tokenizer(), "abcd", max_new_tokens=2, generate_kwargs={}
        )


def test_prompt_errors(untouched):
    with pytest.raises(TypeError, match=r"`prompt` must be a str or an encoded prompt"):
        adapter.explain_generation(untouched, _Tokenizer(), 3, max_new_tokens=2)
    two = {"input_ids": torch.ones(2, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"one sequence: input_ids of shape \(1, P\)"):
        adapter.explain_generation(untouched, _Tokenizer(), two, max_new_tokens=2)
    padded = {
        "input_ids": torch.ones(1, 3, dtype=torch.long),
        "attention_mask": torch.tensor([[0, 1, 1]]),
    }
    with pytest.raises(ValueError, match=r"`prompt` has padding"):
        adapter.explain_generation(untouched, _Tokenizer(), padded, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"expects a torch.nn.Module"):
        adapter.explain_generation("gpt2", _Tokenizer(), "abcd", max_new_tokens=2)


def test_gradient_rollout_needs_autograd(llama):
    model = llama["sdpa"]
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"needs autograd"):
        adapter.explain_generation(model, _Tokenizer(), "abcd", max_new_tokens=2)
    model.requires_grad_(False)
    try:
        with pytest.raises(RuntimeError, match=r"every parameter of the model is frozen"):
            adapter.explain_generation(model, _Tokenizer(), "abcd", max_new_tokens=2)
    finally:
        model.requires_grad_(True)


def test_encoded_prompt_equals_text_prompt(llama):
    tokenizer = _Tokenizer()
    by_text = adapter.explain_generation(
        llama["sdpa"], tokenizer, "abcd", max_new_tokens=3, methods="rollout"
    )
    by_ids = adapter.explain_generation(
        llama["sdpa"], tokenizer, tokenizer("abcd"), max_new_tokens=3, methods="rollout"
    )
    np.testing.assert_array_equal(by_ids.scores["rollout"], by_text.scores["rollout"])
    assert by_ids.prompt == "<1><9><10><11><12>"  # decoded from the ids


# -- issue 40: generation options a careless user gives ---------------------------------------
def test_a_prompt_longer_than_the_models_positions_is_refused_before_work(untouched):
    with pytest.raises(ValueError, match=r"`prompt` has 71 tokens, as many as the model's 64"):
        adapter.explain_generation(untouched, _Tokenizer(), "a" * 70, max_new_tokens=1)


def test_a_huge_max_new_tokens_is_refused_from_memory_without_a_position_limit(
    untouched, monkeypatch
):
    # A model whose positions are (nearly) unbounded: the rollout cache's size decides.
    monkeypatch.setattr(untouched.config, "max_position_embeddings", 2**62)
    with pytest.raises(ValueError, match=r"could need a rollout cache of .* GiB"):
        adapter.explain_generation(
            untouched, _Tokenizer(), "abcd", max_new_tokens=10**18, methods="rollout"
        )


def test_stop_strings_stop_where_the_text_first_holds_one(llama):
    # The stand-in tokenizer has no vocabulary for transformers' StopStringCriteria: the
    # generated text is decoded after each step instead.
    model, tokenizer = llama["sdpa"], _Tokenizer()
    full = adapter.explain_generation(model, tokenizer, "abcd", max_new_tokens=8, methods="rollout")
    generated = full.generated_ids.tolist()
    stop = tokenizer.decode([generated[3]])
    # The reference: the first prefix of the unstopped generation whose text holds it.
    end = next(j for j in range(1, 9) if stop in tokenizer.decode(generated[:j]))
    stopped = adapter.explain_generation(
        model,
        tokenizer,
        "abcd",
        max_new_tokens=8,
        methods="rollout",
        generate_kwargs={"stop_strings": [stop], "do_sample": False},
    )
    assert stopped.generated_ids.tolist() == generated[:end]
    width = stopped.scores["rollout"].shape[1]
    np.testing.assert_array_equal(stopped.scores["rollout"], full.scores["rollout"][:end, :width])


def test_stop_strings_work_with_a_real_tokenizer(smollm2):
    # transformers needs the tokenizer handed to generate for stop strings.
    models, tokenizer = smollm2
    kwargs = {"max_new_tokens": 12, "methods": "rollout"}
    full = adapter.explain_generation(
        models["sdpa"], tokenizer, "The capital of France is", **kwargs
    )
    assert "." in full.generated_text  # " Paris. ..." (greedy)
    stopped = adapter.explain_generation(
        models["sdpa"],
        tokenizer,
        "The capital of France is",
        generate_kwargs={"stop_strings": ["."]},
        **kwargs,
    )
    assert stopped.generated_text.endswith(".")
    assert full.generated_text.startswith(stopped.generated_text)
    assert stopped.generated_text.count(".") == 1
