"""Runnable examples of skyrl-lora (run from the repository root: ``python -m examples.<name>``)."""
