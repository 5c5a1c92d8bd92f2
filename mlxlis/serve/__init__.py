"""`mlxlis serve` (a surface): an OpenAI-compatible HTTP server, its requests prepared into
the generation core's Requests (prepare.py) and the core's Events written back in the API's
shapes (reply.py, openai_format.py), over the one serving Engine (generation/engine.py)."""
