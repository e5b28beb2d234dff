"""Probe: which sampled rows had non-finite logits, on vLLM 0.26's model runner V2.

Put this folder first on ``PYTHONPATH`` of a server (vLLM's engine process
inherits it; Python imports ``sitecustomize`` at start). When vLLM's V2
sampler module is imported, its ``Sampler.__call__`` is wrapped:

* each step counts, on the GPU and without a sync, the logits rows holding
  NaN or inf and the sampled ids outside the vocabulary; the counts are
  copied to the host without blocking and read at the next step;
* a step that had any is logged (``nan_logits_probe`` lines on stderr) with
  its request ids, their adapters (vLLM's LoRA ids), the largest finite
  logit magnitude of the step and, at most every 10 s, for each adapter
  slot, the non-finite count and largest magnitude of its weights;
* with ``SKYRL_NAN_PROBE_FIX=1``, non-finite logits are replaced by 0 before
  sampling (every such row samples uniformly, inside the vocabulary), so a
  run goes on and counts every occurrence. Its samples are then not all
  the policy's: not for figures.

Why: vLLM 0.26's Gumbel sampler takes the arg-max over 1024-wide blocks;
a row of NaN can pick a masked lane past the vocabulary, and the next
step's embedding lookup then fails a device-side assert that kills the
engine. This probe says whether that is what happens, and for which adapter.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

TARGET = "vllm.v1.worker.gpu.sample.sampler"
RUNNER = "vllm.v1.worker.gpu.model_runner"
FIX = os.environ.get("SKYRL_NAN_PROBE_FIX") == "1"
_state: dict = {"runner": None, "pending": None, "steps": 0, "flagged": 0}


def _log(**fields) -> None:
    import json

    print("nan_logits_probe " + json.dumps(fields, default=str), file=sys.stderr, flush=True)


def _slot_report(runner) -> list:
    import torch

    manager = getattr(runner, "lora_manager", None)
    adapters = getattr(manager, "_adapter_manager", None)
    index_to_id = list(getattr(adapters, "lora_index_to_id", []) or [])
    modules = getattr(adapters, "modules", {}) or {}
    report = []
    for index, lora_id in enumerate(index_to_id):
        nonfinite, largest = 0, 0.0
        for module in modules.values():
            for name in ("lora_a_stacked", "lora_b_stacked"):
                stacked = getattr(module, name, None)
                for t in stacked if isinstance(stacked, (list, tuple)) else [stacked]:
                    if not isinstance(t, torch.Tensor) or t.dim() == 0 or index >= t.shape[0]:
                        continue
                    part = t[index].float()
                    nonfinite += int((~torch.isfinite(part)).sum())
                    finite = part[torch.isfinite(part)]
                    if finite.numel():
                        largest = max(largest, float(finite.abs().max()))
        report.append(
            {"slot": index, "lora_id": lora_id, "nonfinite": nonfinite, "max_abs": largest}
        )
    return report


def _read_pending() -> None:
    pending = _state["pending"]
    if pending is None or not pending["event"].query():
        return
    _state["pending"] = None
    bad_rows, oob = (int(v) for v in pending["host"].tolist())
    if not bad_rows and not oob:
        return
    _state["flagged"] += 1
    runner = _state["runner"]
    lora_ids = []
    if runner is not None:
        ids = getattr(getattr(runner, "lora_state", None), "lora_ids", None)
        if ids is not None:
            lora_ids = [int(ids[i]) for i in pending["idx"]]
    _log(
        at=time.time(),
        step=pending["step"],
        rows=len(pending["idx"]),
        nonfinite_rows=bad_rows,
        sampled_out_of_vocab=oob,
        fixed=FIX,
        bad_row_indices=pending["bad_list"](),
        lora_ids=lora_ids,
        req_ids=pending["req_ids"],
        max_finite_logit=float(pending["max_finite"]),
        slots=_slots_now_and_then(runner),
    )


#: Reading every slot back syncs the engine: at most once this often, or a
#: run with many flagged steps slows to a crawl (at 5786b60 one flagged step
#: a second held the engine to a quarter of its tokens).
SLOT_REPORT_EVERY_S = 10.0


def _slots_now_and_then(runner) -> list | None:
    now = time.monotonic()
    if runner is None or now - _state.get("slots_at", -SLOT_REPORT_EVERY_S) < SLOT_REPORT_EVERY_S:
        return None
    _state["slots_at"] = now
    return _slot_report(runner)


def _wrap_sampler(module) -> None:
    import torch

    original = module.Sampler.__call__

    def __call__(self, logits, input_batch):
        # A probe must never be what kills the engine: on its first error it
        # logs it and steps aside.
        seen = None
        if not _state.get("broken"):
            try:
                seen = _before(logits)
            except Exception as error:
                _state["broken"] = True
                _log(probe_failed=repr(error))
        out = original(self, logits, input_batch)
        if seen is not None:
            try:
                _after(seen, logits, input_batch, out)
            except Exception as error:
                _state["broken"] = True
                _log(probe_failed=repr(error))
        return out

    def _before(logits):
        _read_pending()
        _state["steps"] += 1
        rows_bad = ~torch.isfinite(logits).all(dim=-1)
        finite = torch.where(torch.isfinite(logits), logits.abs(), torch.zeros_like(logits))
        max_finite = finite.max() if logits.numel() else torch.zeros((), device=logits.device)
        if FIX:
            logits.masked_fill_(~torch.isfinite(logits), 0.0)
        return rows_bad, max_finite

    def _after(seen, logits, input_batch, out):
        rows_bad, max_finite = seen
        vocab = logits.shape[-1]
        ids = out.sampled_token_ids
        counts = torch.stack([rows_bad.sum(), ((ids >= vocab) | (ids < 0)).sum()]).to(torch.int64)
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        mf_host = torch.empty((), dtype=torch.float32, pin_memory=True)
        mf_host.copy_(max_finite.float(), non_blocking=True)
        rows_host = torch.empty(rows_bad.shape, dtype=torch.bool, pin_memory=True)
        rows_host.copy_(rows_bad, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        idx = list(getattr(input_batch, "idx_mapping_np", []))
        req_ids = list(getattr(input_batch, "req_ids", []) or [])

        class _MaxFinite:
            def __float__(self) -> float:
                return float(mf_host)

        _state["pending"] = {
            "event": event,
            "host": host,
            "idx": idx,
            "req_ids": req_ids[:8],
            "step": _state["steps"],
            "max_finite": _MaxFinite(),
            "bad_list": lambda: [i for i, b in enumerate(rows_host.tolist()) if b][:16],
        }

    module.Sampler.__call__ = __call__


def _wrap_runner(module) -> None:
    original = module.GPUModelRunner.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _state["runner"] = self

    module.GPUModelRunner.__init__ = __init__


PATCHES = {TARGET: _wrap_sampler, RUNNER: _wrap_runner}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module, _exec=exec_module, _name=name):
            _exec(module)
            PATCHES[_name](module)
            _log(patched=_name, fix=FIX)

        loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Finder())
