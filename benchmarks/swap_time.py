"""Weight swap time by adapter rank (median, min, max), two ways.

* ``three_calls``: pause, reload in place, resume, as separate calls (the
  trainer holds the adapter for all of it: snapshot, staging and install).
* ``reload_only``: one reload call; the server snapshots and stages the new
  weights while the current version still serves, and pauses the adapter
  only around the install.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.stats import Spread
from skyrl_lora.client import RemoteInferenceClient


def build_rank_adapters(model: Any, ranks: tuple[int, ...]) -> dict[int, list[Path]]:
    """Two random adapters per rank, so each reload really changes the weights."""
    from skyrl_lora.server.embedded.builder import build_babble_adapter

    root = Path(tempfile.mkdtemp(prefix="skyrl-bench-adapters-"))
    return {
        r: [
            build_babble_adapter(model.model_dir, root / f"r{r}-{i}", rank=r, seed=i)
            for i in (1, 2)
        ]
        for r in ranks
    }


@dataclass(frozen=True)
class SwapTimes:
    three_calls: dict[int, Spread]
    reload_only: dict[int, Spread]


async def run(
    url: str,
    model: Any,
    ranks: tuple[int, ...] = (8, 16, 64),
    repeats: int = 6,
    adapters: dict[int, list[Path]] | None = None,
) -> SwapTimes:
    adapters = adapters or build_rank_adapters(model, ranks)
    three: dict[int, Spread] = {}
    single: dict[int, Spread] = {}
    async with RemoteInferenceClient(url) as client:
        for rank, paths in adapters.items():
            name = f"swap-r{rank}"
            await client.load_lora_adapter(name, str(paths[0]))
            times, reload_times = [], []
            for i in range(repeats):
                started = time.perf_counter()
                await client.pause_generation(lora_name=name)
                await client.reload_lora_adapter(name, str(paths[(i + 1) % 2]))
                await client.resume_generation(lora_name=name)
                times.append((time.perf_counter() - started) * 1000)
            for i in range(repeats):
                started = time.perf_counter()
                await client.reload_lora_adapter(name, str(paths[i % 2]))
                reload_times.append((time.perf_counter() - started) * 1000)
            three[rank] = Spread.of(times)
            single[rank] = Spread.of(reload_times)
    return SwapTimes(three, single)
