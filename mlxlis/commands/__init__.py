"""The command line (a surface over the public API): `mlxlis [PROMPT]`, `chat`, `serve`,
`inspect`, `pull` / `models` / `rm`, `convert`, their shared flags (args.py) and the inspect
report's shape (report.py). May import every layer below it."""
