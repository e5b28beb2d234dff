"""The grouped LoRA kernels against vLLM's Triton kernels, in bfloat16, on CUDA.

Every LoRA layer of the 8B shape (q/k/v with slices of two widths, o,
gate/up, down), ranks 16 and 64, decode- and prefill-sized steps, tokens of
the base model among them, every slot walked or the active ones only: the
layer's output after shrink and expand equals vLLM's within bfloat16's
rounding. Then the ops as the Punica wrapper calls them, installed through
:mod:`skyrl_lora.server.kernels.punica_ops`, inside a CUDA graph. No
server; about a minute, most of it Triton compiling.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.lora_kernels import kernel_metadata, llama_layers, make_slots

if not torch.cuda.is_available():  # pragma: no cover - the CPU suite never collects gpu_tests
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.fixture(autouse=True)
def _fresh_vllm_pointer_caches() -> None:
    """vLLM's kernels, the references here, cache weights' strides by address:
    a test's weights made where an earlier test's were would be read with the
    earlier strides (the step-plan test failed so after the tests before it)."""
    from skyrl_lora.server import compat

    compat.forget_lora_pointer_caches()


@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("tokens,adapters", [(64, 8), (256, 32), (7, 3), (700, 2)])
def test_grouped_equals_vllm_on_every_8b_layer(rank: int, tokens: int, adapters: int) -> None:
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    from skyrl_lora.server.kernels.grouped_lora import grouped_expand, grouped_shrink

    slots = 32
    gen = torch.Generator(device="cuda").manual_seed(rank * 1000 + tokens)
    mapping = torch.arange(tokens, dtype=torch.int32) % adapters
    mapping[::5] = -1  # some tokens on the base model
    meta = kernel_metadata(mapping.cuda(), slots)
    no_lora = torch.tensor([False])
    layers, _ = llama_layers("8b")
    for layer in layers:
        weights = make_slots(layer, slots, rank, gen)
        x = torch.randn(tokens, layer[2], device="cuda", generator=gen).to(torch.bfloat16)
        y0 = torch.randn(tokens, sum(layer[1]), device="cuda", generator=gen).to(torch.bfloat16)
        buf = torch.empty(len(layer[1]), tokens, rank, device="cuda")
        want = y0.clone()
        lora_shrink(
            x, weights.a, buf, meta["mapping"], meta["sorted"], meta["per"], meta["start"],
            meta["ids"], no_lora, torch.tensor([slots + 1], dtype=torch.int32), 0.5,
        )  # fmt: skip
        vllm_buf = buf.clone()
        lora_expand(
            buf, weights.b, want, meta["mapping"], meta["sorted"], meta["per"], meta["start"],
            meta["ids"], no_lora, torch.tensor([slots + 1], dtype=torch.int32),
            offset_start=0, add_inputs=True,
        )  # fmt: skip
        for groups in (slots + 1, len(meta["active"])):
            got = y0.clone()
            grouped_shrink(
                x, weights.a, buf, meta["sorted"], meta["per"], meta["start"], meta["ids"],
                groups, 0.5,
            )  # fmt: skip
            scale = vllm_buf.abs().max()
            assert (buf - vllm_buf).abs().max() <= 1e-3 * scale, (layer[0], groups)
            grouped_expand(
                buf, weights.b, got, meta["sorted"], meta["per"], meta["start"], meta["ids"],
                groups, 0, True,
            )  # fmt: skip
            # vLLM rounds the LoRA term to bf16 before adding; we add in fp32:
            # a couple of bf16 units of the output's magnitude apart.
            tol = 4 * 2**-8 * float(want.float().abs().max())
            diff = (got.float() - want.float()).abs()
            assert float(diff.max()) <= tol, (layer[0], groups, float(diff.max()), tol)
            base_rows = mapping.cuda() < 0
            assert torch.equal(got[base_rows], y0[base_rows]), layer[0]


def test_installed_ops_replay_in_a_cuda_graph() -> None:
    """The ops the Punica wrapper calls, once installed, capture and replay
    like vLLM's, with the step's metadata changed between replays in place."""
    import importlib

    from skyrl_lora.server.kernels import punica_ops

    assert punica_ops.install(), "the grouped kernels did not install"
    punica = importlib.import_module("vllm.lora.punica_wrapper.punica_gpu")
    assert punica.lora_shrink is torch.ops.skyrl_lora.lora_shrink

    slots, rank, tokens = 8, 16, 32
    gen = torch.Generator(device="cuda").manual_seed(3)
    layer = llama_layers("8b")[0][0]
    weights = make_slots(layer, slots, rank, gen)
    x = torch.randn(tokens, layer[2], device="cuda", generator=gen).to(torch.bfloat16)
    y = torch.zeros(tokens, sum(layer[1]), device="cuda").to(torch.bfloat16)
    buf = torch.empty(len(layer[1]), tokens, rank, device="cuda")
    live = kernel_metadata(torch.arange(tokens, dtype=torch.int32, device="cuda") % 4, slots)
    no_lora, groups = torch.tensor([False]), torch.tensor([slots + 1], dtype=torch.int32)

    def step() -> None:
        y.zero_()
        punica.lora_shrink(
            x, weights.a, buf, live["mapping"], live["sorted"], live["per"], live["start"],
            live["ids"], no_lora, groups, 1.0,
        )  # fmt: skip
        punica.lora_expand(
            buf, weights.b, y, live["mapping"], live["sorted"], live["per"], live["start"],
            live["ids"], no_lora, groups, 0, True,
        )  # fmt: skip

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for adapters in (4, 1, 7):
        fresh = kernel_metadata(
            torch.arange(tokens, dtype=torch.int32, device="cuda") % adapters, slots
        )
        for key in ("mapping", "sorted", "per", "start", "ids"):
            live[key].copy_(fresh[key])
        graph.replay()
        replayed = y.clone()
        step()
        torch.cuda.synchronize()
        # The shrink's split-K adds land in any order: equal to rounding.
        scale = float(y.float().abs().max())
        assert scale > 0, adapters
        assert float((replayed.float() - y.float()).abs().max()) <= 4 * 2**-8 * scale, adapters


def test_the_step_plan_is_refilled_before_each_replay() -> None:
    """As ``serve`` runs them: vLLM's real GPU Punica wrapper, its metadata
    prepared on the host (:mod:`skyrl_lora.server.lora_metadata`) by
    ``update_metadata``, after which the installed hook fills the step plan;
    a CUDA graph captured once with the plan's tables, then replayed for
    steps of other mappings. Each replay equals vLLM's own kernels run
    eagerly on the same metadata."""
    import importlib
    from types import SimpleNamespace

    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    from skyrl_lora.server import lora_metadata
    from skyrl_lora.server.kernels import punica_ops

    assert punica_ops.install(), "the grouped kernels did not install"
    punica = importlib.import_module("vllm.lora.punica_wrapper.punica_gpu")
    vllm_shrink, vllm_expand = punica_ops._vllm_ops  # type: ignore[misc]
    slots, rank, tokens = 8, 64, 48
    config = SimpleNamespace(max_loras=slots, specialize_active_lora=False)
    wrapper = PunicaWrapperGPU(512, 64, "cuda", lora_config=config)
    hooks = lora_metadata.install(wrapper)
    meta = wrapper.token_mapping_meta
    gen = torch.Generator(device="cuda").manual_seed(5)
    layer = llama_layers("8b")[0][0]
    weights = make_slots(layer, slots, rank, gen)
    x = torch.randn(tokens, layer[2], device="cuda", generator=gen).to(torch.bfloat16)
    y = torch.zeros(tokens, sum(layer[1]), device="cuda").to(torch.bfloat16)
    buf = torch.empty(len(layer[1]), tokens, rank, device="cuda")

    def prepare(adapters: int) -> None:
        ids = [0 if t % 4 == 0 else 1 + t % adapters for t in range(tokens)]  # 0: the base model
        mapping = LoRAMapping(index_mapping=tuple(ids), prompt_mapping=tuple(ids))
        wrapper.update_metadata(mapping, list(range(1, slots + 1)), slots, 32000)

    def step(shrink=punica.lora_shrink, expand=punica.lora_expand) -> None:
        y.zero_()
        args = meta.meta_args(tokens, False)
        shrink(x, weights.a, buf, *args, 1.0)
        expand(buf, weights.b, y, *args, 0, True)

    prepare(3)
    assert meta.num_tokens_per_lora.data_ptr() in punica_ops._step_plans
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for adapters in (5, 1, 8, 2):
        prepare(adapters)
        graph.replay()
        replayed = y.clone()
        step(vllm_shrink, vllm_expand)
        torch.cuda.synchronize()
        scale = float(y.float().abs().max())
        assert scale > 0, adapters
        assert float((replayed.float() - y.float()).abs().max()) <= 4 * 2**-8 * scale, adapters
    assert hooks.host_steps == 5  # every step prepared on the host, as in serve
