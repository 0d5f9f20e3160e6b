"""attnflow: attention rollout and attention flow for any array library.

Follow a transformer's attention across its layers to attribute each output position to
the input tokens (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers").
The maths is written once against the array API standard: NumPy, PyTorch, JAX, Dask,
CuPy and array-api-strict arrays (and TensorFlow tensors, converted at the boundary) come
back in their own library, dtype and device.

Importing attnflow imports no deep-learning framework and no plotting library.
"""

from __future__ import annotations

from . import evaluate
from ._contributions import attention_terms, contributions, head_values
from ._deprecation import warn_renamed as _warn_renamed
from ._encoder_decoder import EncoderDecoderAttribution, encoder_decoder_rollout
from ._encoder_decoder_flow import encoder_decoder_flow
from ._flow import FlowCost, flow, flow_cost
from ._gradient_rollout import gradient_rollout
from ._heads import fuse_heads
from ._lost_workers import WorkersLostError
from ._residual import add_residual
from ._rollout import raw, rollout

__all__ = [
    "EncoderDecoderAttribution",
    "FlowCost",
    "WorkersLostError",
    "__version__",
    "add_residual",
    "attention_terms",
    "contributions",
    "encoder_decoder_flow",
    "encoder_decoder_rollout",
    "flow",
    "flow_cost",
    "fuse_heads",
    "gradient_rollout",
    "head_values",
    "raw",
    "rollout",
]

__version__ = "0.1.0.dev0"

# The evaluation's names lived here too before 0.1; they are attnflow.evaluate's now, and
# the old spelling keeps working for one release, with a DeprecationWarning.
_MOVED_TO_EVALUATE = frozenset(
    {
        "FaithfulnessReport",
        "ModelFunctions",
        "PerturbationCurve",
        "blank_out",
        "comprehensiveness",
        "deletion",
        "faithfulness",
        "insertion",
        "rank_correlation",
        "sufficiency",
    }
)


def __getattr__(name: str) -> object:
    if name in _MOVED_TO_EVALUATE:
        _warn_renamed(f"attnflow.{name}", f"attnflow.evaluate.{name}", stacklevel=3)
        return getattr(evaluate, name)
    msg = f"module 'attnflow' has no attribute {name!r}"
    raise AttributeError(msg)
