"""Models built here, deterministically, with no download.

``builder``: the embedded tiny model and its trained adapters (the demo's and
the tests' model). ``random_model``: random-weight Llama shapes (0.8B, 8B)
and random adapters for measuring speed; import it by its module path.
"""

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
