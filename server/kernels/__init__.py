"""The engine's own GPU kernels, and their place in vLLM.

Owns :mod:`.grouped_lora` (Triton LoRA shrink/expand whose work follows the
adapters a step holds, not the server's slots or the step's whole token
count) and :mod:`.punica_ops` (those kernels behind vLLM's op signatures,
installed into the GPU Punica wrapper in each worker). Imports torch,
Triton and :mod:`..compat` only: nothing of the server's above it.
"""

#: The environment variable ``serve`` sets for its engine's workers
#: (``--lora-kernels``); read where vLLM imports our worker extension.
KERNELS_ENV = "SKYRL_LORA_KERNELS"
#: Its values: our grouped kernels (the default), or vLLM's own.
GROUPED, VLLM = "grouped", "vllm"
