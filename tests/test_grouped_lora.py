"""The grouped LoRA kernels against plain torch and vLLM's torch LoRA ops, on the CPU.

The kernels are Triton; on the CPU they run under Triton's interpreter,
which must be switched on before the kernels are defined, so the checks run
in a child process with ``TRITON_INTERPRET=1``. The interpreter has no
bfloat16, so they compute in float16 and float32 here; the GPU test
(``gpu_tests/test_gpu_grouped_lora.py``) checks bfloat16 against vLLM's
Triton kernels on every layer shape of the 8B model.
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
    """One layer's LoRA application: ``slots`` adapter slots, ``tokens`` rows."""

    name: str
    tokens: int
    slots: int
    hidden: int
    rank: int
    widths: tuple[int, ...]
    dtype: str = "float16"
    base_share: float = 0.25  # tokens with no adapter
    groups: str = "all"  # "all": every slot + base (vLLM's default); "active": just those
    add_inputs: bool = True
    offset_start: int = 0
    block_m: int = 16


CASES = [
    Case("qkv-like, 3 slices of other widths", 37, 4, 96, 8, (40, 24, 24), offset_start=5),
    Case("one slice, float32, replace", 21, 3, 64, 16, (48,), dtype="float32", add_inputs=False),
    Case("many rows per adapter (prefill)", 90, 2, 64, 8, (32, 32), block_m=16),
    Case(
        "active groups only, no base tokens", 19, 6, 64, 8, (32,), base_share=0.0, groups="active"
    ),
    Case("every token on the base model", 9, 3, 64, 8, (16,), base_share=1.0),
    Case("rank below a tile, wide output", 12, 2, 48, 4, (160,)),
    Case("row chunks across groups of uneven sizes", 61, 5, 64, 8, (24, 40), base_share=0.1),
]


def _run_case(case: Case) -> dict[str, float]:
    """Both kernels on one case; the largest errors against the references."""
    from benchmarks.lora_kernels import kernel_metadata
    from skyrl_lora.server.kernels.grouped_lora import (
        GroupedConfig,
        fill_plan,
        grouped_expand,
        grouped_shrink,
        new_plan,
    )

    gen = torch.Generator().manual_seed(len(case.name))
    dtype = getattr(torch, case.dtype)
    slots = torch.randint(0, case.slots, (case.tokens,), generator=gen, dtype=torch.int32)
    base = torch.rand(case.tokens, generator=gen) < case.base_share
    slots[base] = -1
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype)
    a = [
        torch.randn(case.slots, 1, case.rank, case.hidden, generator=gen).to(dtype)
        for _ in case.widths
    ]
    b = [torch.randn(case.slots, 1, w, case.rank, generator=gen).to(dtype) for w in case.widths]
    meta = kernel_metadata(slots, case.slots)
    groups = case.slots + 1 if case.groups == "all" else len(meta["active"])
    config = GroupedConfig(block_m=case.block_m, block_k=32, block_n=32)
    scaling = 0.5

    shrunk = torch.full((len(case.widths), case.tokens, case.rank), 3.0)  # zeroed by the op
    grouped_shrink(
        x, a, shrunk, meta["sorted"], meta["per"], meta["start"], meta["ids"], groups,
        scaling, config,
    )  # fmt: skip
    shrunk_ref = torch.zeros_like(shrunk)
    for s in range(len(case.widths)):
        for t in range(case.tokens):
            slot = int(slots[t])
            if slot >= 0:
                shrunk_ref[s, t] = scaling * (x[t].float() @ a[s][slot, 0].float().T)

    width = case.offset_start + sum(case.widths) + 3
    y0 = torch.randn(case.tokens, width, generator=gen).to(dtype)
    y = y0.clone()
    grouped_expand(
        shrunk_ref, b, y, meta["sorted"], meta["per"], meta["start"], meta["ids"], groups,
        case.offset_start, case.add_inputs, config,
    )  # fmt: skip
    # As ``serve`` runs them: the step's plan filled once, then handed to both.
    plan = new_plan(case.tokens + 5, case.slots + 1, x.device, (case.block_m, 64))
    fill_plan(plan, meta["sorted"], meta["per"], meta["start"], meta["ids"], groups)
    planned_shrunk = torch.full_like(shrunk, -1.0)
    grouped_shrink(
        x, a, planned_shrunk, meta["sorted"], meta["per"], meta["start"], meta["ids"], groups,
        scaling, config, plan,
    )  # fmt: skip
    planned_y = y0.clone()
    grouped_expand(
        shrunk_ref, b, planned_y, meta["sorted"], meta["per"], meta["start"], meta["ids"],
        groups, case.offset_start, case.add_inputs, config, plan,
    )  # fmt: skip
    y_ref = y0.float().clone()
    col = case.offset_start
    for s, w in enumerate(case.widths):
        for t in range(case.tokens):
            slot = int(slots[t])
            if slot >= 0:
                term = shrunk_ref[s, t].to(dtype).float() @ b[s][slot, 0].float().T
                y_ref[t, col : col + w] = (y_ref[t, col : col + w] if case.add_inputs else 0) + term
        col += w

    # vLLM's own torch LoRA ops (its CPU path) on the tokens that have an adapter.
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    rows = (slots >= 0).nonzero().flatten()
    vllm_shrunk = torch.zeros(len(rows), case.rank, dtype=torch.float32)
    vllm_y = y0[rows].clone()
    col = case.offset_start
    vllm_shrink_err = 0.0
    for s, w in enumerate(case.widths):
        vllm_shrunk.zero_()
        bgmv_shrink(x[rows], a[s], vllm_shrunk, slots[rows].long(), scaling)
        vllm_shrink_err = max(vllm_shrink_err, _err(shrunk[s, rows], vllm_shrunk))
        bgmv_expand_slice(
            shrunk_ref[s, rows].to(dtype), b[s], vllm_y, slots[rows].long(), col, w, case.add_inputs
        )
        col += w
    touched = slice(case.offset_start, case.offset_start + sum(case.widths))
    scale = max(1.0, float(y_ref.abs().max()))
    return {
        "shrink": _err(shrunk, shrunk_ref),
        "planned_vs_own": max(_err(planned_shrunk, shrunk), _err(planned_y, y)),
        "expand": _err(y.float(), y_ref) / scale,
        "expand_untouched": _err(y[:, touched.stop :].float(), y0[:, touched.stop :].float()),
        "shrink_vs_vllm": vllm_shrink_err,
        "expand_vs_vllm": _err(y[rows].float(), vllm_y.float()) / scale,
        "base_rows_unchanged": _err(y[slots < 0].float(), y0[slots < 0].float())
        if case.add_inputs
        else 0.0,
    }


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


