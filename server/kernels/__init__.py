"""The engine's own GPU kernels, and their place in vLLM.

Owns :mod:`.grouped_lora` (Triton LoRA shrink/expand whose work follows the
adapters a step holds, not the server's slots or the step's whole token
count), :mod:`.fused_lora` (a layer's shrink and expand in one launch),
:mod:`.punica_ops` (those kernels behind vLLM's op signatures, installed
into the GPU Punica wrapper in each worker) and :mod:`.overlap` (the shrink
on a second stream beside the base GEMM). Imports torch,
Triton and :mod:`..compat` only: nothing of the server's above it.
"""

#: The environment variable ``serve`` sets for its engine's workers
#: (``--lora-kernels``); read where vLLM imports our worker extension.
KERNELS_ENV = "SKYRL_LORA_KERNELS"
#: Its values: our grouped kernels (the default); the same with each layer's
#: shrink and expand fused into one launch; or vLLM's own.
GROUPED, FUSED, VLLM = "grouped", "fused", "vllm"
