"""The LoRA kernels' per-step metadata, prepared on the host: no GPU sync in the step.

Every engine step, vLLM's Punica wrapper (``PunicaWrapperGPU.update_metadata``)
tells its Triton LoRA kernels which tokens use which adapter slot: the
tokens sorted by slot, the slots present, the tokens per slot and where each
slot's run starts (``LoRAKernelMeta.prepare_tensors``). vLLM 0.26 (and 0.32)
computes these from the device copy of the token-to-slot mapping, and two of
its steps need an answer on the host: the no-adapter check reads a device
boolean into a CPU flag, and ``torch.unique`` must learn its output's size.
Each waits until the GPU has run everything queued before it, the previous
step's forward pass included. vLLM schedules asynchronously so that the step
loop's CPU work overlaps the GPU's; these two waits serialise them again. In
the multi-tenant RL run on an H100 (main a307ce9, 2026-11-26) the engine's
step loop spent 16% of its CPU time in those two lines (py-spy), its process
ran at one core, and the GPU was busy 56-64% of the time.

The mapping is host data to begin with (``LoRAMapping.index_mapping`` and
``prompt_mapping``: the adapter id of each token and of each sampled row).
:func:`install` wraps a Punica wrapper so that each of its two metadata
objects is filled from the host copy: the same values computed on the CPU,
then copied into the same device buffers (their addresses are baked into
the CUDA graphs) with non-blocking copies from pinned memory. A mapping
whose length does not match the device tensor's falls back to vLLM's own
preparation. vLLM has an open pull request doing the same (#53309).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch


@dataclass(frozen=True)
class HostPlan:
    """One metadata object's values for one step, on the host (int32)."""

    no_lora: bool
    slots: torch.Tensor  # the slot of each token (or row); -1: the base model
    sorted_by_slot: torch.Tensor  # token indices, stably sorted by slot
    active_slots: torch.Tensor  # the slots present, ascending (-1 first if present)
    tokens_per_slot: torch.Tensor
    start_loc: torch.Tensor  # cumulative tokens_per_slot (the buffer's [1:] part)
    num_active: int  # len(active_slots), rounded up to a captured CUDA-graph count


#: Up to this many tokens (or rows) a step's plan is worked out on Python
#: lists, beyond it with torch's ``unique`` and ``sort``, whose calls cost
#: more and whose work per token less: ``slots_of`` and ``plan`` together
#: over 8 adapters take 53 us on lists against 119 with torch at 64 tokens,
#: 110 against 142 at 256, 190 against 175 at 512 (``benchmarks.host_plan``,
#: medians of 9 interleaved rounds, main 5ded72d, 2026-11-29, the 2-core CPU
#: machine). A decode step plans twice (tokens, sampled rows).
LIST_PLAN_MAX = 256


def slot_table(lora_index_to_id: Sequence[int | None]) -> dict[int, int]:
    """Adapter id -> the slot it occupies."""
    return {lora_id: slot for slot, lora_id in enumerate(lora_index_to_id) if lora_id is not None}


def slots_of(ids: Sequence[int], table: dict[int, int]) -> torch.Tensor:
    """The slot of each id (-1 for ids of 0 or less: no adapter), as vLLM's
    ``convert_mapping`` maps them; past :data:`LIST_PLAN_MAX` ids, one lookup
    per distinct id, not per token."""
    if len(ids) <= LIST_PLAN_MAX:
        return torch.tensor([table[i] if i > 0 else -1 for i in ids], dtype=torch.int32)
    as_tensor = torch.tensor(ids, dtype=torch.int64)
    distinct, where = torch.unique(as_tensor, return_inverse=True)
    mapped = torch.tensor([table[i] if i > 0 else -1 for i in distinct.tolist()], dtype=torch.int32)
    return mapped[where]


def plan(slots: torch.Tensor, captured_lora_counts: Sequence[int] = ()) -> HostPlan:
    """What ``LoRAKernelMeta.prepare_tensors`` computes, from host slots."""
    if slots.numel() <= LIST_PLAN_MAX:
        return _plan_of_list(slots, captured_lora_counts)
    no_lora = bool((slots == -1).all())
    order = torch.sort(slots, stable=True).indices.to(torch.int32)
    active, counts = torch.unique(slots, sorted=True, return_counts=True)
    counts = counts.to(torch.int32)
    return HostPlan(
        no_lora=no_lora,
        slots=slots,
        sorted_by_slot=order,
        active_slots=active.to(torch.int32),
        tokens_per_slot=counts,
        start_loc=torch.cumsum(counts, dim=0, dtype=torch.int32),
        num_active=_captured(int(active.numel()), captured_lora_counts),
    )


