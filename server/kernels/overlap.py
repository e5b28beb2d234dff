"""The LoRA shrink beside the base layer's GEMM, on a second CUDA stream.

A decode step's LoRA kernels are small and bound by latency: at one
adapter they leave most of the GPU idle while they run, and in a plain
step they run after the base layer's GEMM, which is bound by HBM. Each
linear LoRA layer here starts its shrink (which needs only the layer's
input) on a second stream as the GEMM starts, and runs the expand, which
adds into the GEMM's output, once both are done
(:func:`..compat.overlap_lora_shrink_with_base`). vLLM captures the fork
and join in its CUDA graphs; steps without an adapter run the base layer
alone.

``serve --lora-overlap on`` (the default on CUDA) sets vLLM's
``VLLM_LORA_ENABLE_DUAL_STREAM`` in the engine's environment, which makes
vLLM's linear LoRA layers call the second-stream path this replaces, and
:func:`install` runs in each worker as vLLM imports our extension, before
the graphs are captured. ``--lora-overlap fused`` also sets
:data:`FUSED_ENV`: then a layer whose base GEMM and LoRA one launch of
:mod:`.fused_lora` can do (decode-sized steps, unquantized weights) runs
that instead, and the rest take the second stream.
"""

from __future__ import annotations

import logging
import os

from .. import compat
from . import FUSED_ENV

logger = logging.getLogger(__name__)

_installed = False
_fused = False


def requested() -> bool:
    """Whether the engine's environment asks for the second stream."""
    return os.environ.get(compat.DUAL_STREAM_ENV, "0") not in ("", "0")


def fused_requested() -> bool:
    """Whether it also asks for the fused layer (:mod:`.fused_lora`)."""
    return os.environ.get(FUSED_ENV, "0") not in ("", "0")


def install() -> bool:
    """Overlap each LoRA layer's shrink with its base GEMM (once per process);
    False, changing nothing, where the environment does not ask for it or
    this vLLM has no second-stream path to replace."""
    global _installed, _fused
    if _installed:
        return True
    if not requested():
        return False
    fused = None
    if fused_requested():
        from .fused_lora import fused_lora_linear  # Triton: only where asked for

        fused = fused_lora_linear
    _installed = compat.overlap_lora_shrink_with_base(fused)
    _fused = _installed and fused is not None
    if _installed:
        logger.info(
            "LoRA shrink overlapped with the base GEMM (%s=1)%s", compat.DUAL_STREAM_ENV,
            ", or fused into it where the layer allows" if _fused else "",
        )  # fmt: skip
    else:
        logger.warning("%s is set but vLLM's LoRA layers look otherwise", compat.DUAL_STREAM_ENV)
    return _installed


def installed() -> bool:
    """Whether this process's LoRA layers overlap their shrink with the base GEMM."""
    return _installed


def fused_installed() -> bool:
    """Whether they run base GEMM and LoRA as one launch where they can."""
    return _fused
