"""mlxlis: open a GGUF or safetensors model, run exactly that model on MLX.

Public API: load, generate, ChatSession, errors.
"""

from .device import preload_blas as _preload_blas
from .device import tune_malloc as _tune_malloc

_preload_blas()  # must run before anything imports mlx.core (see device.py)
_tune_malloc()

from . import errors  # noqa: E402
from .errors import MlxlisError  # noqa: E402
from .generate import Event, Stats, generate  # noqa: E402
from .loading import load  # noqa: E402

__all__ = ["load", "generate", "Event", "Stats", "MlxlisError", "errors", "ChatSession"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "ChatSession":
        from .chat import ChatSession

        return ChatSession
    raise AttributeError(name)
