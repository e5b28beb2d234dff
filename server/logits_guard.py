"""Rows of non-finite logits: sampled inside the vocabulary, flagged, counted.

A tenant's adapter whose weights are finite but overflow the activations
(a diverged update, or corrupted weights) gives NaN logits. vLLM 0.26's
GPU sampler takes its Gumbel arg-max over 1024-wide blocks, so a row of
NaN can pick a lane past the vocabulary; the next step's embedding lookup
then fails a device-side assert and the engine dies with every tenant's
requests (seen on an H100 at main ca0af75, 2026-11-25).

The guard runs in the engine process around vLLM's sampler
(:func:`skyrl_lora.server.compat.wrap_sampler`, installed with the
staging worker extension, :mod:`skyrl_lora.server.loading.staging`):

* before sampling, a row with any NaN or infinity is set to zeros, so it
  samples inside the vocabulary and cannot take the engine down;
* after, that row's logprobs are set to NaN, so the sample route sees
  which samples had no meaning and refuses them
  (:class:`skyrl_lora.errors.NonFiniteLogitsError`) instead of returning
  tokens drawn at random;
* the rows are counted without a sync (read one step later) and logged as
  ``nonfinite_logits`` engine events.

Two elementwise passes over the logits per step, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .telemetry.observability import log_engine_event


@dataclass
class _Pending:
    """A step's count of flagged rows, on its way to the host."""

    count: Any
    ready: Any  # a CUDA event, or None where the count is already on the host


class LogitsGuard:
    """Sanitizes and flags non-finite rows; see the module's docstring."""

    def __init__(self) -> None:
        self.flagged_rows = 0
        self._pending: _Pending | None = None

    def before(self, logits: Any) -> Any:
        """Zero the non-finite rows of ``logits`` in place; their mask, ``[rows]``."""
        self._report()
        bad = ~torch.isfinite(logits).all(dim=-1)
        logits.masked_fill_(bad.unsqueeze(-1), 0.0)
        return bad

    def after(self, bad: Any, logprobs: Any | None) -> None:
        """Mark the flagged rows' ``logprobs`` (``[rows, k]``, or None) NaN; count them."""
        if logprobs is not None and logprobs.shape[0] == bad.shape[0]:
            logprobs.masked_fill_(bad.unsqueeze(-1), float("nan"))
        count = bad.sum()
        if not count.is_cuda:
            self._pending = _Pending(count, None)
            self._report()
            return
        host = torch.empty((), dtype=count.dtype, pin_memory=True)
        host.copy_(count, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._pending = _Pending(host, ready)

    def _report(self) -> None:
        pending = self._pending
        if pending is None or (pending.ready is not None and not pending.ready.query()):
            return
        self._pending = None
        rows = int(pending.count)
        if rows:
            self.flagged_rows += rows
            log_engine_event("nonfinite_logits", rows=rows, total=self.flagged_rows)
