"""The GPU tests' perf model: :mod:`skyrl_lora.server.embedded.random_model` under older names."""

from __future__ import annotations

from skyrl_lora.server.embedded.random_model import (
    ADAPTERS,
    DEFAULT_SIZE,
    SIZES,
)
from skyrl_lora.server.embedded.random_model import (
    build_random_model as build_perf_model,
)
from skyrl_lora.server.embedded.random_model import (
    write_model_adapter as write_random_adapter,
)

__all__ = [
    "ADAPTERS",
    "DEFAULT_SIZE",
    "SIZES",
    "build_perf_model",
    "write_random_adapter",
]
