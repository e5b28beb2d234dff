"""A stand-in for vLLM's engine core that steps at a GPU's pace, for loading
the API process on the CPU machine.

On a GPU the API process (our routes and vLLM's ``AsyncLLM`` front end, one
event loop) hands out every running request's token each step, tens of steps
a second; the embedded model on the CPU steps far slower, so the host work
per token never adds up to what a GPU run sees (event-loop stalls, long
garbage collections). ``python -m benchmarks.fast_engine --step-ms 25 --
SERVE_ARGS`` runs ``skyrl-lora serve`` (``--vllm``: vLLM's own OpenAI
server, its arguments after ``--``) with the engine core client's request
calls answered here: each running request gets one token (with its logprob
where asked) every ``step_ms``, finishing at its ``max_tokens``; aborts drop
it. Everything else (adapter loads, utility calls) still goes to the real
engine core, which sits idle. What this measures is the API process only:
the front end's per-token work, ours, and the collector's.

It patches vLLM 0.32's ``AsyncMPClient`` (``get_output_async``,
``add_request_async``, ``abort_requests_async``): a benchmark harness for
the CPU build, never part of the server.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

#: Token ids the stand-in samples, cycled: inside the embedded model's vocabulary (256).
FIRST_TOKEN, TOKEN_SPAN = 10, 200


@dataclass
class _Running:
    request_id: str
    max_tokens: int
    logprobs: bool
    made: int = 0


@dataclass
class StandInCore:
    """The engine core's request side: ``step_s`` apart, one token for each running request."""

    step_s: float
    running: dict[str, _Running] = field(default_factory=dict)
    _next_step: float = 0.0
    _steps: int = 0

    def add(self, request: Any) -> None:
        params = request.sampling_params
        self.running[request.request_id] = _Running(
            request.request_id, int(params.max_tokens or 16), params.logprobs is not None
        )

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    async def step(self) -> Any:
        import numpy as np
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.metrics.stats import SchedulerStats
        from vllm.v1.outputs import LogprobsLists

        while True:  # an engine with nothing to run sends nothing
            now = time.monotonic()
            self._next_step = max(self._next_step + self.step_s, now)
            await asyncio.sleep(self._next_step - now)
            if self.running:
                break
        self._steps += 1
        outputs = []
        for req in list(self.running.values()):
            token = FIRST_TOKEN + (req.made + self._steps) % TOKEN_SPAN
            req.made += 1
            done = req.made >= req.max_tokens
            logprobs = (
                LogprobsLists(
                    np.array([[token]], dtype=np.int32),
                    np.array([[-0.5]], dtype=np.float32),
                    np.array([1], dtype=np.int32),
                )
                if req.logprobs
                else None
            )
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[token],
                    new_logprobs=logprobs,
                    finish_reason=FinishReason.LENGTH if done else None,
                )
            )
            if done:
                del self.running[req.request_id]
        stats = SchedulerStats(num_running_reqs=len(outputs), step_counter=self._steps)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())


def install(step_s: float) -> StandInCore:
    """Answer the engine core client's request calls from a :class:`StandInCore`."""
    from vllm.v1.engine.core_client import AsyncMPClient

    core = StandInCore(step_s)

    async def get_output_async(self: Any) -> Any:
        return await core.step()

    async def add_request_async(self: Any, request: Any) -> None:
        core.add(request)

    async def abort_requests_async(self: Any, request_ids: list[str]) -> None:
        core.abort(request_ids)

    AsyncMPClient.get_output_async = get_output_async  # type: ignore[method-assign]
    AsyncMPClient.add_request_async = add_request_async  # type: ignore[method-assign]
    AsyncMPClient.abort_requests_async = abort_requests_async  # type: ignore[method-assign]
    return core


def main() -> None:
    """``python -m benchmarks.fast_engine --step-ms MS [--vllm] -- SERVER_ARGS``."""
    args = sys.argv[1:]
    step_ms = 25.0
    if args[:1] == ["--step-ms"]:
        step_ms, args = float(args[1]), args[2:]
    plain = args[:1] == ["--vllm"]
    if plain:
        args = args[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    install(step_ms / 1000)
    if plain:
        import runpy

        sys.argv = ["vllm.entrypoints.openai.api_server", *args]
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
        return
    from skyrl_lora.server.cli import main as serve

    sys.exit(serve(["serve", *args]))


if __name__ == "__main__":
    main()
