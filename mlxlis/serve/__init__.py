"""`mlxlis serve` (a surface): an HTTP server speaking the OpenAI, Anthropic, Responses and
Ollama APIs, its requests prepared into the generation core's Requests (prepare.py) and the
core's Events written back in each API's shapes (reply.py, openai_format.py), over one
serving Engine (generation/engine.py) per loaded model: the models a request may name
(listings.py), loaded on demand within memory and unloaded when idle (pool.py)."""
