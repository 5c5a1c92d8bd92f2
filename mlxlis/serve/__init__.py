"""`mlxlis serve`: an OpenAI-compatible HTTP server over the serving engine (engine.py)."""
