"""A/B on the CPU machine: the benchmark's 3-tenant isolation part with slot prefill on and off, alternated (fresh server each).

Usage, from the repository root: .venv/bin/python scripts/probes/slot_prefill_ab.py
"""
import asyncio, json, sys
sys.path.insert(0, ".")
from benchmarks.__main__ import _prompt, cpu_shape
from skyrl_lora.server.cluster.local import embedded_server
from benchmarks import isolation

for label, flags in [("on", []), ("off", ["--no-slot-prefill"]), ("on", []), ("off", ["--no-slot-prefill"])]:
    with embedded_server(extra=["--max-loras", "8", *flags]) as (url, model):
        res = asyncio.run(isolation.run(url, model, _prompt(model), cpu_shape(False).isolation))
        j = res.to_json()
        wins = [(w["mode"][:3], round(w["others_tok_s"])) for w in j["windows"]]
        st = j["stall_ms"]
        row = dict(label=label, ratio=round(j["others_ratio"]["per_adapter"]["median"], 3),
                   base=(round(j["others_tok_s_no_swap"]["min"]), round(j["others_tok_s_no_swap"]["max"])),
                   during_p99=round(st["per_adapter_during_swap"]["p99"]["median"], 1),
                   outside_p99=round(st["per_adapter_outside_swap"]["p99"]["median"], 1),
                   during_max=round(st["per_adapter_during_swap"]["max"]["median"], 1), windows=wins)
        print(json.dumps(row), flush=True)
