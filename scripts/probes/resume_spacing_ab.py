"""A/B on the CPU machine: the benchmark's 3-tenant isolation part with the
client releasing a resumed adapter's retries at the server's pace
(``ClientConfig.resume_spacing_s``, the default) and all at once (0),
alternated, a fresh server each.

Usage, from the repository root: .venv/bin/python scripts/probes/resume_spacing_ab.py
"""
import functools, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolation_ab import isolation, isolation_row  # noqa: E402  (isolation: the module the row runs)
from skyrl_lora.client import RemoteInferenceClient  # noqa: E402
from skyrl_lora.client.config import ClientConfig  # noqa: E402

for label, spacing in [("paced", 0.005), ("at once", 0.0)] * 2:
    isolation.RemoteInferenceClient = functools.partial(
        RemoteInferenceClient, config=ClientConfig(resume_spacing_s=spacing)
    )
    isolation_row(label, [], "after_resume_ms")
