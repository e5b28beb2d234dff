"""The engine's own GPU kernels, and their place in vLLM.

Owns :mod:`.grouped_lora` (Triton LoRA shrink/expand whose work follows the
adapters a step holds, not the server's slots or the step's whole token
count), :mod:`.punica_ops` (those kernels behind vLLM's op signatures,
installed into the GPU Punica wrapper in each worker), :mod:`.overlap` (the
shrink beside the base GEMM on a second stream) and :mod:`.fused_lora` (the
base GEMM with the LoRA inside, one launch a layer). Imports torch,
Triton and :mod:`..compat` only: nothing of the server's above it.
"""

#: The environment variable ``serve`` sets for its engine's workers
#: (``--lora-kernels``); read where vLLM imports our worker extension.
KERNELS_ENV = "SKYRL_LORA_KERNELS"
#: Its values: our grouped kernels (the default), or vLLM's own.
GROUPED, VLLM = "grouped", "vllm"
#: Set (to 1) for ``serve --lora-overlap fused``: each linear LoRA layer's base
#: GEMM and LoRA in one launch where :mod:`.fused_lora` takes it.
FUSED_ENV = "SKYRL_LORA_FUSED"
