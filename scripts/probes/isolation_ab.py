"""The CPU benchmark's 3-tenant isolation part on a fresh embedded server,
summarised as one JSON row (used by staging_yield_ab.py)."""
import asyncio, json, sys
sys.path.insert(0, ".")
from benchmarks.__main__ import cpu_shape
from benchmarks.common import greeting_prompt
from skyrl_lora.server.cluster.local import embedded_server
from benchmarks import isolation


def isolation_row(label: str, flags: list[str], placed_by: str) -> None:
    """Serve with ``flags``, run the part, print its row; ``placed_by`` is the
    longest gaps' placement to list (``after_pause_ms`` or ``after_resume_ms``)."""
    with embedded_server(extra=["--max-loras", "8", *flags]) as (url, model):
        res = asyncio.run(isolation.run(url, model, greeting_prompt(model), cpu_shape(False).isolation))
    j = res.to_json()
    st = j["stall_ms"]
    row = dict(label=label, ratio=round(j["others_ratio"]["per_adapter"]["median"], 3),
               pooled=round(j["others_ratio_pooled"]["per_adapter"], 3),
               base=(round(j["others_tok_s_no_swap"]["min"]), round(j["others_tok_s_no_swap"]["max"])),
               during_p99=round(st["per_adapter_during_swap"]["p99"]["median"], 1),
               outside_p99=round(st["per_adapter_outside_swap"]["p99"]["median"], 1),
               during_max=round(st["per_adapter_during_swap"]["max"]["median"], 1),
               outside_max=round(st["per_adapter_outside_swap"]["max"]["median"], 1),
               **{f"longest_{placed_by}": [g[placed_by] for g in j["longest_gaps_during_swaps"][:6]]})
    print(json.dumps(row), flush=True)
