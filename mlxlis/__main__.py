"""`python -m mlxlis ...`: the same as the `mlxlis` command."""

from mlxlis.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
