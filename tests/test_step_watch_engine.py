"""The engine's long-step log on the real engine (``skyrl_lora.server.step_watch``).

A ``--no-ray`` server on the embedded model with ``--long-step-ms 1``: on
two CPU cores nearly every decode step takes longer than that, so one
sample of 64 tokens must leave ``engine_long_step`` events in the server's
log, each with the step's shape read from vLLM's own scheduler output (one
request, one token a step once decoding), and the server must say it
watches.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import requests

from skyrl_lora.server.cluster.process import serving

pytestmark = pytest.mark.engine

_EVENT = re.compile(r'skyrl_event (\{"event": "engine_long_step".*\})')


def test_a_real_engines_long_steps_are_logged_with_their_shape(
    embedded_model: Any, tmp_path: Path
) -> None:
    argv = ["--embedded", "--port", "0", "--no-ray", "--long-step-ms", "1"]
    with serving(argv, tmp_path / "serve.log") as server:
        info = requests.get(f"{server.url}/skyrl/v1/server_info", timeout=30).json()
        assert info["engine_long_step_ms"] == 1
        body = {
            "prompt_token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True},
        }
        reply = requests.post(f"{server.url}/skyrl/v1/sample", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
    steps = [json.loads(m.group(1)) for m in _EVENT.finditer(server.log_path.read_text())]
    assert len(steps) > 10, f"too few long steps logged; see {server.log_path}"
    decoding = [s for s in steps if s["prefill_tokens"] == 0]
    assert decoding, steps[:5]
    for step in decoding:
        assert step["requests"] == 1 and step["tokens"] == 1 and step["new_requests"] == 0
        assert step["ms"] > 1 and step["busy"] == []
