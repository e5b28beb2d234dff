"""vLLM 0.26's GPU sampler on a row of NaN, without and with the logits guard.

The Gumbel sampler takes its arg-max over 1024-wide blocks; past the
vocabulary the lanes hold -inf, and a row of NaN can pick one of them: a
token id the embedding cannot look up at the next step (a device-side
assert that kills the engine). The guard's ``before`` zeroes such rows, so
every sampled id is inside the vocabulary; its ``after`` marks their
logprobs NaN. No server; a second.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.sample import gumbel

from skyrl_lora.server.logits_guard import LogitsGuard

VOCAB = 256  # the perf models' vocabulary: a quarter of one 1024-wide block
ROWS = 64


def sample(logits: torch.Tensor) -> torch.Tensor:
    rows = logits.shape[0]
    return gumbel.gumbel_sample(
        logits,
        torch.arange(rows, dtype=torch.int32, device="cuda"),
        torch.ones(rows, dtype=torch.float32, device="cuda"),
        torch.arange(rows, dtype=torch.int64, device="cuda"),
        torch.zeros(rows, dtype=torch.int64, device="cuda"),
        apply_temperature=True,
    )


def test_nan_rows_draw_outside_the_vocabulary_unless_guarded() -> None:
    logits = torch.randn(ROWS, VOCAB, device="cuda")
    logits[1::2] = float("nan")
    unguarded = sample(logits.clone())
    assert bool((unguarded[1::2] >= VOCAB).any()), "the hazard did not reproduce"
    assert bool((unguarded[0::2] < VOCAB).all())

    guard = LogitsGuard()
    guarded_logits = logits.clone()
    flagged = guard.before(guarded_logits)
    guarded = sample(guarded_logits)
    assert bool(((guarded >= 0) & (guarded < VOCAB)).all())
    assert flagged.tolist() == [i % 2 == 1 for i in range(ROWS)]
    assert torch.equal(guarded[0::2], unguarded[0::2])  # good rows: the same draw

    logprobs = torch.zeros(ROWS, 1, device="cuda")
    guard.after(flagged, logprobs)
    torch.cuda.synchronize()
    assert bool(logprobs[1::2].isnan().all()) and bool((logprobs[0::2] == 0).all())