def _plan_of_list(slots: torch.Tensor, captured_lora_counts: Sequence[int]) -> HostPlan:
    """:func:`plan` on Python lists, its four tables cut from one tensor."""
    values = slots.tolist()
    order = sorted(range(len(values)), key=values.__getitem__)  # stable, as torch's
    counts = Counter(values)
    active = sorted(counts)
    per = [counts[slot] for slot in active]
    n, k = len(values), len(active)
    tables = torch.tensor(order + active + per + list(accumulate(per)), dtype=torch.int32)
    return HostPlan(
        no_lora=all(v == -1 for v in values),
        slots=slots,
        sorted_by_slot=tables[:n],
        active_slots=tables[n : n + k],
        tokens_per_slot=tables[n + k : n + 2 * k],
        start_loc=tables[n + 2 * k :],
        num_active=_captured(k, captured_lora_counts),
    )


def _captured(num_active: int, captured_lora_counts: Sequence[int]) -> int:
    """``num_active`` rounded up to a captured CUDA-graph count (as it is, past the largest)."""
    if captured_lora_counts and num_active > 0:
        at = bisect.bisect_left(captured_lora_counts, num_active)
        if at < len(captured_lora_counts):
            return captured_lora_counts[at]
    return num_active


def write(meta: Any, step: HostPlan) -> None:
    """Fill ``meta`` (a ``LoRAKernelMeta``) as ``prepare_tensors`` would, without a sync."""
    meta._reset()
    meta.no_lora_flag_cpu[0] = step.no_lora
    if step.no_lora:
        return
    n, k = int(step.slots.numel()), int(step.active_slots.numel())
    _copy_in(meta.token_lora_mapping[:n], step.slots)
    _copy_in(meta.token_indices_sorted_by_lora_ids[:n], step.sorted_by_slot)
    _copy_in(meta.active_lora_ids[:k], step.active_slots)
    _copy_in(meta.num_tokens_per_lora[:k], step.tokens_per_slot)
    meta.num_active_loras_cpu[0] = step.num_active
    _copy_in(meta.lora_token_start_loc[1 : 1 + k], step.start_loc)


def _copy_in(target: torch.Tensor, values: torch.Tensor) -> None:
    """A non-blocking copy from pinned memory into a device buffer: torch's
    pinned-memory cache keeps ``values``' block until the copy has run."""
    if target.is_cuda:
        values = values.pin_memory()
    target.copy_(values, non_blocking=True)


class _HostPrepared:
    """Stands in for one metadata object's ``prepare_tensors``: takes the
    host plan set for this step; without one (or of another length) it
    calls vLLM's own."""

    def __init__(self, meta: Any) -> None:
        self.meta = meta
        self.vllm_prepare = meta.prepare_tensors
        self.pending: HostPlan | None = None
        self.host_steps = 0
        self.fallbacks = 0

    def __call__(self, device_mapping: torch.Tensor) -> None:
        step, self.pending = self.pending, None
        if step is None or step.slots.numel() != device_mapping.size(0):
            self.fallbacks += 1
            self.vllm_prepare(device_mapping)
            return
        write(self.meta, step)
        self.host_steps += 1


@dataclass
class HostLoRAMetadata:
    """What :func:`install` put on one Punica wrapper."""

    tokens: _HostPrepared
    rows: _HostPrepared

    @property
    def captured(self) -> Sequence[int]:
        """The active-adapter counts vLLM captured CUDA graphs for."""
        return self.tokens.meta.captured_lora_counts  # type: ignore[no-any-return]

    @property
    def host_steps(self) -> int:
        return self.tokens.host_steps

    @property
    def fallbacks(self) -> int:
        return self.tokens.fallbacks + self.rows.fallbacks


def install(punica: Any) -> HostLoRAMetadata:
    """Prepare ``punica``'s kernel metadata on the host from now on (once:
    installed again, the same hooks are returned)."""
    found = getattr(punica, "_skyrl_host_lora_metadata", None)
    if isinstance(found, HostLoRAMetadata):
        return found
    hooks = HostLoRAMetadata(
        _HostPrepared(punica.token_mapping_meta), _HostPrepared(punica.prompt_mapping_meta)
    )
    punica.token_mapping_meta.prepare_tensors = hooks.tokens
    punica.prompt_mapping_meta.prepare_tensors = hooks.rows
    update_metadata = punica.update_metadata

    def update_with_host_plans(
        mapping: Any, lora_index_to_id: Sequence[int | None], *args: Any, **kwargs: Any
    ) -> Any:
        table = slot_table(lora_index_to_id)
        for hook, ids in (
            (hooks.tokens, mapping.index_mapping),
            (hooks.rows, mapping.prompt_mapping),
        ):
            hook.pending = plan(slots_of(ids, table), hook.meta.captured_lora_counts)
        return update_metadata(mapping, lora_index_to_id, *args, **kwargs)

    punica.update_metadata = update_with_host_plans
    punica._skyrl_host_lora_metadata = hooks
    return hooks
