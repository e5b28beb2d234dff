"""On a GPU, ``serve`` cuts vLLM's step budget to the largest CUDA graph by itself.

The CPU suite checks the rule on parsed flags (``tests/test_step_budget.py``)
and that a CPU engine keeps vLLM's budget. Here the CUDA scenario server,
started without any budget flag, reports the cut as vLLM applied it, and a
prompt longer than one step's budget is still answered in full (vLLM
chunks its prefill over several steps), the same greedy tokens twice.
"""

from __future__ import annotations

from typing import Any

import requests

from skyrl_lora.server.engine.step_budget import DEFAULT_GRAPH_TOKENS

#: Longer than a step's budget: its prefill takes two steps at least.
LONG_PROMPT_TOKENS = DEFAULT_GRAPH_TOKENS + 200


def test_a_gpu_server_steps_no_more_than_its_largest_graph(engine_server: Any) -> None:
    info = requests.get(f"{engine_server.url}/skyrl/v1/server_info", timeout=30).json()
    assert info["graph_step_budget"] is True
    assert info["engine_step_tokens"] == DEFAULT_GRAPH_TOKENS
    assert info["engine_step_sequences"] == DEFAULT_GRAPH_TOKENS
    prompt = [4 + i % 250 for i in range(LONG_PROMPT_TOKENS)]  # plain words, no specials
    body = {
        "prompt_token_ids": prompt,
        "sampling_params": {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    }
    answers = []
    for _ in range(2):
        reply = requests.post(f"{engine_server.url}/skyrl/v1/sample", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        (sequence,) = reply.json()["sequences"]
        assert len(sequence["tokens"]) == 16
        answers.append(sequence["tokens"])
    assert answers[0] == answers[1]
