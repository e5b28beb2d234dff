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

* before sampling, a row with any NaN or +infinity, or nothing but
  -infinity, is flagged; its NaN and +infinity become zeros (a row of
  nothing but -infinity, all zeros), so it samples inside the vocabulary
  and cannot take the engine down. Its -infinity entries stay: they are a
  mask (a structured output's grammar, applied before the sampler, sets
  every token it forbids to -infinity), and a row that kept its mask
  samples a token the grammar takes, where a zeroed one drew a token the
  grammar refused and vLLM ended the request with an internal error. A
  row of finite logits under a mask is never flagged;
* after, that row's logprobs are set to NaN, so the sample route sees
  which samples had no meaning and refuses them
  (:class:`skyrl_lora.errors.NonFiniteLogitsError`) instead of returning
  tokens drawn at random;
* the rows are counted without a sync and logged as ``nonfinite_logits``
  engine events once the count reaches the host: each step's count is kept
  until then, however far the GPU runs behind (a count not ready by the
  next step used to be dropped), in one of a few pinned scalars and events
  reused from step to step rather than made anew.

One reduction, one in-place clean-up and one masked fill over the logits
per step, no host sync.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from .telemetry.observability import log_engine_event


@dataclass
class _Pending:
    """A step's count of flagged rows on its way to the host: a pinned scalar
    and the CUDA event after its copy (both reused once the count is read)."""

    count: Any
    ready: Any


class LogitsGuard:
    """Sanitizes and flags non-finite rows; see the module's docstring."""

    def __init__(self) -> None:
        self.flagged_rows = 0
        self._pending: deque[_Pending] = deque()  # oldest first
        self._spare: list[_Pending] = []

    def before(self, logits: Any) -> Any:
        """Make the non-finite rows of ``logits`` samplable in place (NaN and
        +inf to zero, a mask's -inf kept; a row of nothing but -inf all
        zeros); the rows' flags, ``[rows]``."""
        self._report()
        # A row's largest logit is NaN where any is, +inf where any is, and
        # -inf where all are: one reduction finds every row to flag, and
        # passes a mask's -inf in rows that have anything else.
        peak = logits.amax(dim=-1)
        bad = ~torch.isfinite(peak)
        # Rows without NaN or +inf (every unflagged one) are left as they are.
        logits.nan_to_num_(nan=0.0, posinf=0.0, neginf=-torch.inf)
        logits.masked_fill_((peak == -torch.inf).unsqueeze(-1), 0.0)
        return bad

    def after(self, bad: Any, logprobs: Any | None) -> None:
        """Mark the flagged rows' ``logprobs`` (``[rows, k]``, or None) NaN; count them."""
        if logprobs is not None and logprobs.shape[0] == bad.shape[0]:
            logprobs.masked_fill_(bad.unsqueeze(-1), float("nan"))
        count = bad.sum()
        if count.is_cuda:
            self._send(count)
        else:
            self._log(int(count))

    def _send(self, count: Any) -> None:
        """Start ``count``'s copy to the host, behind the step's work."""
        slot = self._spare.pop() if self._spare else self._new_slot()
        slot.count.copy_(count, non_blocking=True)
        slot.ready.record()
        self._pending.append(slot)

    def _new_slot(self) -> _Pending:
        return _Pending(torch.empty((), dtype=torch.int64, pin_memory=True), torch.cuda.Event())

    def _report(self) -> None:
        """Log the counts that have reached the host, oldest first."""
        rows = 0
        while self._pending and self._pending[0].ready.query():
            slot = self._pending.popleft()
            rows += int(slot.count)
            self._spare.append(slot)
        self._log(rows)

    def _log(self, rows: int) -> None:
        if rows:
            self.flagged_rows += rows
            log_engine_event("nonfinite_logits", rows=rows, total=self.flagged_rows)