#: Splits of a step's tokens over groups for the plan check: (slot, rows) per
#: group in vLLM's order (the base model's -1 first), then unused groups.
PLAN_SPLITS = [
    [(-1, 5), (0, 16), (2, 17), (3, 1)],
    [(0, 70), (1, 64), (4, 129)],
    [(-1, 9)],
    [(-1, 3), (1, 2), (5, 33), (6, 0)],
]


def _fill_plans() -> list[list[list[int]]]:
    """Each split's plan (heights 16 and 64), its tables as lists."""
    from skyrl_lora.server.kernels.grouped_lora import PLAN_HEIGHTS, fill_plan, new_plan

    filled = []
    for split in PLAN_SPLITS:
        groups = len(split) + 2  # two unused groups after them, as vLLM leaves them
        slots = [s for s, _ in split] + [-1, -1]
        counts = [n for _, n in split] + [0, 0]
        tokens = sum(counts)
        sorted_rows = torch.randperm(tokens, generator=torch.Generator().manual_seed(tokens))
        starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
        plan = new_plan(tokens, groups, torch.device("cpu"), PLAN_HEIGHTS)
        fill_plan(
            plan, sorted_rows.to(torch.int32), torch.tensor(counts, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32),
            groups,
        )  # fmt: skip
        filled.append([sorted_rows.tolist(), *(t.tolist() for t in plan.tables)])
    return filled


