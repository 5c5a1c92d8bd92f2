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
