"""``python -m attnflow``: the ``attnflow`` command line."""

from attnflow._cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
