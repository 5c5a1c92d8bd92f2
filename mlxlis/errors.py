"""One error hierarchy: every bad input ends in a subclass of MlxlisError.

Messages name the file and the tensor / field at fault, so the CLI can print one line.
"""

from __future__ import annotations

from pathlib import Path


class MlxlisError(Exception):
    """Base of every error mlxlis raises for bad input or unsupported content."""

    def __init__(self, message: str, *, path: str | Path | None = None, field: str | None = None):
        self.path = str(path) if path is not None else None
        self.field = field
        self.message = message  # without the path and field
        parts = []
        if self.path:
            parts.append(self.path)
        if field:
            parts.append(field)
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class FileFormatError(MlxlisError):
    """A file is truncated, malformed or internally inconsistent."""


class UnsupportedError(MlxlisError):
    """A well-formed file asks for something mlxlis does not implement."""


class UnsupportedFormatError(UnsupportedError):
    """A file type mlxlis refuses (e.g. pickled .bin / .pt / .pth)."""


class UnsupportedQuantError(UnsupportedError):
    """A GGUF tensor type with no MLX mapping and no dequantizer."""


class ConfigError(MlxlisError):
    """config.json / GGUF metadata is missing a field or has a bad value."""


class AdapterError(MlxlisError):
    """A LoRA adapter that cannot apply to the model (its files, its config, its targets)."""


class WeightsError(MlxlisError):
    """Tensors do not match what the model expects (missing, unexpected, mis-shaped)."""


class MissingTensorError(WeightsError):
    pass


class UnexpectedTensorError(WeightsError):
    pass


class ShapeMismatchError(WeightsError):
    pass


class BindingError(WeightsError):
    """A binding manifest is malformed or does not validate."""


class TokenizerError(MlxlisError):
    pass


class TemplateError(MlxlisError):
    """A chat template failed to render, or tried something the sandbox forbids."""


class NoChatTemplateError(TemplateError):
    """Chat mode was asked for but the model carries no chat template."""


class ModelNotFoundError(MlxlisError):
    """A path or catalog name that resolves to nothing."""


class ContextLimitError(MlxlisError):
    """The conversation no longer fits in the model's context."""


class PipelineError(MlxlisError):
    """Running one model across several ranks (`mlx.launch`) failed or cannot start."""


class LayersSplitError(PipelineError):
    """A `--layers-split` that does not fit the model or the number of ranks."""


class RankLostError(PipelineError):
    """Another rank ended, disconnected or stopped answering during a pipelined run."""


class TooLargeError(MlxlisError):
    """The model's weights alone exceed the memory this process may fill (refused before
    any weight is read)."""


class DoesNotFitError(PipelineError):
    """The model does not fit in the ranks' memory, even split across them."""


class AmbiguousModelError(ModelNotFoundError):
    """A model reference matches several models (e.g. GGUF quants); the message lists them."""


class HubError(MlxlisError):
    """A Hugging Face Hub repo could not be read, reached or downloaded."""


class RepoAccessError(HubError, ModelNotFoundError):
    """A Hub repo that does not exist, or is private or gated for this token."""


class NotCachedError(HubError, ModelNotFoundError):
    """Offline (or the Hub unreachable) and the model is not in the Hugging Face cache."""


class IntegrityError(HubError):
    """A downloaded file's SHA-256 differs from the one the Hub gives for it."""


class DiskFullError(HubError):
    """Not enough free disk space for a download."""
