"""The embedded default model: built here, deterministically, with no download."""

from skyrl_lora.server.embedded.builder import (
    ADAPTER_WORDS,
    BABBLE,
    EmbeddedModel,
    build_adapter,
    ensure_embedded_model,
    vocabulary,
)

__all__ = [
    "ADAPTER_WORDS",
    "BABBLE",
    "EmbeddedModel",
    "build_adapter",
    "ensure_embedded_model",
    "vocabulary",
]
