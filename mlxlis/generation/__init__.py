"""THE generation core and what drives it: per-request state and one step (core.py) that the
one-shot `generate`, ChatSession, the chat app and the server's batched Engine all use; the
Steps seam to whatever runs the network (steps.py: this process, or a pipeline's leader); the
logits processors and samplers (processors.py, sampling.py), stop strings, the context check
and the Event / Usage every surface consumes. Knows nothing of mlx.launch or of any surface:
imports the models, cache and lower layers."""
