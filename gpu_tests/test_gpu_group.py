"""The replica group on GPUs: one replica per GPU, on a local Ray instance.

``ServerGroup`` reserves ``gpus_per_replica`` GPUs per replica in a Ray
placement group; Ray hands each replica's actor its own device
(``CUDA_VISIBLE_DEVICES``), and the actor's ``serve`` inherits it. These
tests run the CPU group tests' scenarios (``tests/test_group_engine.py``,
whose helpers they import) on two GPUs: each replica on a GPU of its own,
a push to the host streamed once and loaded from that one copy by the
other replica, a per-adapter pause across replicas that leaves the other
adapters running, and an engine SIGKILLed under load healed with every
adapter at its version and no sample lost.

Skipped with the reason below 2 GPUs or without Ray (the lent machines get
Ray's wheels among the stash's parts, ``scripts/gpu_prepare.sh``). The
embedded model in bfloat16, so each adapter still says its one word.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from gpu_tests.conftest import GPU_FLAGS
from skyrl_lora.client import RemoteInferenceClient
from tests.test_group_engine import (
    converged,
    greedy,
    pause_leaves_the_others_running,
    pushed_bytes,
    text,
    wait_everywhere,
)

#: Long enough that samples are still running on the GPU when a pause or a kill lands.
LONG = int(os.environ.get("SKYRL_TEST_LONG", "900"))
REPLICAS = 2


def _why_not() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (scripts/gpu_prepare.sh adds its wheels to the stash)"
    import torch

    if torch.cuda.device_count() < REPLICAS:
        return f"{torch.cuda.device_count()} GPU(s); the group tests need {REPLICAS}"
    return None


_WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


@pytest.fixture(scope="module")
def gpu_group(embedded_model: Any) -> Iterator[Any]:
    import ray

    from skyrl_lora.server.cluster.group import GroupConfig, ServerGroup
    from skyrl_lora.server.presets import embedded_server_argv

    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    dtype = os.environ.get("SKYRL_GPU_DTYPE", "bfloat16")
    config = GroupConfig(
        num_replicas=REPLICAS,
        argv=embedded_server_argv(embedded_model, extra=[*GPU_FLAGS, "--dtype", dtype]),
        gpus_per_replica=1,
        health_interval_s=0.5,
    )
    try:
        with ServerGroup(config) as group:
            yield group
    finally:
        ray.shutdown()


def gpus_in_use() -> set[str]:
    """The GPUs (by UUID) that hold a compute process now."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def test_each_replica_serves_from_a_gpu_of_its_own(gpu_group: Any) -> None:
    assert len(set(gpu_group.urls)) == REPLICAS
    assert len(gpus_in_use()) >= REPLICAS, "both engines on one GPU"


async def test_a_push_to_the_host_moves_its_bytes_once_and_every_gpu_serves_it(
    gpu_group: Any, embedded_model: Any, tokenizer: Any
) -> None:
    """The client streams the push to one replica; the other loads it from
    that replica's receive area on the same host (``adapters/push/shared``).
    Both GPUs then serve it, token for token."""
    adapters = embedded_model.adapters
    size = (adapters["moo"] / "adapter_model.safetensors").stat().st_size
    prompt = tokenizer.encode("hello", add_special_tokens=False)
    before = [await pushed_bytes(url) for url in gpu_group.urls]
    async with RemoteInferenceClient(gpu_group.urls) as client:
        infos = await client.push_lora_adapter("gg-pushed", adapters["moo"])
        assert [i.version for i in infos] == [1] * REPLICAS
        outs = []
        for url in gpu_group.urls:
            async with RemoteInferenceClient(url) as one:
                outs.append(
                    await one.sample(prompt, sampling_params=greedy(8), lora_name="gg-pushed")
                )
        assert all(text(tokenizer, o) == ["moo"] * 8 for o in outs)
        assert len({tuple(o.sequences[0].tokens) for o in outs}) == 1
    after = [await pushed_bytes(url) for url in gpu_group.urls]
    streamed = sum(a.get("stream", 0.0) - b.get("stream", 0.0) for a, b in zip(after, before))
    shared = sum(a.get("host_share", 0.0) - b.get("host_share", 0.0) for a, b in zip(after, before))
    assert (streamed, shared) == (size, (REPLICAS - 1) * size)


async def test_a_pause_on_every_gpu_leaves_the_other_adapters_running(
    gpu_group: Any, embedded_model: Any, tokenizer: Any
) -> None:
    await pause_leaves_the_others_running(
        gpu_group.urls, embedded_model, tokenizer, "gg", length=LONG
    )


async def test_an_engine_killed_under_load_heals_and_loses_no_sample(
    gpu_group: Any, embedded_model: Any, tokenizer: Any
) -> None:
    """SIGKILL of replica 0's engine process while four tenants sample on
    both GPUs: every sample completes whole, with its tenant's word; the
    group rebuilds the replica on its GPU with every adapter, and it serves."""
    words = ("moo", "woof", "meow", "quack")
    prompt = tokenizer.encode("hello there", add_special_tokens=False)
    async with RemoteInferenceClient(gpu_group.urls) as client:
        for word in words:
            await client.load_lora_adapter(f"gk-{word}", str(embedded_model.adapters[word]))
        tasks = {
            word: [
                asyncio.create_task(
                    client.sample_with_retry(
                        prompt, sampling_params=greedy(LONG), lora_name=f"gk-{word}"
                    )
                )
                for _ in range(4)
            ]
            for word in words
        }
        await wait_everywhere(client, "gk-moo")
        restarts_before = len(gpu_group.restarts)
        assert await asyncio.to_thread(gpu_group.kill_engine, 0), "no engine process to kill"
        for word, started in tasks.items():
            for r in await asyncio.wait_for(asyncio.gather(*started), 300):
                (seq,) = r.sequences
                assert len(seq.tokens) == LONG and len(seq.logprobs) == LONG
                assert text(tokenizer, r) == [word] * LONG
        restarts = await asyncio.to_thread(gpu_group.wait_restarts, restarts_before + 1, 600)
        assert restarts[-1].index == 0
        await converged(client)
        async with RemoteInferenceClient(gpu_group.urls[0]) as rebuilt:
            for word in words:
                out = await rebuilt.sample(
                    prompt, sampling_params=greedy(4), lora_name=f"gk-{word}"
                )
                assert text(tokenizer, out) == [word] * 4
    assert len(gpus_in_use()) >= REPLICAS
