"""Adapter weights with a NaN or an infinity are refused, by every route.

On the embedded model's CPU engine, after one sample from a NaN adapter, a
good tenant's next sample came back with every logprob NaN: one tenant's
diverged update spoiled the others. The server now checks a version's
weights before they reach an engine slot (:mod:`skyrl_lora.server.adapters.finite_check`)
and answers 400; the tenant's current version keeps serving, and so does
everyone else.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from skyrl_lora.client import AdapterHandover
from skyrl_lora.errors import BadRequestError
from tests.conftest import EngineServer, counts_by_label
from tests.test_push_engine import admin, sample, words

pytestmark = pytest.mark.engine

__all__ = ["admin"]


def poisoned(server: EngineServer, word: str, name: str, value: float) -> Path:
    """A copy of the ``word`` adapter with one weight set to ``value``."""
    assert server.adapter_root is not None
    folder = server.adapter_root / name
    shutil.copytree(server.model.adapters[word], folder, dirs_exist_ok=True)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key].view(-1)[3] = value
    save_file(tensors, str(weights))
    return folder


def assert_finite(result) -> None:
    for seq in result.sequences:
        assert all(lp is not None and math.isfinite(lp) for lp in seq.logprobs), seq.logprobs


async def good_tenant(admin, server: EngineServer, name: str):
    """Serve the ``meow`` adapter as ``name``; its first greedy sample, checked finite."""
    await admin.load_lora_adapter(name, str(server.model.adapters["meow"]))
    first = await sample(admin, server, name, 16)
    assert_finite(first)
    return first


async def test_non_finite_weights_are_refused_and_the_others_keep_serving(
    engine_server, admin, http
) -> None:
    before = await good_tenant(admin, engine_server, "finite-meow")

    nan_folder = poisoned(engine_server, "woof", "nan-woof", float("nan"))
    inf_folder = poisoned(engine_server, "woof", "inf-woof", float("inf"))
    with pytest.raises(BadRequestError, match="NaN or infinite"):
        await admin.load_lora_adapter("finite-new", str(nan_folder))
    with pytest.raises(BadRequestError, match="NaN or infinite"):
        await admin.push_lora_adapter("finite-new", inf_folder)
    # A reload of a serving tenant: refused, its current version keeps serving.
    with pytest.raises(BadRequestError, match="NaN or infinite"):
        await admin.load_lora_adapter("finite-meow", str(nan_folder))
    config = json.loads((nan_folder / "adapter_config.json").read_text())
    with AdapterHandover(config) as adapter:
        adapter.update(load_file(str(nan_folder / "adapter_model.safetensors")))
        with pytest.raises(BadRequestError, match="NaN or infinite"):
            await admin.push_lora_adapter("finite-meow", adapter)
        # The same trainer's next, finite update goes through.
        woof = Path(engine_server.model.adapters["woof"])
        good = load_file(str(woof / "adapter_model.safetensors"))
        adapter.update(good)
        (info,) = await admin.push_lora_adapter("finite-handed", adapter)
        # Its layout known now, a bad update is built from the layout's
        # template and checked by the template's runs: refused all the same.
        adapter.update(load_file(str(inf_folder / "adapter_model.safetensors")))
        reads = "skyrl_adapter_reads_total"
        counted = await counts_by_label(http, engine_server.url, reads)
        with pytest.raises(BadRequestError, match="NaN or infinite"):
            await admin.push_lora_adapter("finite-handed", adapter)
        # the good update was built from the template (only finished reads count)
        assert counted.get("handover_template", 0) >= 1
        assert await counts_by_label(http, engine_server.url, reads) == counted
    assert info.version == 1

    listing = {a.lora_name: a for a in (await admin.list_adapters()).adapters}
    assert "finite-new" not in listing
    assert listing["finite-meow"].version == 1
    after = await sample(admin, engine_server, "finite-meow", 16)
    assert_finite(after)
    assert after.sequences[0].tokens == before.sequences[0].tokens
    handed = await sample(admin, engine_server, "finite-handed", 16)
    assert_finite(handed)
    assert words(engine_server, handed.sequences[0].tokens) == {"woof"}
