"""The isolation plot: per-tenant tokens/s over time, per-adapter versus global pause."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import TokenMeter
from benchmarks.isolation import TENANTS, Phase

TENANTS_SWAPPING = "iso-a"

BIN_S = 0.25
SMOOTH_BINS = 4  # a 1 s moving average: samples complete in waves, raw bins are spiky


def plot(phases: list[Phase], meter: TokenMeter, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [p for p in phases if p.name != "no_swap"]
    fig, axes = plt.subplots(1, len(shown), figsize=(12, 4), sharey=True)
    titles = {"per_adapter": "per-adapter pause (skyrl-lora)", "global": "global keep-mode pause"}
    for ax, phase in zip(axes, shown):
        bins = int((phase.end - phase.start) / BIN_S)
        for tenant in TENANTS:
            counts = [
                meter.rate([tenant], phase.start + i * BIN_S, phase.start + (i + 1) * BIN_S)
                for i in range(bins)
            ]
            smooth = [
                sum(counts[max(0, i - SMOOTH_BINS + 1) : i + 1]) / min(i + 1, SMOOTH_BINS)
                for i in range(bins)
            ]
            style = "--" if tenant == TENANTS_SWAPPING else "-"
            ax.plot([i * BIN_S for i in range(bins)], smooth, style, label=tenant)
        for a, b in phase.windows:
            ax.axvspan(a - phase.start, b - phase.start, color="grey", alpha=0.25)
        ax.set_title(
            f"{titles[phase.name]}: others at {phase.others_rate / phases[0].others_rate:.2f}x"
        )
        ax.set_xlabel("seconds (grey: iso-a swapping)")
    axes[0].set_ylabel("tokens/s (1 s average)")
    axes[0].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
