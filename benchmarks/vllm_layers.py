"""vLLM's own LoRA layer classes, built on the CPU without an engine.

For measuring and testing slot writes against the real ``set_lora`` /
``reset_lora`` of the installed vLLM: a one-process distributed group of
tensor-parallel size 1 (as vLLM's layer tests set it up) and the four LoRA
layers of a decoder block, shaped as asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from skyrl_lora.server.embedded.random_model import DecoderShape, write_random_adapter

__all__ = ["DecoderShape", "decoder_lora_layers", "single_process_group", "write_random_adapter"]


@contextmanager
def single_process_group(rendezvous: Path) -> Iterator[None]:
    """vLLM's distributed state for this process alone (gloo, world size 1)."""
    from vllm import distributed
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        distributed.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{rendezvous}",
            backend="gloo",
        )
        distributed.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            distributed.destroy_model_parallel()
            distributed.destroy_distributed_environment()


def decoder_lora_layers(
    shape: DecoderShape, slots: int, max_rank: int, dtype: Any
) -> dict[str, Any]:
    """Each decoder layer's qkv, o, gate_up and down LoRA layers, with their
    stacked slot tensors allocated; call inside :func:`single_process_group`."""
    from vllm.config import LoRAConfig
    from vllm.lora import layers
    from vllm.model_executor.layers import linear

    h, inter = shape.hidden, shape.intermediate
    head_dim = h // shape.heads
    # vLLM types the rank as a Literal of the ranks it supports; an unsupported
    # one fails its own validation here, with vLLM's message.
    config = LoRAConfig(max_lora_rank=max_rank, max_loras=slots, lora_dtype=dtype)  # type: ignore[arg-type]
    built: dict[str, Any] = {}
    for i in range(shape.layers):
        block = {
            "qkv_proj": layers.MergedQKVParallelLinearWithLoRA(
                linear.QKVParallelLinear(h, head_dim, shape.heads, shape.kv_heads, bias=False)
            ),
            "o_proj": layers.RowParallelLinearWithLoRA(linear.RowParallelLinear(h, h)),
            "gate_up_proj": layers.MergedColumnParallelLinearWithLoRA(
                linear.MergedColumnParallelLinear(h, [inter, inter], bias=False)
            ),
            "down_proj": layers.RowParallelLinearWithLoRA(linear.RowParallelLinear(inter, h)),
        }
        for name, layer in block.items():
            layer.create_lora_weights(slots, config, None)
            built[f"layers.{i}.{name}"] = layer
    return built


def random_lora_weights(layer: Any, rank: int, seed: int) -> tuple[Any, Any]:
    """Random A and B of ``rank`` for every slice of ``layer``, shaped as
    vLLM's loader hands them to ``set_lora`` (one tensor, or a list per slice)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = layer.lora_a_stacked[0].dtype
    a = [torch.randn(rank, t.shape[-1], generator=gen).to(dtype) for t in layer.lora_a_stacked]
    b = [torch.randn(t.shape[-2], rank, generator=gen).to(dtype) for t in layer.lora_b_stacked]
    return (a[0], b[0]) if len(a) == 1 else (a, b)
