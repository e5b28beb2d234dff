"""Where the engine's tokens go in each mode of a GPU RL run (from its JSON alone).

``python3 scripts/probes/rl_engine_split.py docs/gpu/rl_gpu_*.json`` prints,
for each mode of each run: the engine's generated tokens/s over the mode,
outside any swap, and while one tenant swapped alone; the share of the
mode's wall time spent in such swaps; the learners' median training time
per step (they share the GPU with the engine); seconds per step; and the
prompt tokens the engine computed per generated token (re-prefill of
aborted samples). Then, per run, per-adapter over global for the engine's
tokens/s overall and outside swaps (means over each mode's positions).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    for path in sys.argv[1:]:
        run = json.loads(Path(path).read_text())
        print(f"== {path}: {run['commit']}, {run['date']}, {run['machine']}")
        print(f"   {'mode':14s} {'tok/s':>7s} {'outside':>7s} {'lone swaps':>10s} {'swap share':>10s} "
              f"{'train s':>7s} {'s/step':>6s} {'prefill/gen':>11s}")
        modes = run["summary"]["modes"]
        for mode, m in modes.items():
            print(f"   {mode:14s} {m['engine_tok_s']:7.0f} {m['engine_tok_s_outside_swaps']:7.0f} "
                  f"{m['others_tok_s_during_lone_swaps']:10.0f} {m['lone_swap_s'] / m['wall_s']:10.2f} "
                  f"{m['median_over_tenants']['train_s_median']:7.2f} {m['seconds_per_step']:6.2f} "
                  f"{m['engine_prefill']['computed_per_generated']:11.2f}")

        def mean(kind: str, field: str) -> float:
            return statistics.mean(m[field] for name, m in modes.items() if name.split("#")[0] == kind)

        for field in ("engine_tok_s", "engine_tok_s_outside_swaps"):
            print(f"   per_adapter / global, {field}: "
                  f"{mean('per_adapter', field) / mean('global', field):.3f}")


if __name__ == "__main__":
    main()
