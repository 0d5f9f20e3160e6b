"""Inputs that used to fail deep inside the model get one clear line first (issue 40, item 6).

An empty sequence ("cannot reshape tensor of 0 elements"), token ids beyond the vocabulary
("index out of range in self"), a KV cache in the inputs (a shape error about
"(1, 2, 1, 1, 8)"), flash_attention_2 without its kernels (transformers' ``kernels``
ImportError) and a sequence longer than the model's positions (no error at all) are each
refused before the model runs, on the materialised and the blockwise path, in
``explain_text`` and ``explain_generation``, on a small random Llama built from its config.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnflow.adapters import torch as adapter


@pytest.fixture(scope="module")
def llama() -> Any:
    torch.manual_seed(40)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def untouched(llama, monkeypatch):
    """The model, whose forward fails the test if it runs."""

    def ran(*args: Any, **kwargs: Any) -> None:
        msg = "the model ran before its inputs were checked"
        raise AssertionError(msg)

    monkeypatch.setattr(llama, "forward", ran)
    return llama


class _Tokenizer:
    """A stand-in tokenizer: one id per character, from `offset`."""

    def __init__(self, offset: int = 2) -> None:
        self.offset = offset

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, Any]:
        ids = torch.tensor([[self.offset + ord(c) % 26 for c in text]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _cache(llama: Any) -> Any:
    with torch.no_grad():
        return llama(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=True).past_key_values


BAD_INPUTS = {
    "empty": (lambda m: {"input_ids": torch.ones(1, 0, dtype=torch.long)}, r"holds no token"),
    "empty tensor": (lambda m: torch.ones(1, 0, dtype=torch.long), r"holds no token"),
    "beyond the vocabulary": (
        lambda m: {"input_ids": torch.tensor([[1, 2, 99]])},
        r"token id 99, outside the model's vocabulary of 32 \(ids 0 to 31\)",
    ),
    "negative id": (lambda m: {"input_ids": torch.tensor([[1, -3]])}, r"token id -3, outside"),
    "past_key_values": (
        lambda m: {"input_ids": torch.tensor([[5]]), "past_key_values": _cache(m)},
        r"holds 'past_key_values': explain\(\) runs the whole sequence",
    ),
    "longer than the positions": (
        lambda m: {"input_ids": torch.ones(1, 17, dtype=torch.long)},
        r"17 tokens, more than the model's 16 positions \(max_position_embeddings\)",
    ),
}


@pytest.mark.parametrize("blockwise", [None, False, True])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_refused_before_the_model_runs(llama, monkeypatch, case, blockwise):
    make, message = BAD_INPUTS[case]
    inputs = make(llama)  # built before the model's forward is made to fail
    monkeypatch.setattr(llama, "forward", _fail)
    with pytest.raises(ValueError, match=message):
        adapter.explain(llama, inputs, rows=-1, blockwise=blockwise)


def _fail(*args: Any, **kwargs: Any) -> None:
    msg = "the model ran before its inputs were checked"
    raise AssertionError(msg)


@pytest.mark.parametrize("blockwise", [None, False])
def test_flash_attention_without_its_kernels_is_named(blockwise, monkeypatch):
    from attnflow.adapters import _torch_inputs

    # As on a machine without flash-attn and `kernels` (every CPU CI machine), also where
    # they are installed.
    monkeypatch.setattr(_torch_inputs, "_kernels_installed", lambda probe: False)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=16,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2', whose kernels"):
        adapter.explain(model, {"input_ids": torch.tensor([[1, 2, 3]])}, blockwise=blockwise)


def test_explain_text_refuses_ids_beyond_the_vocabulary(untouched):
    with pytest.raises(ValueError, match=r"outside the model's vocabulary of 32"):
        adapter.explain_text(untouched, _Tokenizer(offset=30), "abc")


def test_explain_text_refuses_a_text_longer_than_the_positions(untouched):
    with pytest.raises(ValueError, match=r"20 tokens, more than the model's 16 positions"):
        adapter.explain_text(untouched, _Tokenizer(), "a" * 20)


def test_explain_generation_refuses_ids_beyond_the_vocabulary(llama, monkeypatch):
    monkeypatch.setattr(llama, "generate", _fail)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary of 32"):
        adapter.explain_generation(
            llama, _Tokenizer(offset=30), "abc", max_new_tokens=2, methods="rollout"
        )


def test_good_inputs_still_run(llama):
    rows = adapter.explain(llama, {"input_ids": torch.tensor([[1, 2, 31]])}, rows=-1)
    assert rows.shape == (1, 3)
    assert torch.isclose(rows.sum(), torch.tensor(1.0, dtype=rows.dtype))


def test_the_kernel_probe_reads_what_is_installed():
    import importlib.util

    from attnflow.adapters import _torch_inputs

    expected = transformers.utils.is_flash_attn_2_available() or (
        importlib.util.find_spec("kernels") is not None
    )
    assert _torch_inputs._kernels_installed("is_flash_attn_2_available") is expected


@pytest.mark.parametrize(("method", "copies"), [("alti", 2), ("alti_logit", 12)])
def test_value_aware_matrices_that_cannot_fit_are_refused_first(
    untouched, monkeypatch, method, copies
):
    """Every layer's n x n matrix is held: refused, naming the size, before the model runs."""
    from attnflow.adapters import _torch_blockwise

    inputs = {"input_ids": torch.ones(1, 8, dtype=torch.long)}
    needed = copies * 4 * 1 * 2 * 8 * 8  # copies x float32 x batch x layers x n x n
    monkeypatch.setattr(_torch_blockwise, "available_bytes", lambda device: needed - 1)
    with pytest.raises(MemoryError, match=rf'method="{method}" holds every layer\'s 8 x 8'):
        adapter.explain(untouched, inputs, method=method, rows=-1)
    monkeypatch.setattr(_torch_blockwise, "available_bytes", lambda device: needed)
    with pytest.raises(AssertionError, match="the model ran"):  # enough memory: it runs
        adapter.explain(untouched, inputs, method=method, rows=-1)
