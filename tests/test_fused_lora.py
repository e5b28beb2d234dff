"""The fused LoRA linear kernel against plain torch and vLLM's torch LoRA ops, on the CPU.

:func:`skyrl_lora.server.kernels.fused_lora.fused_lora_linear` is Triton; on
the CPU it runs under Triton's interpreter (switched on before the kernel is
defined, so the checks run in a child process), in float16 (the interpreter
has no bfloat16). Launches follow each other on one shared workspace with
other shapes, slices and mappings between them, as a model's layers do: a
launch that added into a copy the one before left dirty, or waited on a
count it did not reset, would show. ``gpu_tests/test_gpu_fused_lora.py``
checks bfloat16 on the 8B model's layers in CUDA graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    """One layer's launch: ``tokens`` rows over ``slots`` adapter slots."""

    name: str
    tokens: int
    slots: int
    hidden: int
    rank: int
    widths: tuple[int, ...]
    base_share: float = 0.25  # rows with no adapter
    bias: bool = False
    lanes: int | None = 2  # pieces a (slice, columns) of the shrink is spread over, by adapter
    ticket_roles: bool = False  # roles by arrival, not by program id
    tiles: tuple[int, int, int] | None = None  # (block_n, block_k, stages); None: tiles_for's


CASES = [
    Case("qkv-like, 3 slices of other widths, bias", 37, 4, 128, 16, (64, 32, 32), bias=True),
    Case("one row", 1, 3, 64, 16, (48,)),
    Case("gate/up-like, every slot, no base rows", 64, 8, 256, 32, (64, 64), base_share=0.0),
    Case("adapters spread over 3 lanes", 30, 7, 128, 16, (32, 32), lanes=3),
    Case("lanes by default (one off CUDA)", 30, 5, 128, 16, (32,), lanes=None),
    Case("roles by ticket", 30, 5, 128, 16, (32, 32), ticket_roles=True),
    Case("tiles of the caller's", 30, 5, 128, 16, (64, 32, 32), tiles=(32, 32, 2)),
    Case("every row on the base model", 9, 3, 64, 16, (32,), base_share=1.0),
    Case("wide K in pieces of 512", 20, 2, 1024, 16, (32,)),
    Case("qkv-like again (the workspace's other copy)", 37, 4, 128, 16, (64, 32, 32)),
]


