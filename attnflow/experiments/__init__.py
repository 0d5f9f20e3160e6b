"""Experiments that reproduce the paper's analyses on data and models available offline."""

__all__: list[str] = []
