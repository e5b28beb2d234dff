"""The packed LoRA layer (``[x | x A^T] @ [W | B]^T``) against plain torch, on the CPU.

The shrink is Triton; on the CPU it runs under Triton's interpreter, switched
on before the kernel is defined, so the checks run in a child process with
``TRITON_INTERPRET=1`` (float16 and float32: the interpreter has no
bfloat16). The GPU test (``gpu_tests/test_gpu_packed_lora.py``) checks
bfloat16 on the 8B model's layer shapes, in a CUDA graph.
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
    """One layer: ``tokens`` rows over ``slots`` slots, slot ``packed`` packed."""

    name: str
    tokens: int
    slots: int
    hidden: int
    rank: int
    widths: tuple[int, ...]
    packed: int = 1
    dtype: str = "float16"
    block_m: int = 16
    block_k: int = 32


CASES = [
    Case("qkv-like, 3 slices of other widths", 37, 3, 96, 8, (40, 24, 24)),
    Case("one slice, float32", 21, 2, 64, 16, (48,), dtype="float32"),
    Case("K not a multiple of the block", 19, 2, 80, 8, (32, 16), block_k=64),
    Case("one pass of many rows", 33, 2, 64, 8, (16,), block_m=64),
    Case("nothing packed (slot -1)", 12, 2, 64, 8, (32,), packed=-1),
]


def _run_case(case: Case) -> dict[str, float]:
    """Two launches of the shrink (new rows each), then the widened GEMM; the
    largest errors against torch."""
    from skyrl_lora.server.kernels.packed_lora import (
        PackConfig,
        base_view,
        new_scratch,
        packed_width,
        shrink_pack,
        stage,
        widen,
    )

    gen = torch.Generator().manual_seed(len(case.name))
    dtype = getattr(torch, case.dtype)
    a = [
        torch.randn(case.slots, 1, case.rank, case.hidden, generator=gen).to(dtype)
        for _ in case.widths
    ]
    b = [torch.randn(case.slots, 1, w, case.rank, generator=gen).to(dtype) for w in case.widths]
    weight = torch.randn(sum(case.widths), case.hidden, generator=gen).to(dtype)
    wide = widen(weight, len(case.widths), case.rank)
    if case.packed >= 0:
        stage(wide, case.hidden, case.widths, [part[case.packed, 0] for part in b])
    scratch = new_scratch(case.tokens + 3, case.rank, torch.device("cpu"))
    config = PackConfig(block_m=case.block_m, block_k=case.block_k)
    slot = torch.tensor([case.packed], dtype=torch.int32)
    scaling = 0.5
    errors: dict[str, float] = {}
    for launch in range(2):
        slots = torch.randint(-1, case.slots, (case.tokens,), generator=gen, dtype=torch.int32)
        x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype)
        packed = torch.full(
            (case.tokens, packed_width(case.hidden, len(case.widths), case.rank)), 7.0
        ).to(dtype)
        shrink_pack(x, a, packed, slot, slots, scratch, scaling, config)
        mine = ((slots == case.packed) & (case.packed >= 0)).float()[:, None]
        want = x.float() @ weight.float().T
        col = 0
        lora_cols = []
        for s, w in enumerate(case.widths):
            shrunk = mine * scaling * (x.float() @ a[s][max(case.packed, 0), 0].float().T)
            lora_cols.append(shrunk)
            if case.packed >= 0:
                want[:, col : col + w] += shrunk.to(dtype).float() @ b[s][case.packed, 0].float().T
            col += w
        got = torch.nn.functional.linear(packed.float(), wide.float())
        scale = max(1.0, float(want.abs().max()))
        errors[f"x_copied_{launch}"] = _err(packed[:, : case.hidden], x)
        errors[f"shrink_{launch}"] = _err(packed[:, case.hidden :], torch.cat(lora_cols, 1))
        errors[f"layer_{launch}"] = _err(got, want) / scale
        errors[f"base_view_{launch}"] = _err(
            torch.nn.functional.linear(x.float(), base_view(wide, case.hidden).float()),
            x.float() @ weight.float().T,
        )
        errors[f"scratch_left_{launch}"] = float(
            scratch.sums.abs().max() + scratch.counters.abs().max()
        )
    return errors


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _run_all() -> None:
    print(json.dumps({c.name: _run_case(c) for c in CASES}))


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", "from tests.test_packed_lora import _run_all; _run_all()"],
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
def test_packed_layer_matches_torch(case: Case, results: dict[str, Any]):
    errors = results[case.name]
    tol = 1e-5 if case.dtype == "float32" else 2e-3
    for launch in range(2):
        # x is copied bit for bit; the LoRA input is fp32 sums rounded once.
        assert errors[f"x_copied_{launch}"] == 0.0, (asdict(case), errors)
        assert errors[f"shrink_{launch}"] <= tol * case.hidden**0.5, (asdict(case), errors)
        # The layer: base plus LoRA term, from one GEMM over the widened weight.
        assert errors[f"layer_{launch}"] <= tol, (asdict(case), errors)
        assert errors[f"base_view_{launch}"] == 0.0, (asdict(case), errors)
        # Each launch leaves its workspace and counters zero for the next.
        assert errors[f"scratch_left_{launch}"] == 0.0, (asdict(case), errors)


def test_shrink_pack_refuses_a_packed_input_of_the_wrong_width():
    from skyrl_lora.server.kernels.packed_lora import new_scratch, shrink_pack

    x = torch.zeros(4, 32)
    a = [torch.zeros(2, 1, 8, 32)]
    with pytest.raises(ValueError, match="packed input"):
        shrink_pack(
            x, a, torch.zeros(4, 32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32), new_scratch(4, 8, torch.device("cpu")),
        )  # fmt: skip
