"""mlxlis: open a GGUF or safetensors model, run exactly that model on MLX.

Public API: load, load_tokenizer, generate, ChatSession, SamplingParams, errors. Importing
mlxlis chooses the BLAS MLX's Linux CPU backend calls (it must happen before mlx.core loads);
nothing else process-wide changes until an application calls `mlxlis.device.setup_process()`.
"""

from .blas import preload as _preload_blas

_preload_blas()  # must run before anything imports mlx.core (see blas.py)

from . import errors  # noqa: E402
from .errors import MlxlisError  # noqa: E402
from .generate import Event, Stats, generate  # noqa: E402
from .loading import load, load_tokenizer  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = [
    "load",
    "load_tokenizer",
    "generate",
    "Event",
    "Stats",
    "SamplingParams",
    "MlxlisError",
    "errors",
    "ChatSession",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "ChatSession":
        from .chat import ChatSession

        return ChatSession
    raise AttributeError(name)
