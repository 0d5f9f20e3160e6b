"""The value-aware faithfulness table: methods per matrix kind, refusals, the table."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="the experiments need PyTorch")

import attnflow
from attnflow.evaluate import FaithfulnessReport
from attnflow_lab.value_aware import (
    MATRICES,
    evaluate_value_aware,
    matrix_methods,
    value_aware_markdown,
)


def test_methods_compose_each_matrix_kind_as_documented() -> None:
    rng = np.random.default_rng(0)
    matrices = rng.random((3, 5, 5))  # rows not normalised, as norm and GlobEnc give
    rows = matrices / matrices.sum(-1, keepdims=True)
    eye = np.eye(5)
    for kind, residual in (("norm", 0.5), ("globenc", 0.0), ("alti", 0.0)):
        methods = matrix_methods(kind)
        expected = eye
        for layer in rows:  # the oracle: renormalise, mix with the identity, compose
            mixed = residual * eye + (1 - residual) * layer
            expected = mixed @ expected
        renormalized = "rollout_renormalized" if kind == "globenc" else "rollout"
        got = methods[renormalized](matrices[None], heads=None)[0]
        np.testing.assert_allclose(got, expected, rtol=1e-12)
        np.testing.assert_allclose(methods["raw"](matrices, heads=None), matrices[-1])
    # GlobEnc as its authors aggregate it: the raw matrices multiplied, C_3 C_2 C_1.
    authors = matrices[2] @ matrices[1] @ matrices[0]
    got = matrix_methods("globenc")["rollout"](matrices[None], heads=None)[0]
    np.testing.assert_allclose(got, authors, rtol=1e-12)
    assert not np.allclose(authors / authors.sum(-1, keepdims=True), expected)
    assert set(matrix_methods("attention")) == {"raw", "rollout", "flow", "gradient_rollout"}
    assert matrix_methods("attention")["gradient_rollout"] is attnflow.gradient_rollout


def test_bad_task_and_matrix_are_refused_before_work(tmp_path) -> None:
    with pytest.raises(ValueError, match="`task` must be"):
        evaluate_value_aware(tmp_path, task="sst2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`matrices` must be some of"):
        evaluate_value_aware(tmp_path, task="agreement", matrices=("values",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`matrix` must be one of"):
        matrix_methods("values")  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())


def test_table_reads_the_last_layer_of_every_report() -> None:
    correlation = np.array([[0.1, 0.3], [0.3, 0.7]])  # 2 samples, 2 layers
    erasure = np.array([[[0.2, 0.4], [0.6, 0.8]], [[0.0, 0.2], [0.4, 0.6]]])
    samples = {
        "correlation.flow.blank_out": correlation,
        "correlation.flow.input_gradients": -correlation,
        "comprehensiveness.flow": erasure,
        "sufficiency.flow": erasure / 2,
    }
    report = FaithfulnessReport(
        samples,
        ("flow",),
        ("blank_out", "input_gradients"),
        "spearman",
        "drop",
        0,
        fractions=(0.1, 0.5),
    )
    table = value_aware_markdown({"attention": report, "globenc": report})
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].split("|")[1].strip() == "flow"
    assert lines[3].split("|")[1].strip() == "GlobEnc flow"
    cells = [cell.strip() for cell in lines[3].split("|")[2:6]]
    # layer 2: rho 0.3 and 0.7 (mean 0.5, sd 0.2); AOPC per sample 0.7 and 0.5
    assert cells == ["0.50 ± 0.20", "-0.50 ± 0.20", "0.60 ± 0.10", "0.30 ± 0.05"]
    assert MATRICES == ("attention", "norm", "globenc", "alti")
