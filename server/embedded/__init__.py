"""The embedded default model: built here, deterministically, with no download."""

from .builder import (
    ADAPTER_WORDS,
    BABBLE,
    BUILD_VERSION,
    EmbeddedModel,
    build_adapter,
    default_cache_dir,
    ensure_embedded_model,
    load_model,
    vocabulary,
)

__all__ = [
    "ADAPTER_WORDS",
    "BABBLE",
    "BUILD_VERSION",
    "EmbeddedModel",
    "build_adapter",
    "default_cache_dir",
    "ensure_embedded_model",
    "load_model",
    "vocabulary",
]
