"""The option types of the lab's studies (their values are checked by attnflow)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeAlias

__all__ = ["ContributionMethod", "LastToken", "Method", "RankCorrelation"]

ContributionMethod: TypeAlias = Literal["norm", "globenc", "alti"]
"""A value-aware token-mixing matrix of ``capture(model, contributions=...)``."""
LastToken: TypeAlias = Literal["blank", "zero"]
"""``faithfulness(blank_out_last_token=...)``."""
RankCorrelation: TypeAlias = Literal["spearman", "kendall", "spearman_dense"]
"""``faithfulness(correlation=...)``."""
Method: TypeAlias = Callable[..., Any]
"""A method of an evaluation: a function with :func:`attnflow.rollout`'s signature."""
