"""The engine's step budget on a GPU: every step small enough for a CUDA graph.

vLLM runs a step in a captured CUDA graph only when its tokens fit the
largest graph (512 on Hopper and older). Its default budget lets a step
take thousands of tokens, and such a step runs eagerly, several times
slower per token. In multi-tenant RL those steps are common: every weight
sync aborts a tenant's requests, and they come back to re-prefill their
prompt and the tokens they had generated, beside everybody's decodes.

Cutting the budget to the largest graph (``--max-num-batched-tokens 512
--max-num-seqs 512``; vLLM refuses a token budget below its sequence
limit) was measured on an H100 (docs/gpu.md, 0b36222 and db2dbc1):
RL engines ran 1.11-1.39x faster in both pause modes, four pairings out
of four; a decoding batch beside a stream of fresh 1,536-token prompts
generated 1.50x the tokens a second (1.30-1.64x over 4 rounds), and
those prompts' first token came 1.20x later at the median (88 -> 110 ms)
and 1.17x at the p99. For the throughput users of this server that is
the better default, so ``serve`` sets it on a GPU unless the user chose
a budget or a sequence limit (either flag), runs eagerly, or turns
chunked prefill off (a budget below the model length then refuses
long prompts). ``--no-graph-step-budget`` keeps vLLM's own.

Pure: reads the parsed ``vllm serve`` flags, returns what to set.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: vLLM's largest captured CUDA graph by default, in tokens (Hopper and
#: older; Blackwell's is 1024, so the cut fits its graphs too).
DEFAULT_GRAPH_TOKENS = 512


@dataclass(frozen=True)
class StepBudget:
    """What one engine step may hold."""

    max_num_batched_tokens: int
    max_num_seqs: int


def graph_step_budget(args: argparse.Namespace, *, on_cpu: bool) -> StepBudget | None:
    """The budget ``serve`` sets, or None to leave vLLM's own.

    ``args`` are the parsed ``vllm serve`` flags plus ours
    (``graph_step_budget``, False with ``--no-graph-step-budget``).
    """
    if on_cpu or not getattr(args, "graph_step_budget", True):
        return None
    chosen = (getattr(args, flag, None) for flag in ("max_num_batched_tokens", "max_num_seqs"))
    if any(value is not None for value in chosen):
        return None
    eager = getattr(args, "enforce_eager", False)
    if eager or getattr(args, "enable_chunked_prefill", None) is False:
        return None
    tokens = _capture_size(args) or DEFAULT_GRAPH_TOKENS
    return StepBudget(max_num_batched_tokens=tokens, max_num_seqs=tokens)


def _capture_size(args: argparse.Namespace) -> int | None:
    """The largest graph the user asked vLLM to capture, if any
    (``--max-cudagraph-capture-size`` or ``-cc.max_cudagraph_capture_size``)."""
    config = getattr(args, "compilation_config", None)
    size = getattr(args, "max_cudagraph_capture_size", None) or getattr(
        config, "max_cudagraph_capture_size", None
    )
    return int(size) if size else None
