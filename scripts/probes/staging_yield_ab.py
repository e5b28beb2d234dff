"""A/B/C on the CPU machine: the benchmark's 3-tenant isolation part with the
defaults, without the staging thread's naps (``serve --no-staging-yield``)
and without the gate's answer pacing (``serve --no-answer-pacing``),
alternated, a fresh server each.

Usage, from the repository root: .venv/bin/python scripts/probes/staging_yield_ab.py
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolation_ab import isolation_row  # noqa: E402

ARMS = [("defaults", []), ("no naps", ["--no-staging-yield"]), ("answers at once", ["--no-answer-pacing"])]
for label, flags in ARMS * 2:
    isolation_row(label, flags, "after_resume_ms")
