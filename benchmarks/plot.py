"""The isolation plot: per-tenant tokens/s over time in the first round's windows."""

from __future__ import annotations

from pathlib import Path

from benchmarks.isolation import IsolationResult

BIN_S = 0.25
SMOOTH_BINS = 4  # a 1 s moving average: raw bins are spiky

TITLES = {
    "no_swap": "no swap",
    "per_adapter": "per-adapter pause (skyrl-lora)",
    "global": "global keep-mode pause",
}


def _smooth(values: list[float]) -> list[float]:
    return [
        sum(values[max(0, i - SMOOTH_BINS + 1) : i + 1]) / min(i + 1, SMOOTH_BINS)
        for i in range(len(values))
    ]


def plot(res: IsolationResult, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [w for w in res.windows if w.round == 0]
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 4), sharey=True)
    swapper = res.config.names[0]
    ratios = {m: res.per_round(m)[0] for m in ("per_adapter", "global")}
    for ax, w in zip(axes, shown):
        bins = [w.start + i * BIN_S for i in range(int((w.end - w.start) / BIN_S))]
        x = [b - w.start for b in bins]
        a = [res.swapper.rate([swapper], b, b + BIN_S) for b in bins]
        ax.plot(x, _smooth(a), "--", label=f"{swapper} (swapping)")
        for tenant in res.others:
            rates = [tenant.rate(b, b + BIN_S) for b in bins]
            ax.plot(x, _smooth(rates), label=tenant.streams.tenant)
        for start, end in w.swaps:
            ax.axvspan(start - w.start, end - w.start, color="grey", alpha=0.25)
        title = TITLES[w.mode]
        if w.mode in ratios:
            title += f": others {ratios[w.mode]:.2f}x"
        ax.set_title(title)
        ax.set_xlabel(f"seconds (grey: {swapper} swapping)")
    axes[0].set_ylabel("tokens/s (1 s average)")
    axes[0].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
