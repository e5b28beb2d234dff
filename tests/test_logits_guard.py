"""The logits guard alone: which rows it zeroes, flags and counts (CPU tensors)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from skyrl_lora.server import compat
from skyrl_lora.server.logits_guard import LogitsGuard, _Pending


def test_non_finite_entries_are_zeroed_and_their_rows_flagged_and_counted(caplog) -> None:
    guard = LogitsGuard()
    logits = torch.randn(4, 8)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    good = logits[[0, 3]].clone()
    cleaned = logits[[1, 2]].clone()
    cleaned[0, 3] = cleaned[1, 0] = 0.0
    with caplog.at_level(logging.INFO):
        flagged = guard.before(logits)
        logprobs = torch.zeros(4, 2)
        guard.after(flagged, logprobs)
    assert flagged.tolist() == [False, True, True, False]
    assert torch.equal(logits[[0, 3]], good) and torch.equal(logits[[1, 2]], cleaned)
    assert logprobs[[1, 2]].isnan().all() and not logprobs[[0, 3]].isnan().any()
    assert guard.flagged_rows == 2
    assert any("nonfinite_logits" in r.getMessage() for r in caplog.records)


def test_finite_logits_pass_untouched_and_no_logprobs_is_fine() -> None:
    guard = LogitsGuard()
    logits = torch.randn(3, 8)
    kept = logits.clone()
    guard.after(guard.before(logits), None)
    assert torch.equal(logits, kept) and guard.flagged_rows == 0


def test_a_grammars_mask_is_not_flagged_and_outlives_a_flagged_row() -> None:
    """A structured output's grammar sets the tokens it forbids to -inf
    before the sampler: such a row is not flagged; a NaN row under a mask
    keeps the mask (it samples a token the grammar takes); a row of nothing
    but -inf has no token to sample and is zeroed."""
    guard = LogitsGuard()
    ninf = -torch.inf
    logits = torch.randn(4, 6)
    logits[0, 2:] = ninf  # a grammar's mask over good logits
    logits[1, :3] = float("nan")
    logits[1, 3:] = ninf  # a mask over a diverged adapter's logits
    logits[2] = ninf
    masked = logits[[0, 3]].clone()
    bad = guard.before(logits)
    assert bad.tolist() == [False, True, True, False]
    assert torch.equal(logits[[0, 3]], masked)
    assert logits[1].tolist() == [0.0, 0.0, 0.0, ninf, ninf, ninf]
    assert logits[2].tolist() == [0.0] * 6


class _Sampler:
    """vLLM's sampler as the guard sees it: logits in, logprobs out."""

    marker = "the sampler's own attribute"

    def __call__(self, logits, *rest, **kwargs):
        return SimpleNamespace(logprobs_tensors=SimpleNamespace(logprobs=logits[:, :1].clone()))


def test_the_wrapped_sampler_is_guarded_for_either_calling_convention() -> None:
    runner = SimpleNamespace(sampler=_Sampler())
    assert compat.wrap_sampler(runner, LogitsGuard())
    assert compat.wrap_sampler(runner, LogitsGuard())  # placed again: replaced, not nested
    assert isinstance(runner.sampler.sampler, _Sampler)
    assert runner.sampler.marker == _Sampler.marker
    for call in (
        lambda logits: runner.sampler(logits, "input_batch"),  # 0.26's model runner V2
        lambda logits: runner.sampler(logits=logits, sampling_metadata=None),  # 0.32
    ):
        logits = torch.zeros(2, 4)
        logits[1, 2] = float("nan")
        out = call(logits)
        assert out.logprobs_tensors.logprobs[:, 0].isnan().tolist() == [False, True]
    assert not compat.wrap_sampler(SimpleNamespace(), LogitsGuard())


class _Event:
    """A CUDA event as the guard uses it: recorded, then queried."""

    def __init__(self) -> None:
        self.done = False

    def record(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _QueuedGuard(LogitsGuard):
    """The guard's path for counts on a GPU, with host scalars and fake events."""

    made = 0

    def _new_slot(self) -> _Pending:
        self.made += 1
        return _Pending(torch.zeros((), dtype=torch.int64), _Event())


def test_every_steps_count_is_logged_however_far_the_gpu_runs_behind(caplog) -> None:
    """Counts whose copies are not done yet wait, in order, and are logged
    once done; none is dropped for a newer one, and the pinned scalars and
    events of the logged ones are used again."""
    guard = _QueuedGuard()
    for rows in (2, 3, 4):  # three steps ahead of the GPU
        guard._send(torch.tensor(rows))
    logits = torch.randn(2, 4)
    guard.before(logits)
    assert guard.flagged_rows == 0  # nothing has reached the host
    guard._pending[0].ready.done = guard._pending[1].ready.done = True
    with caplog.at_level(logging.INFO):
        guard.before(logits)
    assert guard.flagged_rows == 5 and len(guard._pending) == 1
    assert any("nonfinite_logits" in r.getMessage() for r in caplog.records)
    guard._send(torch.tensor(1))
    guard._send(torch.tensor(0))
    assert guard.made == 3  # the two logged slots were used again
    for slot in guard._pending:
        slot.ready.done = True
    guard.before(logits)
    assert guard.flagged_rows == 10 and not guard._pending
