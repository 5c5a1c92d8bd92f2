"""mlxlis: open a GGUF or safetensors model, run exactly that model on MLX.

Public API: load, load_tokenizer, generate, ChatSession, SamplingParams, Model, Event, Usage
(also named Stats), errors. Importing mlxlis chooses the BLAS MLX's Linux CPU backend calls (it
must happen before mlx.core loads); nothing else process-wide changes until an application
calls `mlxlis.runtime.device.setup_process()`.

The package is layered, bottom up: errors/limits, runtime, tokenizer, prompt, loading, cache,
models, generation, distributed, then the public API's assembly (api.py, this module) and the
surfaces (commands, serve; the chat app is the `tui` package). A layer imports only layers
below it (tests/test_structure.py checks every import, those inside functions too).
"""

from mlxlis.runtime.blas import preload as _preload_blas

_preload_blas()  # must run before anything imports mlx.core (see runtime/blas.py)

from mlxlis import errors  # noqa: E402
from mlxlis.api import load, load_tokenizer  # noqa: E402
from mlxlis.errors import MlxlisError  # noqa: E402
from mlxlis.generation.events import Event, Stats, Usage  # noqa: E402
from mlxlis.generation.generate import generate  # noqa: E402
from mlxlis.generation.sampling import SamplingParams  # noqa: E402
from mlxlis.generation.session import ChatSession  # noqa: E402
from mlxlis.models.model import Model  # noqa: E402
from mlxlis.models.multimodal import Prompt, PromptImage  # noqa: E402

__all__ = [
    "load",
    "load_tokenizer",
    "generate",
    "ChatSession",
    "Event",
    "Stats",
    "Usage",
    "SamplingParams",
    "Model",
    "Prompt",
    "PromptImage",
    "MlxlisError",
    "errors",
]
__version__ = "0.1.0"