def _steps_through_the_ops() -> list[float]:
    """Steps as ``serve`` runs them: vLLM's metadata object filled from the host
    (:mod:`skyrl_lora.server.lora_metadata`), the step plan filled from it
    (:func:`punica_ops.fill_step_plan`), then the ops vLLM's Punica wrapper
    calls. Each step's largest error against torch; the mapping changes
    every step, so a plan left from the step before would show."""
    from types import SimpleNamespace

    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    from skyrl_lora.server import lora_metadata
    from skyrl_lora.server.kernels import punica_ops

    gen = torch.Generator().manual_seed(11)
    slots_n, hidden, rank, widths = 4, 64, 8, (32, 16)
    meta = LoRAKernelMeta.make(slots_n, 64, "cpu")
    wrapper = SimpleNamespace(token_mapping_meta=meta)
    a = [torch.randn(slots_n, 1, rank, hidden, generator=gen) for _ in widths]
    b = [torch.randn(slots_n, 1, w, rank, generator=gen) for w in widths]
    errors = []
    for tokens, adapters in ((37, 3), (20, 1), (9, 0), (64, 4)):
        slots = torch.arange(tokens, dtype=torch.int32) % max(adapters, 1)
        slots[::3] = -1 if adapters else slots[::3]
        if adapters == 0:
            slots[:] = -1
        lora_metadata.write(meta, lora_metadata.plan(slots))
        punica_ops.fill_step_plan(wrapper)
        x = torch.randn(tokens, hidden, generator=gen)
        buf = torch.empty(len(widths), tokens, rank)
        y0 = torch.randn(tokens, sum(widths), generator=gen)
        y = y0.clone()
        args = meta.meta_args(tokens, False)
        punica_ops.lora_shrink(x, a, buf, *args, 0.5)
        punica_ops.lora_expand(buf, b, y, *args, 0, True)
        want = y0.clone()
        col = 0
        for s, w in enumerate(widths):
            for t in range(tokens):
                slot = int(slots[t])
                if slot >= 0:
                    term = (0.5 * x[t] @ a[s][slot, 0].T) @ b[s][slot, 0].T
                    want[t, col : col + w] += term
            col += w
        errors.append(_err(y, want) / max(1.0, float(want.abs().max())))
    return errors


def _run_all() -> None:
    print(
        json.dumps(
            {
                "cases": {c.name: _run_case(c) for c in CASES},
                "plans": _fill_plans(),
                "steps": _steps_through_the_ops(),
            }
        )
    )


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", "from tests.test_grouped_lora import _run_all; _run_all()"],
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
def test_grouped_kernels_match_torch_and_vllm(case: Case, results: dict[str, Any]):
    errors = results["cases"][case.name]
    tol = 1e-5 if case.dtype == "float32" else 2e-3
    # The shrink accumulates in fp32 in both: close to exact.
    assert errors["shrink"] <= tol * case.hidden**0.5, (case, errors)
    assert errors["shrink_vs_vllm"] <= tol * case.hidden**0.5, (case, errors)
    # The expand rounds once to the output dtype (one unit in its last place).
    assert errors["expand"] <= (1e-6 if case.dtype == "float32" else 1e-3), (case, errors)
    assert errors["expand_vs_vllm"] <= (1e-6 if case.dtype == "float32" else 2e-3), (case, errors)
    # Columns outside the layer's slices and rows without an adapter are left alone.
    assert errors["expand_untouched"] == 0.0, (case, errors)
    assert errors["base_rows_unchanged"] == 0.0, (case, errors)
    # A plan filled once for the step gives what each launch's own plan gives.
    assert errors["planned_vs_own"] <= 1e-6 * max(1.0, case.hidden**0.5), (case, errors)


@pytest.mark.parametrize("split", range(len(PLAN_SPLITS)))
def test_the_step_plan_lists_each_adapter_groups_rows_in_chunks(split: int, results):
    """Every chunk of a group with an adapter, in group order: its slot and its
    rows (the sorted token indices, -1 past the group's end); nothing for the
    base model's group or unused ones; the count in entry 0."""
    from skyrl_lora.server.kernels.grouped_lora import PLAN_HEIGHTS

    sorted_rows, *tables = results["plans"][split]
    for height, table in zip(PLAN_HEIGHTS, tables):
        want: list[list[int]] = []
        at = 0
        for slot, count in PLAN_SPLITS[split]:
            if slot >= 0:
                for first in range(0, count, height):
                    rows = sorted_rows[at + first : at + min(first + height, count)]
                    want.append([slot, *rows, *[-1] * (height - len(rows))])
            at += count
        entry = 2 * height
        assert table[0] == len(want), (height, table[0], len(want))
        got = [
            [table[e], *table[e + height : e + entry]]
            for e in range(entry, entry * (1 + len(want)), entry)
        ]
        assert got == want, height


