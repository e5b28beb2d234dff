"""What a trainer's ``AdapterHandover.update`` costs its thread, by part.

The swap-cost benchmark's parts put the trainer's copy into its hand-over
buffer at 3-5 ms of every rank-64 hand-over on an H100 and an H200
(``docs/gpu.md``), while the copy itself is a 0.4 ms device-to-device
move. This probe times ``update`` on the GPU without a server, 448 tensors
of the 8B shape at rank 64 (336 MB), three ways:

* ``update``: as it is now (the layout planned only when it changes, the
  copy queued and not waited for);
* ``update + synchronize``: the same, then a device synchronize (what
  ``update`` did until cd63b4c);
* ``replan + synchronize``: the layout planned on every call as well
  (until 8c91a69: one validated model per tensor).

And the same with float32 sources cast by the copy (``dtype="bfloat16"``),
as the RL learners hand their parameters over.

``python scripts/probes/handover_update.py [--rounds N]`` prints, per way,
the median, p90 and max in ms of the calling thread's time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from handover_steps import summary, tensors  # this folder's probe: the 8B adapter's shapes

from skyrl_lora.client import AdapterHandover


def timed(step: Callable[[], None], rounds: int) -> list[float]:
    step()  # the first call allocates the buffer
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1000)
        torch.cuda.synchronize()  # untimed: each round starts with an idle device
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--rank", type=int, default=64)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, rank {args.rank}")
    for source, dtype in (("bfloat16", None), ("float32", "bfloat16")):
        weights = {k: v.to(getattr(torch, source)) for k, v in tensors(args.rank).items()}
        adapter = AdapterHandover({"r": args.rank}, dtype=dtype)

        def update() -> None:
            adapter.update(weights)

        def update_sync() -> None:
            adapter.update(weights)
            torch.cuda.synchronize()

        def replan_sync() -> None:
            adapter._signature = []  # as if the layout were new: planned again
            adapter.update(weights)
            torch.cuda.synchronize()

        mb = sum(t.numel() * 2 for t in weights.values()) / 2**20  # in the bf16 buffer
        print(f"## {len(weights)} {source} tensors into a {dtype or source} buffer ({mb:.0f} MB)")
        for name, step in (
            ("update", update),
            ("update + synchronize", update_sync),
            ("replan + synchronize", replan_sync),
        ):
            print(summary(name, timed(step, args.rounds)))
        adapter.close()


if __name__ == "__main__":
    main()
