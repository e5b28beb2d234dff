"""Async client for skyrl-lora servers (aiohttp; no vLLM, torch or Ray)."""

from skyrl_lora.client.client import RemoteInferenceClient
from skyrl_lora.client.config import ClientConfig
from skyrl_lora.client.gates import AdapterGates
from skyrl_lora.client.handover import AdapterHandover
from skyrl_lora.client.metrics import ClientMetricsSnapshot
from skyrl_lora.client.push import InMemoryAdapter
from skyrl_lora.client.results import AbortResult, FanOutResult, LoadResult, PauseResult
from skyrl_lora.errors import RetryLimitError

__all__ = [
    "AbortResult",
    "AdapterGates",
    "AdapterHandover",
    "ClientConfig",
    "ClientMetricsSnapshot",
    "FanOutResult",
    "InMemoryAdapter",
    "LoadResult",
    "PauseResult",
    "RemoteInferenceClient",
    "RetryLimitError",
]
