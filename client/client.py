"""``RemoteInferenceClient``: async client for one or more skyrl-lora servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from skyrl_lora.client.config import ClientConfig
from skyrl_lora.client.gates import AdapterGates
from skyrl_lora.client.handover import AdapterHandover
from skyrl_lora.client.metrics import ClientMetrics, ClientMetricsSnapshot, export_in_process
from skyrl_lora.client.push import InMemoryAdapter, adapter_payload
from skyrl_lora.client.push_stream import stream_weights
from skyrl_lora.client.results import AbortResult, FanOutResult, LoadResult, PauseResult
from skyrl_lora.client.routing import POLICIES, ReplicaSet, RoutingPolicy
from skyrl_lora.client.transport import Transport
from skyrl_lora.errors import (
    FanOutError,
    HandoverUnavailableError,
    PushStreamUnavailableError,
    ResponseFormatError,
    RetryLimitError,
    ServerError,
    ServerUnavailableError,
)
from skyrl_lora.stitching import SequenceStitcher, resumed_seed
from skyrl_lora.types import (
    AbortResponse,
    AdapterInfo,
    AdapterList,
    LeaseResponse,
    PauseResponse,
    PushStreamRequest,
    PushStreamTicket,
    SampleRequest,
    SampleResponse,
    SamplingParams,
    ServerInfo,
    SwapPolicy,
)

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)
API = "/skyrl/v1"


class RemoteInferenceClient:
    """Samples from, and controls, skyrl-lora servers.

    Sampling spreads over the servers by a routing policy (``config.routing``
    or ``policy``); a server that stops answering is skipped until its health
    check passes again, and a sample it was serving resumes elsewhere.
    Control calls (pause, resume, abort, adapter loads) go to every server at
    once and return when all have answered; with several servers a partial
    failure raises :class:`~skyrl_lora.errors.FanOutError` naming who failed.
    Use it as an async context manager, or call :meth:`aclose`.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        config: ClientConfig | None = None,
        api_key: str | None = None,
        policy: RoutingPolicy | None = None,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("RemoteInferenceClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.config = config or ClientConfig()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._transport = Transport(self.config, headers)
        self.gates = AdapterGates(self.config.resume_spacing_s, self.config.resume_window_s)
        if policy is None:
            if self.config.routing not in POLICIES:
                raise ValueError(
                    f"unknown routing policy {self.config.routing!r}; "
                    f"choose from {sorted(POLICIES)}"
                )
            policy = POLICIES[self.config.routing]()
        self.replicas = ReplicaSet(self.urls, policy, self._probe, self.config.recheck_after)
        self._info: dict[str, ServerInfo] = {}
        self._metrics = ClientMetrics()
        #: Names this client's hold of the global pause (see :meth:`pause_all`).
        self.holder = f"client-{uuid.uuid4().hex[:12]}"
        #: Its counters on an in-process server's /metrics, labelled with ``holder``.
        self._unexport = export_in_process(self._metrics, self.holder)

    async def __aenter__(self) -> RemoteInferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._unexport is not None:
            self._unexport()
            self._unexport = None
        await self._transport.aclose()

    def metrics(self) -> ClientMetricsSnapshot:
        """Counters of this client's samples: resubmits, resumed work, held time, errors."""
        return self._metrics.snapshot()

    # -- low level ---------------------------------------------------------
    async def _call(
        self, url: str, method: str, path: str, body: Any = None, *, timeout: float | None
    ) -> bytes:
        return await self._transport.call(method, url + path, body, timeout=timeout)

    async def _control(self, path: str, body: Any, model: type[ModelT]) -> list[ModelT]:
        """POST the same JSON body to every server; see :meth:`_fan_out`."""

        async def send(url: str) -> bytes:
            return await self._call(url, "POST", path, body, timeout=self.config.control_timeout)

        return await self._fan_out(path, send, model)

    async def _fan_out(
        self, path: str, send: Callable[[str], Awaitable[bytes]], model: type[ModelT]
    ) -> list[ModelT]:
        """Call every server concurrently and wait for all of them.

        One server: its error is raised as is. Several: any failure raises
        :class:`FanOutError` with the answers and the errors by URL.
        """
        answers = await asyncio.gather(*(send(u) for u in self.urls), return_exceptions=True)
        failures: dict[str, Exception] = {}
        results: dict[str, ModelT] = {}
        for url, answer in zip(self.urls, answers):
            if isinstance(answer, Exception):
                failures[url] = answer
                if isinstance(answer, ServerUnavailableError):
                    self.replicas.mark_unhealthy(url)
            elif isinstance(answer, BaseException):
                raise answer  # cancellation is not a replica failure
            else:
                results[url] = _parsed(model, answer, url)
        if failures and len(self.urls) == 1:
            raise next(iter(failures.values()))
        if failures:
            detail = "; ".join(f"{u}: {e}" for u, e in failures.items())
            raise FanOutError(
                f"{path} failed on {len(failures)} of {len(self.urls)} servers: {detail}",
                results=dict(results),
                failures=failures,
            )
        return list(results.values())

    async def _probe(self, url: str) -> bool:
        try:
            await self._call(url, "GET", "/health", timeout=self.config.connect_timeout)
        except Exception:
            return False
        return True

    async def server_info(self, url: str | None = None) -> ServerInfo:
        url = url or self.urls[0]
        if url not in self._info:
            raw = await self._call(
                url, "GET", f"{API}/server_info", timeout=self.config.control_timeout
            )
            self._info[url] = _parsed(ServerInfo, raw, url)
        return self._info[url]

    # -- sampling ----------------------------------------------------------
    async def _post_routed(
        self, path: str, body: Any, lora_name: str | None, prefer: str | None = None
    ) -> tuple[str, bytes]:
        """POST to a replica chosen by the policy; fail over while replicas are down.

        A request that died with its replica is re-sent whole to another one:
        for a sample that only costs recomputation, since the caller resumes
        from the tokens it already has.
        """
        for _ in range(len(self.urls)):
            replica = self.replicas.pick(lora_name, prefer)
            replica.outstanding += 1
            try:
                answer = await self._call(
                    replica.url, "POST", path, body, timeout=self.config.sample_timeout
                )
                return replica.url, answer
            except ServerUnavailableError:
                logger.warning("replica %s is unavailable; failing over", replica.url)
                self.replicas.mark_unhealthy(replica.url)
                prefer = None
            finally:
                replica.outstanding -= 1
        raise ServerUnavailableError(f"{path}: every replica failed: {', '.join(self.urls)}")

    async def _sample_on(
        self, request: SampleRequest, prefer: str | None = None
    ) -> tuple[str, SampleResponse]:
        url, raw = await self._post_routed(f"{API}/sample", request, request.lora_name, prefer)
        return url, _parsed(SampleResponse, raw, url)

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        lora_name: str | None = None,
        prompt_logprobs: bool = False,
        lora_version: int | None = None,
    ) -> SampleResponse:
        """One request, no retry: aborted sequences come back with ``stop_reason="abort"``.

        ``lora_version`` pins the sample to that adapter version (current,
        draining or leased); once the server no longer holds it the call
        raises :class:`~skyrl_lora.errors.VersionGoneError`.
        """
        request = _sample_request(
            prompt_token_ids, num_samples, sampling_params, lora_name, prompt_logprobs, lora_version
        )
        with self._counted():
            return (await self._sample_on(request))[1]

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self._metrics.errors[type(exc).__name__] += 1
            raise
        self._metrics.samples += 1

    async def sample_with_retry(
        self,
        prompt_token_ids: Sequence[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        lora_name: str | None = None,
        prompt_logprobs: bool = False,
        lora_version: int | None = None,
    ) -> SampleResponse:
        """Like :meth:`sample`, but aborted sequences are resumed until complete.

        Each aborted sequence waits on its adapter's gate, then is resubmitted
        as ``prompt + tokens so far`` with the remaining ``max_tokens``; the
        segments' tokens, logprobs and adapter versions are stitched together.
        Prompt logprobs are those of the original prompt (first segment);
        ``adapter_version`` is the newest version that produced any token.
        A pinned sample (``lora_version``) resumes on that version only: if
        it is gone by then, :class:`~skyrl_lora.errors.VersionGoneError` is
        raised rather than finishing the sequence on another version.
        """
        request = _sample_request(
            prompt_token_ids, num_samples, sampling_params, lora_name, prompt_logprobs, lora_version
        )
        with self._counted():
            return await self._sample_to_completion(request)

    async def _sample_to_completion(self, request: SampleRequest) -> SampleResponse:
        url, first = await self._sample_on(request)
        info = await self.server_info(url)
        params = request.sampling_params
        stitchers = [
            SequenceStitcher(
                prompt_len=len(request.prompt_token_ids),
                max_tokens=params.max_tokens,
                stop_token_ids=frozenset(params.stop_token_ids),
                max_model_len=info.max_model_len,
            )
            for _ in first.sequences
        ]
        for stitcher, seq in zip(stitchers, first.sequences):
            stitcher.add_segment(seq, first.adapter_version)
        await asyncio.gather(*(self._resume(url, request, s) for s in stitchers))
        sequences = [s.result() for s in stitchers]
        produced = [r.version for s in sequences for r in s.versions if r.version is not None]
        return SampleResponse(
            sequences=sequences,
            prompt_logprobs=first.prompt_logprobs,
            lora_name=request.lora_name,
            adapter_version=max(produced, default=first.adapter_version),
        )

    async def _resume(self, url: str, original: SampleRequest, stitcher: SequenceStitcher) -> None:
        """Resubmit one aborted sequence until it is finished.

        A seeded sample's resubmission gets a seed derived from the original
        and the tokens so far (:func:`~skyrl_lora.stitching.resumed_seed`),
        so it does not replay the first segment's random draws.
        """
        while not stitcher.done:
            if stitcher.attempts > self.config.max_resubmits:
                raise RetryLimitError(f"sequence aborted {stitcher.attempts - 1} times; giving up")
            if original.lora_name is not None:
                held = time.monotonic()
                await self.gates.wait_open(original.lora_name)
                self._metrics.held_seconds += time.monotonic() - held
            params = original.sampling_params
            request = original.model_copy(
                update={
                    "prompt_token_ids": [*original.prompt_token_ids, *stitcher.tokens],
                    "num_samples": 1,
                    "sampling_params": params.model_copy(
                        update={
                            "max_tokens": stitcher.remaining,
                            "seed": resumed_seed(params.seed, len(stitcher.tokens)),
                        }
                    ),
                    "prompt_logprobs": False,
                    "generated_prefix_len": len(stitcher.tokens),
                }
            )
            self._metrics.resubmits += 1
            before = len(stitcher.tokens)
            url, response = await self._sample_on(request, prefer=url)
            stitcher.add_segment(response.sequences[0], response.adapter_version)
            if len(stitcher.tokens) > before:
                self._metrics.resumed_segments += 1
                self._metrics.resumed_tokens += len(stitcher.tokens) - before

    # -- control -----------------------------------------------------------
    async def pause_generation(self, lora_name: str | None) -> PauseResult:
        """Pause one adapter on every server: hold its new requests, abort those in flight.

        The client's own gate closes first, so retries of that adapter from
        this client wait here rather than queueing at servers. The name is
        required: ``lora_name=None`` spelled out is :meth:`pause_all`, which
        pauses every tenant. One result: ``aborted`` in all, the slowest
        ``drain_seconds``, each replica's answer inside.
        """
        if lora_name is None:
            return await self.pause_all()
        self.gates.close(lora_name)
        try:
            body = {"lora_name": lora_name}
            return PauseResult(await self._control(f"{API}/pause", body, PauseResponse))
        except BaseException:
            self.gates.open(lora_name)
            raise

    async def resume_generation(self, lora_name: str | None) -> PauseResult:
        """Resume one adapter on every server, then open the client's gate
        (``lora_name=None`` spelled out is :meth:`resume_all`)."""
        if lora_name is None:
            return await self.resume_all()
        try:
            body = {"lora_name": lora_name}
            return PauseResult(await self._control(f"{API}/resume", body, PauseResponse))
        finally:
            self.gates.open(lora_name)

    async def pause_all(self) -> PauseResult:
        """vLLM's global keep-mode pause on every server: every tenant's requests freeze.

        Held in this client's name (:attr:`holder`): a server resumes only
        when every client that paused it has called :meth:`resume_all`.
        """
        body = {"lora_name": None, "holder": self.holder}
        return PauseResult(await self._control(f"{API}/pause", body, PauseResponse))

    async def resume_all(self) -> PauseResult:
        """Release this client's global pause; a server resumes once nobody holds it."""
        body = {"lora_name": None, "holder": self.holder}
        return PauseResult(await self._control(f"{API}/resume", body, PauseResponse))

    async def abort_lora_requests(self, lora_name: str) -> AbortResult:
        body = {"lora_name": lora_name}
        return AbortResult(await self._control(f"{API}/abort_lora_requests", body, AbortResponse))

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        *,
        swap_policy: SwapPolicy = "abort_resume",
        version: int | None = None,
    ) -> LoadResult:
        """Load (or reload in place, bumping the version) on every server.

        The path is read by each server: use :meth:`push_lora_adapter` where
        trainer and servers share no disk. ``swap_policy="finish_old"`` lets
        requests in flight finish on the old version instead of aborting them.
        ``version`` names the new version (a trainer's step; above the current
        one, or the current one again with the same weights: a no-op); with
        several servers one is always sent (see :meth:`_fan_out_version`).

        With several servers the load is atomic (see :meth:`_all_or_none`).
        """
        body: dict[str, Any] = {
            "lora_name": lora_name,
            "lora_path": lora_path,
            "swap_policy": swap_policy,
            "version": await self._fan_out_version(lora_name, version),
        }
        return LoadResult(await self._load_everywhere(f"{API}/adapters/load", body))

    async def push_lora_adapter(
        self,
        lora_name: str,
        adapter: str | os.PathLike[str] | InMemoryAdapter | AdapterHandover,
        *,
        swap_policy: SwapPolicy = "abort_resume",
        version: int | None = None,
        push_stream: bool | None = None,
    ) -> LoadResult:
        """Send adapter weights to every server and load them as the next version
        (or as ``version``, as for :meth:`load_lora_adapter`).

        ``adapter`` is a PEFT folder or an :class:`InMemoryAdapter`. The
        servers need no access to the trainer's disk; the weights are
        streamed to them concurrently and checked against their digest.
        A server with a push stream (``ServerInfo.push_stream_port``) gets the
        weights over it instead of in the HTTP body, unless ``push_stream``
        (default: ``config.push_stream``) is False. Servers of one host (the
        same ``ServerInfo.push_share_host``) get them once: the first one
        over its stream, the others from its receive area as the bytes land
        (``POST /skyrl/v1/adapters/push/shared``; :meth:`_host_shares`).
        Returns when every server answered (fan-out rules as for loads,
        atomic too).

        An :class:`AdapterHandover` (a trainer on the servers' host) is handed
        over by handle instead: no bytes on the wire. Where a server cannot
        open it (hand-overs off, another host or GPU) its bytes are pushed,
        to every server, so that all of them serve the same version.
        """
        if isinstance(adapter, AdapterHandover):
            try:
                return await self._hand_over(lora_name, adapter, swap_policy, version)
            except (HandoverUnavailableError, FanOutError) as exc:
                if not _handover_unavailable(exc):
                    raise
                logger.info("hand-over of %s refused, pushing its bytes: %s", lora_name, exc)
                self._metrics.handover_fallbacks += 1
                adapter = await asyncio.to_thread(adapter.to_memory)
        payload = await asyncio.to_thread(adapter_payload, adapter)
        path = f"{API}/adapters/push"
        version = await self._fan_out_version(lora_name, version)
        keep = self.config.commit_timeout_s if len(self.urls) > 1 else None
        stream = self.config.push_stream if push_stream is None else push_stream
        request = (  # built once for every server that has a stream
            PushStreamRequest(
                lora_name=lora_name,
                config=json.loads(payload.config),
                weights_bytes=payload.weights_bytes,
                version=version,
                swap_policy=swap_policy,
                keep_previous_s=keep,
                lanes=self.config.push_stream_lanes,
            )
            if stream
            else None
        )

        async def own(url: str) -> bytes:
            if request is not None and (await self.server_info(url)).push_stream_port:
                try:
                    return await self._push_stream(url, request, payload.weights)
                except PushStreamUnavailableError:  # restarted without it: HTTP from now on
                    self._info.pop(url, None)
            form = payload.form(lora_name, swap_policy, version, keep)
            return await self._call(url, "POST", path, form, timeout=self.config.control_timeout)

        shares = await self._host_shares(request) if request is not None else {}

        async def send(url: str) -> bytes:
            share = shares.get(url)
            if share is not None and url == share.receiver:
                try:
                    return await self._push_stream(url, share.request, payload.weights, share)
                except PushStreamUnavailableError:  # it lends no area now: a push of its own
                    self._info.pop(url, None)
            elif share is not None and await share.opened:
                try:
                    answer = await self._call(
                        url,
                        "POST",
                        f"{API}/adapters/push/shared",
                        share.request,
                        timeout=self.config.control_timeout,
                    )
                    self._metrics.pushes_shared += 1
                    return answer
                except PushStreamUnavailableError:  # the share is out of its reach after all
                    logger.info("%s could not load push share from %s", url, share.receiver)
            return await own(url)

        return LoadResult(await self._all_or_none(path, send, lora_name, version))

    async def _host_shares(self, request: PushStreamRequest) -> dict[str, _HostShare]:
        """The servers that share one push's bytes, each host's by URL: those
        with a push stream that name the same ``push_share_host``, where one
        host has several. A server whose info cannot be read is left to its
        own push (whose fan-out reports it)."""
        if len(self.urls) == 1:
            return {}
        infos = await asyncio.gather(
            *(self.server_info(url) for url in self.urls), return_exceptions=True
        )
        hosts: dict[str, list[str]] = {}
        for url, info in zip(self.urls, infos):
            if isinstance(info, ServerInfo) and info.push_stream_port and info.push_share_host:
                hosts.setdefault(info.push_share_host, []).append(url)
        shares: dict[str, _HostShare] = {}
        for urls in hosts.values():
            if len(urls) > 1:
                update = {"share": secrets.token_hex(16), "share_peers": len(urls) - 1}
                share = _HostShare(request.model_copy(update=update), urls[0])
                shares |= dict.fromkeys(urls, share)
        return shares

    async def _push_stream(
        self,
        url: str,
        request: PushStreamRequest,
        weights: bytes | Path,
        share: _HostShare | None = None,
    ) -> bytes:
        """Open a push over HTTP, then send its weights over the server's push
        stream; ``share``: its peers learn whether the open succeeded."""
        try:
            raw = await self._call(
                url,
                "POST",
                f"{API}/adapters/push/stream",
                request,
                timeout=self.config.control_timeout,
            )
            ticket = _parsed(PushStreamTicket, raw, url)
        except BaseException:
            if share is not None:
                share.opened.set_result(False)
            raise
        if share is not None:
            share.opened.set_result(True)
        answer = await stream_weights(
            url,
            ticket,
            weights,
            timeout=self.config.control_timeout,
            connect_timeout=self.config.connect_timeout,
        )
        self._metrics.pushes_streamed += 1
        return answer

    async def _hand_over(
        self,
        lora_name: str,
        adapter: AdapterHandover,
        swap_policy: SwapPolicy,
        version: int | None,
    ) -> LoadResult:
        body = {
            "lora_name": lora_name,
            "swap_policy": swap_policy,
            "version": await self._fan_out_version(lora_name, version),
            **adapter.request(),
        }
        infos = await self._load_everywhere(f"{API}/adapters/handover", body)
        self._metrics.handovers += 1
        return LoadResult(infos)

    async def _load_everywhere(self, path: str, body: dict[str, Any]) -> list[AdapterInfo]:
        """POST a JSON load (``lora_name``, ``version``, ...) to every server, all or none."""
        if len(self.urls) > 1:
            body["keep_previous_s"] = self.config.commit_timeout_s

        async def send(url: str) -> bytes:
            return await self._call(url, "POST", path, body, timeout=self.config.control_timeout)

        return await self._all_or_none(path, send, body["lora_name"], body["version"])

    async def _all_or_none(
        self,
        path: str,
        send: Callable[[str], Awaitable[bytes]],
        lora_name: str,
        version: int | None,
    ) -> list[AdapterInfo]:
        """A load or push over several servers that lands on all of them or on none.

        Each server loaded it keeping its previous version (``keep_previous_s``).
        When all answered, each commits; when one failed, those that loaded it
        roll back to the version they had (so do those whose outcome is
        unknown: a rollback where nothing landed is a no-op), and the
        :class:`FanOutError` raised holds the failing servers' errors. No
        server is left serving a version the others never got.
        """
        if len(self.urls) == 1:
            return await self._fan_out(path, send, AdapterInfo)
        try:
            infos = await self._fan_out(path, send, AdapterInfo)
        except FanOutError as exc:
            landed = {u: i.version for u, i in exc.results.items() if isinstance(i, AdapterInfo)}
            if version is not None:  # a server that may have loaded it without answering
                landed |= {
                    u: version
                    for u, e in exc.failures.items()
                    if not isinstance(e, ServerError)  # no answer: unreachable, timed out
                }
            await self._settle("rollback", lora_name, landed)
            raise FanOutError(
                f"{exc}; rolled back on every server that had loaded it "
                f"({', '.join(sorted(landed)) or 'none'})",
                results=exc.results,
                failures=exc.failures,
            ) from exc
        await self._settle("commit", lora_name, {u: i.version for u, i in zip(self.urls, infos)})
        return infos

    async def _settle(self, step: str, lora_name: str, versions: Mapping[str, int]) -> None:
        """Commit or roll back one version per server; a server that does not
        answer is logged (it commits by itself after ``commit_timeout_s``)."""
        path = f"{API}/adapters/{step}"

        async def one(url: str, version: int) -> None:
            body = {"lora_name": lora_name, "version": version}
            await self._call(url, "POST", path, body, timeout=self.config.control_timeout)

        answers = await asyncio.gather(
            *(one(u, v) for u, v in versions.items()), return_exceptions=True
        )
        for url, answer in zip(versions, answers):
            if isinstance(answer, Exception):
                logger.warning("%s of %s on %s failed: %r", step, lora_name, url, answer)

    reload_lora_adapter = load_lora_adapter

    async def _fan_out_version(self, lora_name: str, version: int | None) -> int | None:
        """The version a load sends: the caller's, or with several servers one past
        the newest any of them serves, so that a server that missed a reload
        (healing, restarting) cannot end up a version behind the others, its
        numbers meaning other weights. A name no server holds yet gets none
        (every server starts it at 1). A server that does not answer here is
        left to the load's own fan-out to report."""
        if version is not None or len(self.urls) == 1:
            return version
        answers = await asyncio.gather(
            *(self.list_adapters(url) for url in self.urls), return_exceptions=True
        )
        lists = [a for a in answers if isinstance(a, AdapterList)]
        held = [a.version for found in lists for a in found.adapters if a.lora_name == lora_name]
        return max(held) + 1 if held else None

    async def lease_version(
        self, lora_name: str, version: int | None = None, *, ttl_s: float = 600.0
    ) -> FanOutResult[LeaseResponse]:
        """Keep ``version`` (default: the current one) loaded on every server for ``ttl_s``.

        Samples pinned to it (``lora_version``) are served until the lease
        ends, also after newer loads. Each server answers its own lease, in
        server order; hand the result to :meth:`release_leases`. A lease that
        is never released ends by itself, so a crashed trainer leaks nothing.
        """
        body = {"lora_name": lora_name, "version": version, "ttl_s": ttl_s}
        return FanOutResult(await self._control(f"{API}/adapters/lease", body, LeaseResponse))

    async def release_leases(self, leases: Sequence[LeaseResponse]) -> None:
        """End leases from :meth:`lease_version` (one per server, in server order)."""

        async def release(url: str, lease: LeaseResponse) -> bytes:
            path = f"{API}/adapters/lease/{lease.lease_id}"
            return await self._call(url, "DELETE", path, timeout=self.config.control_timeout)

        await asyncio.gather(*(release(u, lease) for u, lease in zip(self.urls, leases)))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._control(f"{API}/adapters/unload", {"lora_name": lora_name}, _Ack)

    async def list_adapters(self, url: str | None = None) -> AdapterList:
        url = url or self.urls[0]
        raw = await self._call(url, "GET", f"{API}/adapters", timeout=self.config.control_timeout)
        return _parsed(AdapterList, raw, url)

    # -- vLLM passthroughs -------------------------------------------------
    async def completion(self, body: Mapping[str, Any]) -> Any:
        """vLLM's ``/v1/completions`` (gated like every adapter request)."""
        return await self._passthrough("/v1/completions", body)

    async def chat_completion(self, body: Mapping[str, Any]) -> Any:
        """vLLM's ``/v1/chat/completions``."""
        return await self._passthrough("/v1/chat/completions", body)

    async def generate(self, body: Mapping[str, Any]) -> Any:
        """Our token-in ``/skyrl/v1/sample`` with a raw JSON body, no retry."""
        return await self._passthrough(f"{API}/sample", body)

    async def _passthrough(self, path: str, body: Mapping[str, Any]) -> Any:
        lora = body.get("model") if path.startswith("/v1/") else body.get("lora_name")
        lora_name = lora if isinstance(lora, str) else None
        return json.loads((await self._post_routed(path, dict(body), lora_name))[1])


