"""A/B on the CPU machine: the benchmark's 3-tenant isolation part with the
client releasing a resumed adapter's retries at the server's pace
(``ClientConfig.resume_spacing_s``, the default) and all at once (0),
alternated, a fresh server each.

Usage, from the repository root: .venv/bin/python scripts/probes/resume_spacing_ab.py
"""
import asyncio, functools, json, sys
sys.path.insert(0, ".")
from benchmarks.__main__ import _prompt, cpu_shape
from benchmarks.common import embedded_server
from benchmarks import isolation
from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.client.config import ClientConfig

for label, spacing in [("paced", 0.005), ("at once", 0.0), ("paced", 0.005), ("at once", 0.0)]:
    isolation.RemoteInferenceClient = functools.partial(
        RemoteInferenceClient, config=ClientConfig(resume_spacing_s=spacing)
    )
    with embedded_server(extra=["--max-loras", "8"]) as (url, model):
        res = asyncio.run(isolation.run(url, model, _prompt(model), cpu_shape(False).isolation))
        j = res.to_json()
        st = j["stall_ms"]
        after = [g["after_resume_ms"] for g in j["longest_gaps_during_swaps"][:6]]
        row = dict(label=label, ratio=round(j["others_ratio"]["per_adapter"]["median"], 3),
                   pooled=round(j["others_ratio_pooled"]["per_adapter"], 3),
                   base=(round(j["others_tok_s_no_swap"]["min"]), round(j["others_tok_s_no_swap"]["max"])),
                   during_p99=round(st["per_adapter_during_swap"]["p99"]["median"], 1),
                   outside_p99=round(st["per_adapter_outside_swap"]["p99"]["median"], 1),
                   during_max=round(st["per_adapter_during_swap"]["max"]["median"], 1),
                   outside_max=round(st["per_adapter_outside_swap"]["max"]["median"], 1),
                   longest_after_resume_ms=after)
        print(json.dumps(row), flush=True)
