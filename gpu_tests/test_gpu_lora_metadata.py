"""vLLM 0.26's LoRA kernel metadata waits for the GPU; the host preparation does not.

A real ``PunicaWrapperGPU`` (the object vLLM's engine calls every step) gets
a mixed-adapter mapping while the GPU still runs ~0.2 s of queued work, as
it runs the previous step's forward pass under async scheduling. vLLM's own
``update_metadata`` returns only after that work (its no-adapter flag and
``torch.unique`` read device values); once :func:`lora_metadata.install`
has wrapped it, it returns at once, and raises nothing under torch's sync
check. Both then hold the same metadata. No server; seconds.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from vllm.config.lora import LoRAConfig
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

from skyrl_lora.server import lora_metadata

MAX_TOKENS = 2048
MAX_LORAS = 8
SLOTS: list[int | None] = [11, 12, None, 14, 15, 16, 17, 18]
GPU_WORK_CYCLES = 400_000_000  # torch.cuda._sleep: about 0.2 s on an H100


def wrapper() -> Any:
    config = LoRAConfig(max_lora_rank=16, max_loras=MAX_LORAS, specialize_active_lora=True)
    return PunicaWrapperGPU(MAX_TOKENS, 256, "cuda", lora_config=config)


def mixed_mapping(seed: int, tokens: int, rows: int) -> LoRAMapping:
    rng = random.Random(seed)
    ids = [0] + [i for i in SLOTS if i is not None]
    return LoRAMapping(
        tuple(rng.choice(ids) for _ in range(tokens)),
        tuple(rng.choice(ids) for _ in range(rows)),
    )


def timed_update(punica: Any, mapping: LoRAMapping, sync_check: bool = False) -> float:
    """How long ``update_metadata`` held the host while the GPU had work
    queued; with ``sync_check`` any GPU sync in it raises."""
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_WORK_CYCLES)
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        began = time.perf_counter()
        punica.update_metadata(mapping, SLOTS, MAX_LORAS, 256)
        return time.perf_counter() - began
    finally:
        torch.cuda.set_sync_debug_mode("default")


def same_metadata(a: Any, b: Any, n: int) -> None:
    torch.cuda.synchronize()
    assert bool(a.no_lora_flag_cpu[0]) == bool(b.no_lora_flag_cpu[0])
    for name in ("token_lora_mapping", "token_indices_sorted_by_lora_ids"):
        assert torch.equal(getattr(a, name)[:n], getattr(b, name)[:n]), name
    for name in ("active_lora_ids", "num_tokens_per_lora", "lora_token_start_loc"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert int(a.num_active_loras_cpu[0]) == int(b.num_active_loras_cpu[0])


def test_vllms_metadata_waits_for_queued_gpu_work_and_the_host_preparation_does_not() -> None:
    vllm_side, host_side = wrapper(), wrapper()
    hooks = lora_metadata.install(host_side)
    # Once first: the first call pins host memory and warms torch's CPU ops
    # (29 ms on an H100 host), which later steps reuse.
    host_side.update_metadata(mixed_mapping(99, 64, 64), SLOTS, MAX_LORAS, 256)
    for seed, (tokens, rows) in enumerate([(256, 256), (1500, 12), (37, 37)]):
        mapping = mixed_mapping(seed, tokens, rows)
        waited = timed_update(vllm_side, mapping)
        took = timed_update(host_side, mapping, sync_check=True)
        assert waited > 0.1, f"vLLM's preparation returned in {waited * 1000:.1f} ms"
        assert took < 0.02, f"the host preparation took {took * 1000:.1f} ms"
        same_metadata(vllm_side.token_mapping_meta, host_side.token_mapping_meta, tokens)
        same_metadata(vllm_side.prompt_mapping_meta, host_side.prompt_mapping_meta, rows)
    assert hooks.host_steps == 4 and hooks.fallbacks == 0
