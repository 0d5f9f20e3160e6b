"""Data that ships with attnflow: the embedded sample used by ``attnflow demo``."""

__all__: list[str] = []
