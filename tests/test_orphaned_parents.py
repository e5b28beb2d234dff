"""vLLM 0.26 leaks a parallel-sampling parent when its children are aborted by
the submitted id; :func:`compat.abort_requests` cleans up after it. The leak
itself was seen on CUDA vLLM 0.26 (docs/gpu.md); these fakes pin the rule."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from skyrl_lora.server import compat


@dataclass
class _Parent:
    child_requests: set[str]


@dataclass
class _Processor:
    request_states: dict[str, object] = field(default_factory=dict)
    parent_requests: dict[str, _Parent] = field(default_factory=dict)


class _Engine:
    """Aborts as vLLM 0.26 does for an id a parallel sample was submitted with:
    the children go, the parent stays."""

    def __init__(self) -> None:
        self.output_processor = _Processor()

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for child in [
                c for c in self.output_processor.request_states if c.endswith(request_id)
            ]:
                del self.output_processor.request_states[child]


def _submit(engine: _Engine, request_id: str, n: int) -> None:
    children = {f"{i}_{request_id}" for i in range(n)}
    engine.output_processor.parent_requests[f"parent-{request_id}"] = _Parent(children)
    engine.output_processor.request_states.update(dict.fromkeys(children))


def test_an_abort_leaves_no_parent_of_the_aborted_samples_and_keeps_the_others() -> None:
    engine = _Engine()
    _submit(engine, "a", 4)
    _submit(engine, "b", 4)
    asyncio.run(compat.abort_requests(engine, ["a"]))
    assert list(engine.output_processor.parent_requests) == ["parent-b"]
    assert len(engine.output_processor.request_states) == 4


def test_a_parent_with_one_child_still_running_is_kept() -> None:
    engine = _Engine()
    _submit(engine, "a", 2)
    del engine.output_processor.request_states["0_a"]  # one child finished
    assert compat.forget_orphaned_parents(engine) == 0
    del engine.output_processor.request_states["1_a"]
    assert compat.forget_orphaned_parents(engine) == 1
    assert engine.output_processor.parent_requests == {}


def test_an_engine_without_the_tables_is_left_alone() -> None:
    assert compat.forget_orphaned_parents(object()) == 0
