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
    lanes: int = 2  # pieces a (slice, columns) of the shrink is spread over, by adapter
    ticket_roles: bool = False  # roles by arrival, not by program id


CASES = [
    Case("qkv-like, 3 slices of other widths, bias", 37, 4, 128, 16, (64, 32, 32), bias=True),
    Case("one row", 1, 3, 64, 16, (48,)),
    Case("gate/up-like, every slot, no base rows", 64, 8, 256, 32, (64, 64), base_share=0.0),
    Case("adapters spread over 3 lanes", 30, 7, 128, 16, (32, 32), lanes=3),
    Case("one lane", 30, 5, 128, 16, (32,), lanes=1),
    Case("roles by ticket", 30, 5, 128, 16, (32, 32), ticket_roles=True),
    Case("every row on the base model", 9, 3, 64, 16, (32,), base_share=1.0),
    Case("wide K in pieces of 512", 20, 2, 1024, 16, (32,)),
    Case("qkv-like again (the workspace's other copy)", 37, 4, 128, 16, (64, 32, 32)),
]


def _run_case(case: Case, seed: int) -> dict[str, float]:
    """One launch; its largest errors against torch and against vLLM's ops."""
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    from skyrl_lora.server.kernels.fused_lora import fused_lora_linear

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
        ticket_roles=case.ticket_roles,
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