def test_steps_read_the_plan_filled_for_them(results):
    """Four steps through the installed ops' bodies, each with another mapping
    (three adapters, one, none, four): each equals torch, so each read its
    own step's plan, not the one before."""
    assert len(results["steps"]) == 4
    assert max(results["steps"]) <= 1e-5, results["steps"]


def test_the_plan_is_filled_after_vllm_prepares_the_metadata(monkeypatch):
    """The hook runs after vLLM's ``update_metadata`` (which the model runner
    calls before every LoRA step, the graph-capturing dummy steps included),
    and placing it again replaces it rather than running two."""
    from skyrl_lora.server import compat

    punica_gpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_gpu")
    calls: list[str] = []
    wrapper_class = punica_gpu.PunicaWrapperGPU
    monkeypatch.setattr(
        wrapper_class, "update_metadata", lambda self, *a, **k: calls.append(f"vllm {a}")
    )
    assert compat.after_punica_metadata(lambda w: calls.append(f"first {w}"))
    assert compat.after_punica_metadata(lambda w: calls.append(f"hook {w}"))
    wrapper_class.update_metadata("w", "mapping", [1])
    assert calls == ["vllm ('mapping', [1])", "hook w"]


def test_case_fields_are_plain():
    """The cases travel to the child process by name only; keep them data."""
    assert all(asdict(c) for c in CASES)


def test_supports_refuses_what_the_kernels_cannot_take():
    from skyrl_lora.server.kernels.grouped_lora import supports

    one = torch.zeros(4, 1, 8, 64, dtype=torch.float16)
    assert supports([one])
    assert supports([one, torch.zeros(4, 1, 8, 64, dtype=torch.float16)])
    assert not supports([one] * 4)  # more slices than a launch takes
    assert not supports([one, one.to(torch.float32)])  # mixed dtypes
    assert not supports([torch.zeros(4, 2, 8, 64, dtype=torch.float16)])  # not (slots, 1, ...)
    assert not supports([])


def test_kernel_choice_from_the_environment(monkeypatch):
    from skyrl_lora.server.kernels import punica_ops

    monkeypatch.delenv(punica_ops.KERNELS_ENV, raising=False)
    assert punica_ops.chosen() == punica_ops.GROUPED
    monkeypatch.setenv(punica_ops.KERNELS_ENV, "vllm")
    assert punica_ops.chosen() == punica_ops.VLLM
    monkeypatch.setenv(punica_ops.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="grouped"):
        punica_ops.chosen()
    # No CUDA device here: nothing is installed, vLLM's CPU path stays.
    monkeypatch.setenv(punica_ops.KERNELS_ENV, "grouped")
    assert punica_ops.install() is False
    assert not punica_ops.installed()


@pytest.mark.parametrize(
    ("flags", "cpu", "cache_dir", "overlap", "fused"),
    [
        ([], True, "skyrl-lora-grouped-kernels", False, False),
        (["--lora-kernels", "grouped"], True, "skyrl-lora-grouped-kernels", False, False),
        (["--lora-kernels", "vllm"], True, None, False, False),
        (["--lora-overlap", "fused"], True, "skyrl-lora-grouped-kernels", False, False),
        ([], False, "skyrl-lora-grouped-kernels-overlap", True, False),
        (["--lora-overlap", "off"], False, "skyrl-lora-grouped-kernels", False, False),
        (["--lora-overlap", "fused"], False, "skyrl-lora-grouped-kernels-fused", True, True),
        (["--lora-kernels", "vllm"], False, "skyrl-lora-overlap", True, False),
        (["--lora-kernels", "vllm", "--lora-overlap", "off"], False, None, False, False),
    ],
)
def test_serve_tells_its_workers_the_kernels_and_keeps_their_compile_caches_apart(
    flags, cpu, cache_dir, overlap, fused, monkeypatch, tmp_path
):
    """``serve`` hands the choices to the engine's workers through the
    environment (the second stream only where the engine runs on CUDA:
    vLLM-CPU's LoRA layers refuse it), and every choice other than vLLM's
    own compiles into a cache root of its own: vLLM's compile cache key
    names neither the kernels a graph calls nor the layers' second stream."""
    from skyrl_lora.server import compat
    from skyrl_lora.server.http.app import parse_server_args
    from skyrl_lora.server.kernels import FUSED_ENV, GROUPED, KERNELS_ENV

    monkeypatch.setattr(compat, "engine_on_cpu", lambda: cpu)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.delenv(compat.DUAL_STREAM_ENV, raising=False)
    monkeypatch.setenv(FUSED_ENV, "1")  # left by an earlier serve: cleared unless asked
    args = parse_server_args(["--model", "unused", *flags])
    chosen = flags[1] if flags[:1] == ["--lora-kernels"] else GROUPED
    assert args.lora_kernels == chosen
    assert os.environ[KERNELS_ENV] == chosen
    assert (os.environ.get(compat.DUAL_STREAM_ENV) == "1") is overlap
    assert (os.environ.get(FUSED_ENV) == "1") is fused
    expected = tmp_path / cache_dir if cache_dir else tmp_path
    assert os.environ["VLLM_CACHE_ROOT"] == str(expected)
    parse_server_args(["--model", "unused", *flags])  # a second serve in one process
    assert os.environ["VLLM_CACHE_ROOT"] == str(expected)


