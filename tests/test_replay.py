"""The group's record of what its replicas serve: pure merging rules."""

from __future__ import annotations

from skyrl_lora.server.cluster.group import GroupConfig, ServerGroup, _keep_pushed_files, _serves
from skyrl_lora.server.cluster.replay import (
    AdapterState,
    PathSource,
    PushedSource,
    merge,
    newest,
    source_of,
)


def state(name: str, version: int, paused: bool = False, path: str = "/p") -> AdapterState:
    return AdapterState(name, version, PathSource(f"{path}/{name}/{version}"), paused)


def test_newest_takes_each_names_newest_version_with_its_pause() -> None:
    behind = [state("a", 3), state("b", 1, paused=True)]
    ahead = [state("a", 4, paused=True), state("b", 1)]
    merged = newest([behind, ahead])
    assert merged["a"] == ahead[0]
    assert merged["b"].version == 1 and merged["b"].paused, "first replica seen wins a tie"


def test_merge_drops_unloaded_names_and_never_steps_back() -> None:
    record = {"a": state("a", 5), "gone": state("gone", 2)}
    seen = {"a": state("a", 4), "new": state("new", 1)}
    merged = merge(record, seen)
    assert merged["a"].version == 5 and "gone" not in merged and merged["new"].version == 1


def test_a_replica_serves_a_target_at_its_version_and_pause_or_newer() -> None:
    own = [state("a", 3, paused=True), state("b", 7)]
    assert _serves(own, state("a", 3, paused=True))
    assert not _serves(own, state("a", 3, paused=False)), "a missed resume is a difference"
    assert _serves([state("a", 3)], state("a", 3, paused=True)), "a missed pause is left alone"
    assert not _serves(own, state("a", 4)), "a missed reload is a difference"
    assert _serves(own, state("b", 6)), "ahead is fine: versions never go back"
    assert not _serves(own, state("c", 1))


def test_pushed_versions_get_their_files_fetched_once() -> None:
    calls: list[tuple[str, int]] = []

    class Method:
        def remote(self, name: str, version: int) -> str:
            calls.append((name, version))
            return f"ref:{name}:{version}"

    class Origin:
        adapter_files = Method()

    seen = {"p": AdapterState("p", 2, source_of("push:sha256=ab", Origin()), False)}
    record = _keep_pushed_files({}, dict(seen))
    source = record["p"].source
    assert isinstance(source, PushedSource) and source.files == "ref:p:2" and source.origin is None
    again = _keep_pushed_files(record, dict(seen))
    assert again["p"].source.files == "ref:p:2" and calls == [("p", 2)], "kept, not re-fetched"
    newer = {"p": AdapterState("p", 3, source_of("push:sha256=cd", Origin()), False)}
    assert _keep_pushed_files(again, newer)["p"].source.files == "ref:p:3"
    assert isinstance(source_of("/some/folder"), PathSource)
    streamed = source_of("push-stream:xxh3_128-chunked-8MiB=ef", Origin())
    assert isinstance(streamed, PushedSource) and streamed.sha256 == "", "no plain sha256 to check"


def test_rebuilt_replica_keeps_its_port() -> None:
    group = ServerGroup(GroupConfig(num_replicas=1, argv=["--model", "m", "--port", "0"]))
    assert group._argv(0, 41234)[-2:] == ["--port", "41234"]
    assert group._argv(0, 41234).count("--port") == 1
    assert group._argv(0) == ["--model", "m", "--port", "0"]


def test_a_replica_gets_its_own_extra_flags() -> None:
    config = GroupConfig(num_replicas=2, argv=["--model", "m"], replica_argv={1: ["--x", "1"]})
    group = ServerGroup(config)
    assert group._argv(0) == ["--model", "m"]
    assert group._argv(1, 5) == ["--model", "m", "--x", "1", "--port", "5"]
