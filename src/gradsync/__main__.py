"""``python -m gradsync``: the ``gradsync`` command line."""

from ._cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
