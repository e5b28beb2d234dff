"""A/B on the CPU machine: the benchmark's 3-tenant isolation part with the
gate's answer pacing (the default) and without (``serve --no-answer-pacing``),
alternated, a fresh server each.

Usage, from the repository root: .venv/bin/python scripts/probes/answer_pacing_ab.py
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolation_ab import isolation_row  # noqa: E402

for label, flags in [("paced", []), ("at once", ["--no-answer-pacing"])] * 2:
    isolation_row(label, flags, "after_pause_ms")
