"""The client's side of versions: explicit versions on a fan-out, pinned samples never move."""

from __future__ import annotations

import pytest
from aiohttp import web

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import FanOutError, PayloadTooLargeError, VersionGoneError
from tests.fake_server import FakeServer, answer, seq

PROMPT = [11, 12, 13]


async def test_a_fan_out_load_sends_one_version_past_the_newest_replica() -> None:
    async with FakeServer() as s1, FakeServer() as s2:
        s1.versions, s2.versions = {"a": 3, "b": 9}, {"a": 2}
        async with RemoteInferenceClient([s1.url, s2.url]) as client:
            loaded = await client.load_lora_adapter("a", "/w")
            assert loaded.version == 4 and loaded.consistent
            await client.load_lora_adapter("a", "/w", version=12)
            await client.load_lora_adapter("new", "/w")
        for s in (s1, s2):
            loads = [body for name, body in s.controls if name == "adapters/load"]
            assert [body["version"] for body in loads] == [4, 12, None]
            assert {body["keep_previous_s"] for body in loads} == {600.0}
            commits = [body for name, body in s.controls if name == "adapters/commit"]
            assert [body["version"] for body in commits] == [4, 12, 1]


async def test_a_fan_out_load_one_server_refuses_is_rolled_back_on_the_others() -> None:
    async with FakeServer() as s1, FakeServer() as s2:
        s1.versions = s2.versions = {"a": 3}
        s2.refuse_loads = "larger than the server's limit"
        async with RemoteInferenceClient([s1.url, s2.url]) as client:
            with pytest.raises(FanOutError) as caught:
                await client.load_lora_adapter("a", "/w")
        assert list(caught.value.failures) == [s2.url]
        assert isinstance(caught.value.failures[s2.url], PayloadTooLargeError)
        assert "rolled back" in str(caught.value)
        assert [name for name, _ in s1.controls] == ["adapters/load", "adapters/rollback"]
        assert s1.controls[1][1] == {"lora_name": "a", "version": 4}
        assert [name for name, _ in s2.controls] == ["adapters/load"]


async def test_a_replica_that_does_not_answer_leaves_the_version_to_the_others() -> None:
    async with FakeServer() as s1:
        s1.versions = {"a": 3}
        dead = FakeServer()
        async with dead:
            dead_url = dead.url
        async with RemoteInferenceClient([s1.url, dead_url]) as client:
            with pytest.raises(FanOutError) as caught:
                await client.load_lora_adapter("a", "/w")
        assert list(caught.value.failures) == [dead_url]
        assert s1.controls[0][1]["version"] == 4


async def test_one_server_lets_the_server_number_versions() -> None:
    async with FakeServer() as s1:
        s1.versions = {"a": 3}
        async with RemoteInferenceClient(s1.url) as client:
            await client.load_lora_adapter("a", "/w")
        assert s1.controls[0][1]["version"] is None


async def test_a_pinned_sample_resumes_on_its_version_or_raises() -> None:
    gone = web.json_response(
        {"error": {"type": "version_gone", "message": "version 2 of LoRA adapter 'a' is gone"}},
        status=410,
    )
    async with FakeServer() as s1:
        s1.script = [answer(seq([1, 2], "abort", version=2), version=2), lambda _: gone]
        async with RemoteInferenceClient(s1.url) as client:
            with pytest.raises(VersionGoneError, match="version 2"):
                await client.sample_with_retry(
                    PROMPT, sampling_params={"max_tokens": 8}, lora_name="a", lora_version=2
                )
        assert [r.lora_version for r in s1.samples] == [2, 2]
        assert len(s1.samples) == 2, "no silent retry on another version"


def test_a_group_push_names_one_version_past_every_replica_and_its_record() -> None:
    from skyrl_lora.server.cluster.group import GroupConfig, ServerGroup
    from skyrl_lora.server.cluster.replay import AdapterState, PathSource

    group = ServerGroup(GroupConfig(num_replicas=2, argv=[], heal=False))
    states = {
        0: [AdapterState("a", 3, PathSource("/w"), False)],
        1: [AdapterState("a", 5, PathSource("/w"), False), AdapterState("b", 9, None, False)],
    }
    group._poll = lambda: (states, {})  # type: ignore[method-assign]
    assert group._next_version("a") == 6
    assert group._next_version("new") == 1
    group._record["a"] = AdapterState("a", 8, PathSource("/w"), False)
    assert group._next_version("a") == 9, "a replica that is down still counts through the record"
