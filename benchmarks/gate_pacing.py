"""The gate's resume pacing, alone: event-loop CPU per engine step, two commits.

After a resume the gate paces the adapter's backlog back in a step's room
at a time (:class:`skyrl_lora.server.engine.gate.ResumePacing`), so the
API process runs the pacing on every engine step while hundreds of
requests wait: a GPU's steps come every few ms. Here ``--waiting``
requests of ``--tokens`` prefill tokens each wait behind a pause; after
the resume, engine steps are signalled back to back until all are in, and
the process CPU that took, less the same steps with nobody waiting, is
divided by the steps. The gate is pure, so ``--base``'s ``gate.py`` (read
with ``git show``) and this tree's run side by side in one process, each
``--rounds`` times alternating; the figure is each side's median.

``python -m benchmarks.gate_pacing [--base REV] [--waiting 256] [--tokens 120]
[--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import uvloop

from benchmarks.common import ROOT, current_commit

GATE = "server/engine/gate.py"


def load_gate(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def _steps(gate: object, n: int) -> None:
    for _ in range(n):
        gate.engine_stepped(running=64)  # type: ignore[attr-defined]
        for _ in range(3):  # the woken waiters run on
            await asyncio.sleep(0)


async def per_step_ms(module: ModuleType, waiting: int, tokens: int) -> tuple[int, float]:
    """Steps the backlog took to get in, and the pacing's CPU ms per step."""
    pacing = module.ResumePacing(tokens_per_step=256, step_wait_s=10.0, window_s=10.0)
    gate = module.AdapterGate(lambda name: 1, pacing=pacing)

    async def abort(ids: object) -> None:
        pass

    await gate.pause("a", abort)
    backlog = [
        asyncio.create_task(gate.admit("a", f"r{i}", prefill_tokens=tokens)) for i in range(waiting)
    ]
    await _steps(gate, 1)
    gate.resume("a")
    await _steps(gate, 0)
    steps = 0
    started = time.process_time()
    while not all(t.done() for t in backlog):
        await _steps(gate, 1)
        steps += 1
    paced = time.process_time() - started
    started = time.process_time()
    await _steps(gate, steps)
    idle = time.process_time() - started
    return steps, (paced - idle) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default="HEAD", help="git revision of the A side")
    parser.add_argument("--waiting", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_path = Path(tmp) / "gate_base.py"
        base_path.write_bytes(
            subprocess.run(
                ["git", "show", f"{args.base}:{GATE}"], cwd=ROOT, check=True, capture_output=True
            ).stdout
        )
        sides = {
            f"base {args.base}": load_gate(base_path, "gate_base"),
            "this tree": load_gate(ROOT / GATE, "gate_tree"),
        }
        figures: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, module in sides.items():
                steps, ms = uvloop.run(per_step_ms(module, args.waiting, args.tokens))
                figures[name].append(ms)
                print(f"{name:>14}: {steps} steps, {ms:.3f} ms CPU a step", flush=True)
    print(f"commit {current_commit()}, {args.waiting} waiting of {args.tokens} tokens:")
    for name, values in figures.items():
        print(f"{name:>14}: {statistics.median(values):.3f} ms CPU a step (median)")


if __name__ == "__main__":
    main()
