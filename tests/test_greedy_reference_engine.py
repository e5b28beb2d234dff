"""The float32 reference (``benchmarks.greedy_reference``) against the real CPU engine.

The GPU servers' first greedy tokens are judged against this reference
(``benchmarks.engine_rate --reference``), so it must itself be right. The
embedded model runs in float32 on the CPU build: there the engine, base
model and adapter alike, must match the reference to rounding, and the
adapter must move the reference far past that tolerance (a reference that
dropped the adapter, or a server that did, would fail).
"""

from __future__ import annotations

import aiohttp
import pytest

from benchmarks.greedy_reference import distance, first_token_logprobs, served_first_token
from tests.conftest import EngineServer

pytestmark = pytest.mark.engine

ADAPTER = "moo"
#: float32 on both sides; the two only sum in different orders.
TOLERANCE = 1e-3


async def test_the_cpu_engine_matches_the_float32_reference(engine_server: EngineServer) -> None:
    model = engine_server.model
    prompt = engine_server.encode("the farmer saw a big cow and the cow")
    reference = first_token_logprobs(model.model_dir, prompt, model.adapters[ADAPTER], top=5)
    moved = distance(reference["base"], reference["adapter"])
    assert moved["max_abs_gap"] > 100 * TOLERANCE or moved["shared"] < 3, moved
    headers = {"Authorization": f"Bearer {engine_server.admin_key}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for name, want in (("tiny-llama", reference["base"]), (ADAPTER, reference["adapter"])):
            tokens, first_logprob, top = await served_first_token(
                session, engine_server.url, name, prompt, top=5, max_tokens=2
            )
            gap = distance(want, top)
            assert gap["served_top"] == gap["reference_top"] == tokens[0], (name, gap)
            assert gap["shared"] >= 4 and gap["max_abs_gap"] <= TOLERANCE, (name, gap)
            assert abs(first_logprob - want[tokens[0]]) <= TOLERANCE, name
