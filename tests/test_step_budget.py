"""``serve`` cuts vLLM's step budget to the largest CUDA graph on a GPU, unless told.

The flags are parsed by vLLM's own ``vllm serve`` parser plus ours, so a
renamed vLLM flag fails here rather than leaving the budget silently unset.
(A real CPU engine reports its budget in ``server_info``:
``tests/test_step_watch_engine.py``; the cut itself ran on H100s, docs/gpu.md.)
"""

from __future__ import annotations

import pytest

from skyrl_lora.server.engine.step_budget import StepBudget, graph_step_budget
from skyrl_lora.server.http.app import parse_server_args


def _budget(*flags: str, on_cpu: bool = False) -> StepBudget | None:
    return graph_step_budget(parse_server_args(["--model", "unused", *flags]), on_cpu=on_cpu)


def test_a_gpu_gets_steps_the_size_of_the_largest_graph() -> None:
    assert _budget() == StepBudget(max_num_batched_tokens=512, max_num_seqs=512)


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-cudagraph-capture-size", "256"],
        ["-cc.max_cudagraph_capture_size=256"],
    ],
)
def test_the_budget_follows_a_graph_size_the_user_chose(flags: list[str]) -> None:
    assert _budget(*flags) == StepBudget(max_num_batched_tokens=256, max_num_seqs=256)


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-num-batched-tokens", "4096"],
        ["--max-num-seqs", "64"],
        ["--enforce-eager"],
        ["--no-enable-chunked-prefill"],
        ["--no-graph-step-budget"],
    ],
)
def test_a_budget_the_user_chose_or_needs_is_left_alone(flags: list[str]) -> None:
    assert _budget(*flags) is None


def test_a_cpu_engine_keeps_vllms_budget() -> None:
    assert _budget(on_cpu=True) is None
    args = parse_server_args(["--model", "unused"])  # this machine's vLLM runs on the CPU
    assert args.max_num_batched_tokens is None and args.max_num_seqs is None
    assert args.graph_step_budget_set is False