def test_the_overlap_installs_only_where_asked(monkeypatch):
    """No second stream unless the engine's environment asks; asked, it
    replaces vLLM's second-stream path of its linear LoRA layers (the
    class exists in the CPU build too; the CPU build's layers never call it)."""
    from skyrl_lora.server import compat
    from skyrl_lora.server.kernels import overlap

    monkeypatch.setattr(overlap, "_installed", False)
    monkeypatch.setattr(overlap, "_fused", False)
    monkeypatch.setattr(compat, "_fused_linear", None)
    monkeypatch.delenv(compat.DUAL_STREAM_ENV, raising=False)
    monkeypatch.delenv(overlap.FUSED_ENV, raising=False)
    assert overlap.install() is False
    assert not overlap.installed()
    base_linear = pytest.importorskip("vllm.lora.layers.base_linear")
    layer_class = base_linear.BaseLinearLayerWithLoRA
    monkeypatch.setattr(layer_class, "_apply_async_impl", layer_class._apply_async_impl)
    monkeypatch.setenv(compat.DUAL_STREAM_ENV, "1")
    assert overlap.install() is True
    assert overlap.installed() and not overlap.fused_installed()
    assert layer_class._apply_async_impl is compat._overlapped_lora_apply
    assert compat._fused_linear is None

    # Asked for the fused layer too: the second-stream body calls it first.
    from skyrl_lora.server.kernels.fused_lora import fused_lora_linear

    monkeypatch.setattr(overlap, "_installed", False)
    monkeypatch.setenv(overlap.FUSED_ENV, "1")
    assert overlap.install() is True
    assert overlap.fused_installed()
    assert compat._fused_linear is fused_lora_linear


def test_the_grid_bound_covers_every_row_chunk_a_step_can_make():
    """The grid is sized on the host, before the step's groups are known (a
    CUDA graph replays it for every step of its size): the bound must hold
    for any split of the tokens over the groups."""
    import random

    from skyrl_lora.server.kernels.grouped_lora import _chunks_at_most

    rng = random.Random(7)
    for _ in range(2000):
        groups = rng.randint(1, 40)
        block_m = rng.choice([16, 32, 64])
        counts = [rng.choice([0, 1, 2, 15, 16, 17, rng.randint(0, 300)]) for _ in range(groups)]
        tokens = sum(counts)
        made = sum(-(-c // block_m) for c in counts)
        assert made <= _chunks_at_most(max(tokens, 1), groups, block_m), (counts, block_m)


def test_vllm_pointer_caches_are_forgotten_on_request(monkeypatch):
    """vLLM's LoRA ops cache weights' strides by address alone; the GPU tests
    and the kernel benchmark drop weights and make others, so they empty
    those caches first. Emptied in this build's own module, where they live."""
    from skyrl_lora.server import compat

    utils = pytest.importorskip("vllm.lora.ops.triton_ops.utils")
    for name in compat._LORA_POINTER_CACHES:
        monkeypatch.setattr(utils, name, {(1, 2): ("stale",)})
    compat.forget_lora_pointer_caches()
    assert all(getattr(utils, name) == {} for name in compat._LORA_POINTER_CACHES)
