"""Async client for skyrl-lora servers (aiohttp; no vLLM, torch or Ray)."""

from skyrl_lora.client.client import RemoteInferenceClient
from skyrl_lora.client.config import ClientConfig
from skyrl_lora.client.gates import AdapterGates
from skyrl_lora.client.push import InMemoryAdapter
from skyrl_lora.errors import RetryLimitError

__all__ = [
    "AdapterGates",
    "ClientConfig",
    "InMemoryAdapter",
    "RemoteInferenceClient",
    "RetryLimitError",
]