def _run_case(case: Case, seed: int) -> dict[str, float]:
    """One launch; its largest errors against torch and against vLLM's ops."""
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    from skyrl_lora.server.kernels.fused_lora import Tiles, fused_lora_linear

    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    slots = torch.randint(0, case.slots, (case.tokens,), generator=gen, dtype=torch.int32)
    slots[torch.rand(case.tokens, generator=gen) < case.base_share] = -1
    active = torch.full((case.slots + 1,), -1, dtype=torch.int32)  # vLLM pads with -1
    held = sorted(set(slots.tolist()))
    active[: len(held)] = torch.tensor(held, dtype=torch.int32)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype)
    n = sum(case.widths)
    weight = (torch.randn(n, case.hidden, generator=gen) / case.hidden**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if case.bias else None
    a = [
        (torch.randn(case.slots, 1, case.rank, case.hidden, generator=gen) / case.hidden**0.5).to(
            dtype
        )
        for _ in case.widths
    ]
    b = [torch.randn(case.slots, 1, w, case.rank, generator=gen).to(dtype) for w in case.widths]
    scale = 0.5

    got = fused_lora_linear(
        x, weight, bias, a, b, case.widths, slots, active, scale, lanes=case.lanes,
        ticket_roles=case.ticket_roles, tiles=Tiles(*case.tiles) if case.tiles else None,
    )  # fmt: skip
    assert got is not None, case

    want = x.float() @ weight.float().T + (bias.float() if bias is not None else 0.0)
    col = 0
    for s, w in enumerate(case.widths):
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                shrunk = (scale * (x[t].float() @ a[s][slot, 0].float().T)).to(dtype).float()
                want[t, col : col + w] += shrunk @ b[s][slot, 0].float().T
        col += w

    # vLLM's way: the base layer, then its LoRA ops on the rows with an adapter.
    vllm_y = torch.nn.functional.linear(x, weight, bias)
    rows = (slots >= 0).nonzero().flatten()
    col = 0
    for s, w in enumerate(case.widths):
        shrunk = torch.zeros(len(rows), case.rank, dtype=torch.float32)
        bgmv_shrink(x[rows], a[s], shrunk, slots[rows].long(), scale)
        part = vllm_y[rows].clone()
        bgmv_expand_slice(shrunk.to(dtype), b[s], part, slots[rows].long(), col, w, True)
        vllm_y[rows] = part
        col += w
    top = max(1.0, float(want.abs().max()))
    return {
        "torch": float((got.float() - want).abs().max()) / top,
        "vllm": float((got.float() - vllm_y.float()).abs().max()) / top,
    }


def _refusals() -> dict[str, bool]:
    """What :func:`supports` says to layers and steps the kernel does not take."""
    from skyrl_lora.server.kernels.fused_lora import MAX_TOKENS, supports

    def says(tokens: int, rank: int, widths: tuple[int, ...], dtype: torch.dtype) -> bool:
        x = torch.zeros(tokens, 64, dtype=dtype)
        w = torch.zeros(sum(widths), 64, dtype=dtype)
        a = [torch.zeros(2, 1, rank, 64, dtype=dtype) for _ in widths]
        b = [torch.zeros(2, 1, width, rank, dtype=dtype) for width in widths]
        return supports(x, w, a, b, widths)

    half = torch.float16
    return {
        "a decode step": says(MAX_TOKENS, 16, (32,), half),
        "more rows than one block": says(MAX_TOKENS + 1, 16, (32,), half),
        "rank 8": says(4, 8, (32,), half),
        "a slice of 24 columns": says(4, 16, (24, 32), half),
        "float32": says(4, 16, (32,), torch.float32),
        "four slices": says(4, 16, (32,) * 4, half),
    }


def _run_all() -> None:
    errors = {c.name: _run_case(c, seed) for seed, c in enumerate(CASES)}
    print(json.dumps({"cases": errors, "refusals": _refusals()}))


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", "from tests.test_fused_lora import _run_all; _run_all()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fused_launch_matches_torch_and_vllm(case: Case, results: dict[str, Any]) -> None:
    errors = results["cases"][case.name]
    # One rounding of the shrink to float16 and one of the output: a few units in the last place.
    assert errors["torch"] <= 4e-3, (asdict(case), errors)
    assert errors["vllm"] <= 4e-3, (asdict(case), errors)


def test_supports_takes_decode_steps_and_refuses_the_rest(results: dict[str, Any]) -> None:
    assert results["refusals"] == {
        "a decode step": True,
        "more rows than one block": False,
        "rank 8": False,
        "a slice of 24 columns": False,
        "float32": False,
        "four slices": False,
    }


def _sm90_registers(fl: Any, tiles: Any, widths: tuple[int, ...], k: int) -> int:
    """The registers a thread of the kernel (module ``fl``) uses on these
    layers' ``tiles``, as ptxas (Triton's own, no GPU needed) builds it for
    sm_90 with the options a launch passes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    piece = next(p for p in fl.PIECE_KS if k % p == 0)
    pieces = len(widths) * (k // piece)
    constants = dict(
        HAS_BIAS=False, R=64, BM=fl.MAX_TOKENS, BN=tiles.block_n, BK=tiles.block_k,
        PIECE=piece, CHUNK=fl.CHUNK_K, KP=k // piece, LANES=1, P=pieces,
        G=pieces + sum(widths) // tiles.block_n, ZB=1024, ROWS=fl.MAX_TOKENS,
        COPY=fl.MAX_SLICES * fl.MAX_TOKENS * 64, TICKET_ROLES=False,
    )  # fmt: skip
    pointers = {"slot_of_row_ptr": "*i32", "active_ptr": "*i32", "count_ptr": "*i32"}
    pointers |= {"sums_ptr": "*fp32", "ticket_ptr": "*i64"}
    pointers |= {n: "*bf16" for n in ("x_ptr", "w_ptr", "bias_ptr", "y_ptr", "a0", "a1", "a2")}
    pointers |= {n: "*bf16" for n in ("b0", "b1", "b2")}
    kernel = fl._fused_lora_linear
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32")
        for name in kernel.arg_names
    }
    signature["scale"] = "fp32"
    aligned = [n for n, t in signature.items() if t.startswith("*")]
    aligned += ["stride_xm", "stride_wn", "a_slot_stride", "b_slot0", "b_slot1", "b_slot2"]
    aligned += ["M", "N", "K", "n0", "n1"]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=fl.launch_options(tiles),
    )
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"fused_lora_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        usage = subprocess.run(
            [str(tools / "cuobjdump"), "-res-usage", str(cubin)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        cubin.unlink()
    return int(usage.split("REG:")[1].split()[0])


@pytest.mark.parametrize(
    "name,widths,k",
    [("qkv_proj", (4096, 1024, 1024), 4096), ("gate_up_proj", (14336, 14336), 4096)],
)
def test_the_8b_layers_tiles_stay_resident_as_their_shared_memory_allows(
    name: str, widths: tuple[int, ...], k: int
) -> None:
    """Registers must not cost a resident program: on the gate/up layer Triton
    would use 146 a thread (three programs an SM, where the shared memory
    holds four, and the launch's 448 tiles in two waves of 132 SMs)."""
    from skyrl_lora.server.kernels import fused_lora as fl

    tiles = fl.tiles_for(widths, k)
    assert tiles is not None
    registers = _sm90_registers(fl, tiles, widths, k)
    by_registers = fl._SM_REGISTERS // (registers * fl.NUM_WARPS * 32)
    assert by_registers >= tiles.per_sm(), (name, registers, tiles)
    assert (tiles.per_sm(), tiles.max_registers()) == {
        "qkv_proj": (1, None), "gate_up_proj": (4, 128)
    }[name]  # fmt: skip


def test_lanes_fill_the_waves_free_slots() -> None:
    from skyrl_lora.server.kernels.fused_lora import MAX_LANES, lanes_for

    # The 8B shape on 132 SMs: qkv (96 tiles, 24 pieces a lane, one program an SM),
    # down (64, 28), gate/up (448, 16, four an SM), and a wave already full.
    assert lanes_for(96, 24, 132) == 1
    assert lanes_for(64, 28, 132) == 2
    assert lanes_for(448, 16, 528) == MAX_LANES
    assert lanes_for(132, 8, 132) == 1


def test_tiles_that_do_not_divide_the_layer_are_refused() -> None:
    from skyrl_lora.server.kernels.fused_lora import Tiles, fused_lora_linear

    x = torch.zeros(4, 128, dtype=torch.float16)
    weight = torch.zeros(48, 128, dtype=torch.float16)
    a = [torch.zeros(2, 1, 16, 128, dtype=torch.float16)]
    b = [torch.zeros(2, 1, 48, 16, dtype=torch.float16)]
    slots = torch.zeros(4, dtype=torch.int32)
    active = torch.tensor([0, -1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not divide"):
        fused_lora_linear(x, weight, None, a, b, (48,), slots, active, tiles=Tiles(32, 64, 2))
