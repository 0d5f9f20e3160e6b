"""``python -m attnflow``: the ``attnflow`` command line."""

from attnflow._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
