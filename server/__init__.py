"""The skyrl-lora server: vLLM's OpenAI server plus per-adapter pause.

Importing this package is cheap; the modules that need vLLM import it
themselves, so ``skyrl_lora.server.embedded`` (the tiny model builder) and
the CLI's help work before the engine is loaded.
"""