class _Ack(BaseModel):
    lora_name: str


class _HostShare:
    """One push's bytes for the servers of one host: streamed to
    ``receiver``, whose receive area the others load them from once
    ``opened`` says its push is open (False: each gets a push of its own)."""

    def __init__(self, request: PushStreamRequest, receiver: str) -> None:
        self.request = request
        self.receiver = receiver
        self.opened: asyncio.Future[bool] = asyncio.get_running_loop().create_future()


def _parsed(model: type[ModelT], raw: bytes, url: str) -> ModelT:
    """``raw`` read as ``model``; a typed error, not pydantic's, when it is not one."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ResponseFormatError(
            f"the answer of {url} is not a {model.__name__}: {exc.error_count()} field(s) "
            f"do not fit, the first {where!r}: {first['msg']}",
            url=url,
        ) from exc


def _sample_request(
    prompt_token_ids: Sequence[int],
    num_samples: int,
    sampling_params: SamplingParams | Mapping[str, Any] | None,
    lora_name: str | None,
    prompt_logprobs: bool,
    lora_version: int | None = None,
) -> SampleRequest:
    if sampling_params is None:
        params = SamplingParams()
    elif isinstance(sampling_params, SamplingParams):
        params = sampling_params
    else:
        params = SamplingParams.model_validate(dict(sampling_params))
    return SampleRequest(
        prompt_token_ids=list(prompt_token_ids),
        lora_name=lora_name,
        num_samples=num_samples,
        sampling_params=params,
        prompt_logprobs=prompt_logprobs,
        lora_version=lora_version,
    )


def _handover_unavailable(exc: Exception) -> bool:
    """Whether a hand-over failed only because some server could not take one
    (then its bytes go instead); any other failure is the caller's to see."""
    if isinstance(exc, FanOutError):
        failures = list(exc.failures.values())
        return bool(failures) and all(isinstance(e, HandoverUnavailableError) for e in failures)
    return isinstance(exc, HandoverUnavailableError)


__all__ = ["RemoteInferenceClient"]
