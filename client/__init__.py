"""Async client for skyrl-lora servers (aiohttp; no vLLM, torch or Ray)."""
