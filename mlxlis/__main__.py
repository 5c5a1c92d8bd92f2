"""`python -m mlxlis ...`: the same as the `mlxlis` command."""

from mlxlis.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
