"""The packed LoRA layer on CUDA, bfloat16, on every linear layer shape of the 8B model.

``[x | x A^T] @ [W | B]^T`` (:mod:`skyrl_lora.server.kernels.packed_lora`)
against plain torch, ``x W^T + (x A_slot^T) B_slot^T`` on the packed slot's
rows and ``x W^T`` on the others, eagerly and replayed from a CUDA graph with
new inputs and a new token mapping (a workspace or counter left dirty by one
replay would show in the next).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.lora_kernels import llama_layers, make_slots

if not torch.cuda.is_available():  # pragma: no cover - the CPU suite never collects gpu_tests
    pytest.skip("no CUDA device", allow_module_level=True)

SHAPES = llama_layers("8b")[0]


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_packed_layer_matches_torch_in_a_cuda_graph(shape, tokens: int):
    from skyrl_lora.server.kernels.packed_lora import (
        new_scratch,
        packed_width,
        shrink_pack,
        stage,
        widen,
    )

    name, widths, fan_in = shape
    rank, slots_n, packed_slot = 64, 4, 2
    gen = torch.Generator(device="cuda").manual_seed(3)
    slots = make_slots(shape, slots_n, rank, gen)
    weight = (torch.randn(sum(widths), fan_in, device="cuda", generator=gen) * 0.02).to(
        torch.bfloat16
    )
    wide = widen(weight, len(widths), rank)
    stage(wide, fan_in, widths, [b[packed_slot, 0] for b in slots.b])
    x = torch.empty(tokens, fan_in, device="cuda", dtype=torch.bfloat16)
    token_slots = torch.empty(tokens, device="cuda", dtype=torch.int32)
    packed_in = torch.empty(
        tokens, packed_width(fan_in, len(widths), rank), device="cuda", dtype=torch.bfloat16
    )
    y = torch.empty(tokens, sum(widths), device="cuda", dtype=torch.bfloat16)
    scratch = new_scratch(tokens, rank, torch.device("cuda"))
    slot = torch.tensor([packed_slot], device="cuda", dtype=torch.int32)

    def layer() -> None:
        shrink_pack(x, slots.a, packed_in, slot, token_slots, scratch)
        torch.matmul(packed_in, wide.t(), out=y)

    def refill() -> torch.Tensor:
        x.copy_(torch.randn(tokens, fan_in, device="cuda", generator=gen))
        token_slots.copy_(torch.randint(-1, slots_n, (tokens,), device="cuda", generator=gen))
        token_slots[0] = packed_slot
        want = x.float() @ weight.float().T
        mine = (token_slots == packed_slot).float()[:, None]
        col = 0
        for a, b, width in zip(slots.a, slots.b, widths):
            shrunk = (mine * (x.float() @ a[packed_slot, 0].float().T)).to(torch.bfloat16)
            want[:, col : col + width] += shrunk.float() @ b[packed_slot, 0].float().T
            col += width
        return want

    def check(want: torch.Tensor) -> None:
        err = float((y.float() - want).abs().max() / want.abs().max())
        assert err < 1e-2, (name, tokens, err)
        assert float(scratch.sums.abs().max()) == 0.0
        assert int(scratch.counters.abs().max()) == 0

    want = refill()
    layer()
    torch.cuda.synchronize()
    check(want)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()  # warm-up off the capture, as torch recommends
        with torch.cuda.graph(graph):
            layer()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        want = refill()
        graph.replay()
        torch.cuda.synchronize()
        check(want)
