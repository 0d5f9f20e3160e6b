"""Measure how faithful an explanation is: the paper's protocol and the field's metrics.

Abnar & Zuidema (2020) judge raw attention, rollout and flow by their rank correlation with
two independent importance scores of the input tokens, blank-out and input gradients
(Tables 1-3). This package computes those scores and correlations, the standard erasure
metrics (ERASER comprehensiveness and sufficiency with AOPC, deletion and insertion curves
for images), and runs all of it over whole datasets. Models are plain callables, so the
package imports no deep-learning framework; for PyTorch models
:func:`attnflow.adapters.torch.model_functions` builds the callables (for JAX and Keras,
write the two or three small functions described in :func:`faithfulness`). For causal LMs,
prompts with a known source token (copying, key-value retrieval, stated facts,
subject-verb agreement, indirect-object identification) give ground truth:
:func:`ground_truth` reports how often each method ranks the source first.
"""

from __future__ import annotations

from ._blank_out import blank_out
from ._correlation import rank_correlation
from ._erasure import (
    ERASER_FRACTIONS,
    PerturbationCurve,
    comprehensiveness,
    deletion,
    insertion,
    sufficiency,
)
from ._faithfulness import ModelFunctions, faithfulness, faithfulness_from_outputs
from ._llm_ground_truth import GROUND_TRUTH_TASKS, ground_truth
from ._llm_report import GroundTruthReport
from ._report import FaithfulnessReport
from ._store import EvaluationFolderError

__all__ = [
    "ERASER_FRACTIONS",
    "GROUND_TRUTH_TASKS",
    "EvaluationFolderError",
    "FaithfulnessReport",
    "GroundTruthReport",
    "ModelFunctions",
    "PerturbationCurve",
    "blank_out",
    "comprehensiveness",
    "deletion",
    "faithfulness",
    "faithfulness_from_outputs",
    "ground_truth",
    "insertion",
    "rank_correlation",
    "sufficiency",
]
