"""Text to token ids and back, exactly as the model's own tokenizer does: tokenizer.json
through `tokenizers`, tokenizer.model through `sentencepiece`, GGUF vocabularies through the
encoders llama.cpp runs (gguf.py), special-token text cut out first (vocab.py), and the
streaming detokenizer that turns each generated id into the text it completes (stream.py).
Imports only the errors and limits."""

from mlxlis.tokenizer.stream import StreamDecoder
from mlxlis.tokenizer.tokenizer import Tokenizer

__all__ = ["StreamDecoder", "Tokenizer"]
