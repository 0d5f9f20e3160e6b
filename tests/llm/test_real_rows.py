"""``rows=-1`` on a padded batch is each sequence's last real token (issue 40, item 1).

A right-padded batch used to explain the padding position ``n - 1`` for the shorter text
(all zeros for rollout, 0.44 away from the text alone). The reference is each text
explained alone, unpadded: on every path of ``explain`` (materialised rollout, raw, flow,
GAE and ALTI; blockwise rollout and GAE), with right and left padding, on a random Llama
built from its config (float64).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnflow.adapters import torch as adapter

LONG = [1, 5, 6, 7, 8, 9]
SHORT = [1, 10, 11]


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
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).double().eval()


def _batch(side: str) -> dict[str, Any]:
    pad = [0] * (len(LONG) - len(SHORT))
    short = [*SHORT, *pad] if side == "right" else [*pad, *SHORT]
    mask = [1] * len(SHORT) + [0] * len(pad)
    mask = mask if side == "right" else mask[::-1]
    return {
        "input_ids": torch.tensor([LONG, short]),
        "attention_mask": torch.tensor([[1] * len(LONG), mask]),
    }


PATHS = [
    ("rollout", False),
    ("raw", False),
    ("flow", False),
    ("gradient_rollout", False),
    ("alti", False),
    ("rollout", True),
    ("gradient_rollout", True),
]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize(("method", "blockwise"), PATHS)
@pytest.mark.parametrize("rows", [-1, [-3, -1]])
def test_negative_rows_count_from_each_sequences_real_end(llama, side, method, blockwise, rows):
    batch = _batch(side)
    got = adapter.explain(llama, batch, rows=rows, method=method, blockwise=blockwise)
    real = batch["attention_mask"][1].bool()
    for index, ids in enumerate((LONG, SHORT)):
        alone = adapter.explain(
            llama, {"input_ids": torch.tensor([ids])}, rows=rows, method=method, blockwise=blockwise
        )[0]
        row = got[index] if index == 0 else got[index][..., real]
        torch.testing.assert_close(row, alone, atol=1e-8, rtol=0)
    if method != "raw":  # every method puts weight on the explained row's own tokens
        assert float(got[1][..., real].abs().sum()) > 0.1
    assert float(got[1][..., ~real].abs().max()) == 0.0  # padding gets nothing


def test_a_row_before_the_first_real_token_is_refused(llama):
    with pytest.raises(IndexError, match=r"`rows` -4 counts from the end of the real tokens"):
        adapter.explain(llama, _batch("right"), rows=-4)


def test_per_sequence_targets_follow_their_sequences(llama):
    batch = _batch("right")
    got = adapter.explain(llama, batch, rows=-1, method="gradient_rollout", target=[3, 4])
    alone = adapter.explain(
        llama, {"input_ids": torch.tensor([SHORT])}, rows=-1, method="gradient_rollout", target=4
    )
    torch.testing.assert_close(got[1, : len(SHORT)], alone[0], atol=1e-10, rtol=0)


def test_non_negative_rows_stay_positions(llama):
    batch = _batch("right")
    got = adapter.explain(llama, batch, rows=[0, -1])
    whole = adapter.explain(llama, batch, rows=0)
    torch.testing.assert_close(got[:, 0], whole, atol=0, rtol=0)


def test_head_weights_with_as_many_rows_as_sequences_are_not_split(llama):
    # (layers=2, heads=4) weights in a batch of 2: one set for every sequence.
    weights = torch.tensor([[1.0, 0.0, 2.0, 1.0], [0.5, 0.5, 1.0, 2.0]], dtype=torch.float64)
    got = adapter.explain(llama, _batch("right"), rows=-1, heads=weights)
    alone = adapter.explain(llama, {"input_ids": torch.tensor([SHORT])}, rows=-1, heads=weights)
    torch.testing.assert_close(got[1, : len(SHORT)], alone[0], atol=1e-8, rtol=0)
