"""The API server's side of staging: every worker builds a version off the
step loop, and the load waits until all of them are ready.

The workers' side (a staging thread per worker, in vLLM's engine process)
is :mod:`.staging`; the two meet in :mod:`.staging_status` (the status a
worker publishes) and :mod:`.stage_channel` (stage requests sent beside the
step loop). Without the workers' extension a load falls back to vLLM's own
``add_lora`` in the step loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import compat
from ..adapters.snapshot_writer import write_weights_from
from ..telemetry.observability import ARRIVING_READS, READS, STAGING_NAPS, STAGINGS, log_event
from ..telemetry.step_watch import DEFAULT_LONG_STEP_S
from ..transfer import handover
from ..transfer.open_shares import DEFAULT_OPEN_SHARES
from ..transfer.pinned_reserve import PinnedReserve, ReserveReport
from .stage_channel import StageChannel
from .staging_status import FAILED, PENDING, READY, UNKNOWN, status_file
from .staging_yield import DEFAULT_STAGING_YIELD, StagingYield

logger = logging.getLogger("vllm.skyrl_lora.staged_engine")

#: The workers' side, which vLLM loads into each worker by name
#: (``--worker-extension-cls``): :class:`.staging.LoRAStagingExtension`.
EXTENSION_QUALNAME = "skyrl_lora.server.loading.staging.LoRAStagingExtension"


@dataclass(frozen=True)
class StagingConfig:
    """How the API server waits for a staging: polls back off from
    ``first_poll_s`` to ``max_poll_s``.

    A poll looks for the workers' status files (where they publish them; else
    it is a dictionary look-up run between two engine steps), so polling
    often costs next to nothing, while every millisecond between the model
    being ready and the poll that sees it is added to the swap (a backoff up
    to 20 ms added about 8 ms to a 20 ms staging; on the H100 a rank-16
    staging took 7 polls of 2-4 ms).
    """

    first_poll_s: float = 0.001
    max_poll_s: float = 0.002
    timeout_s: float = 600.0
    #: Where workers publish statuses as files, they are still asked by RPC
    #: this often: a staging whose file never came (its write failed) ends.
    rpc_check_s: float = 1.0
    #: Copy staged adapters into a free engine slot on the staging thread
    #: (:mod:`skyrl_lora.server.loading.slots`); off, vLLM copies in the step loop.
    slot_prefill: bool = True
    #: On a GPU worker, build GPU hand-overs of a known layout, and streamed
    #: pushes' receive areas, in GPU memory (:mod:`skyrl_lora.server.loading.staged_buffer`,
    #: :mod:`~skyrl_lora.server.transfer.area_upload`); off, in pinned host
    #: memory, copied into the slot from there. Other files are built on the host.
    gpu_staging: bool = True
    #: Keep this many adapters' trainer CUDA shares open from one hand-over
    #: to the next (:mod:`skyrl_lora.server.transfer.open_shares`); 0 opens
    #: and closes each trainer's buffer at every hand-over.
    open_shares: int = DEFAULT_OPEN_SHARES
    #: Read adapter files in a process of their own
    #: (:mod:`skyrl_lora.server.transfer.adapter_reader`); off, the staging
    #: thread reads them in the engine process. Off by
    #: default: the extra copy cost more swap time on an H100 than the
    #: GIL it frees bought the other tenants (docs/design.md, "Adapter reader").
    reader_process: bool = False
    #: While the engine steps, the staging thread runs in short slices with
    #: naps between them (:mod:`skyrl_lora.server.loading.staging_yield`); None: it never naps.
    staging_yield: StagingYield | None = DEFAULT_STAGING_YIELD
    #: Pinned host memory each worker takes before serving, so that no
    #: staging pins fresh memory while the engine steps
    #: (:mod:`skyrl_lora.server.transfer.pinned_reserve`); None: none.
    pinned_reserve: PinnedReserve | None = None
    #: Log each worker's engine steps longer than this as ``engine_long_step``
    #: events (:mod:`skyrl_lora.server.telemetry.step_watch`); None: none.
    long_step_s: float | None = DEFAULT_LONG_STEP_S
    #: Prepare the LoRA kernels' per-step metadata on the host, without the
    #: two GPU syncs vLLM's own preparation makes (:mod:`skyrl_lora.server.lora_metadata`).
    host_lora_metadata: bool = True


class StagingError(Exception):
    """The worker could not build the adapter (bad files, wrong shapes, ...)."""


class StagedLoRAEngine:
    """The engine's LoRA calls as the registry sees them, with loads staged.

    ``stage`` builds the model on every worker and waits until it is ready;
    the version's first request then installs it (``add_lora`` calls
    nothing for it); ``remove_lora`` passes through. Without the extension
    ``stage`` does nothing and ``add_lora`` loads in the step loop, as vLLM does.
    """

    def __init__(self, engine_client: Any, config: StagingConfig = StagingConfig()) -> None:
        self._engine = engine_client
        self._config = config
        self.available = False
        self.slot_prefill = False
        self.gpu_staging = False
        #: Trainers' CUDA shares each worker keeps open (the least of them).
        self.open_shares = 0
        self.reader_process = False
        self.staging_yield = False
        self.logits_guard = False
        #: Whether every worker prepares the LoRA kernels' metadata on the host.
        self.host_lora_metadata = False
        self.grouped_lora_kernels = False
        self.lora_shrink_overlap = False
        #: Pinned host bytes the workers reserved for stagings before serving.
        self.pinned_reserve_bytes = 0
        #: Steps longer than this are logged on every worker (None: not watched).
        self.long_step_ms: float | None = None
        #: The workers' GPUs (UUIDs): a CUDA hand-over must come from one of them.
        self.device_uuids: frozenset[str] = frozenset()
        #: Where the workers publish stagings' statuses, and their names
        #: there (None: every worker is asked by RPC).
        self._status_dir: Path | None = None
        self._workers: list[str] | None = None
        #: Versions staged on every worker and not installed by ``add_lora``:
        #: their first request installs them (see :meth:`add_lora`).
        self._ready: set[int] = set()
        #: Stage requests beside the step loop (:mod:`.stage_channel`); None: by RPC.
        self._channel: StageChannel | None = None
        #: Drops of replaced versions sent to the step loop, not yet answered.
        self._drops: set[asyncio.Task[list[Any]]] = set()

    @property
    def stage_channel(self) -> bool:
        """Whether stage requests reach the workers beside the step loop."""
        return self._channel is not None and self._channel.open

    @property
    def takes_files(self) -> bool:
        """Whether a path load may hand its weights file over open (``stage``'s
        ``weights_fd``): only the stage channel carries descriptors."""
        return self.available and self.stage_channel

    async def probe(self) -> bool:
        """Whether the workers carry the extension (checked once at start-up)."""
        status_dir = self._make_status_dir()
        config = self._config
        try:
            parts = await compat.collective_rpc(
                self._engine,
                "skyrl_start_staging",
                config.slot_prefill,
                config.reader_process,
                None if config.staging_yield is None else asdict(config.staging_yield),
                str(status_dir),
                config.gpu_staging,
                None if config.pinned_reserve is None else asdict(config.pinned_reserve),
                config.long_step_s,
                config.open_shares,
                config.host_lora_metadata,
            )
            self.available = True
            if self._config.long_step_s is not None and all(
                p.get("long_step_watch") for p in parts
            ):
                self.long_step_ms = self._config.long_step_s * 1000
            reserves = [ReserveReport(**p.get("pinned_reserve", {})) for p in parts]
            self.pinned_reserve_bytes = sum(r.total_bytes for r in reserves)
            for report in reserves:
                logger.info(
                    "skyrl-lora pinned %d host blocks of %d MiB for stagings in %.0f ms%s",
                    report.blocks,
                    report.block_bytes >> 20,
                    report.ms,
                    f" ({report.note})" if report.note else "",
                )
            self.slot_prefill = all(p["slot_prefill"] for p in parts)
            self.gpu_staging = all(p.get("gpu_staging") for p in parts)
            self.open_shares = min(int(p.get("open_shares", 0)) for p in parts)
            self.reader_process = all(p["reader_process"] for p in parts)
            self.staging_yield = all(p["staging_yield"] for p in parts)
            self.device_uuids = frozenset(p["device_uuid"] for p in parts if p["device_uuid"])
            self.logits_guard = all(p.get("logits_guard") for p in parts)
            self.host_lora_metadata = all(p.get("host_lora_metadata") for p in parts)
            self.grouped_lora_kernels = all(p.get("grouped_lora_kernels") for p in parts)
            self.lora_shrink_overlap = all(p.get("lora_shrink_overlap") for p in parts)
            if not self.logits_guard:
                logger.warning("a worker has no sampler to guard: NaN logits may kill the engine")
            if all(p.get("status_files") for p in parts):
                self._status_dir, self._workers = status_dir, [p["worker"] for p in parts]
                sockets = [p.get("stage_socket") for p in parts]
                if all(sockets):
                    self._channel = self._connect([Path(p) for p in sockets])
        except Exception as exc:  # no extension, or an engine without collective_rpc
            logger.warning("adapter staging off, loads run in the step loop: %s", exc)
            self.available = False
        return self.available

    @staticmethod
    def _connect(sockets: list[Path]) -> StageChannel | None:
        try:
            return StageChannel(sockets)
        except OSError as exc:
            logger.warning("stage requests go by RPC: the workers' sockets refused: %s", exc)
            return None

    def _make_status_dir(self) -> Path:
        """A private folder for the workers' status files, in memory where
        the host has ``/dev/shm``, removed with this object."""
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = Path(tempfile.mkdtemp(prefix="skyrl-staging-", dir=shm))
        weakref.finalize(self, shutil.rmtree, folder, True)
        return folder

    async def stage(
        self, lora_request: Any, replaces: int | None = None, weights_fd: int | None = None
    ) -> None:
        """Build the adapter on every worker, off the step loop, and wait until it is ready.

        Nothing serves differently afterwards: the model waits in the workers
        until :meth:`add_lora` installs it (or :meth:`discard` drops it), so a
        reload can stage while the adapter's current version still serves.
        ``replaces`` names a version that cannot run before this one is
        installed (its adapter is paused and drained): the workers drop it
        first, so its engine slot and CPU cache entry go to the new version.
        ``weights_fd``: the snapshot's weights file, opened by the registry
        and not copied (:attr:`takes_files`); the workers read it, and write
        the snapshot's copy of what they read.
        """
        if not self.available:
            if weights_fd is not None:  # vLLM's own loader reads the snapshot
                await self._write_weights(weights_fd, lora_request.lora_path)
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        polls, ready = await self._stage(lora_request, replaces, weights_fd)
        in_slot = all(r["in_slot"] for r in ready)
        reads = {r["read"] for r in ready}
        read = reads.pop() if len(reads) == 1 else "mixed"
        naps = max(r["naps"] for r in ready)
        STAGINGS.labels(slot="written" if in_slot else "none").inc()
        READS.labels(read=read).inc()
        followed = any(r.get("followed") for r in ready)
        if followed:
            ARRIVING_READS.labels(read=read).inc()
        STAGING_NAPS.inc(naps)
        log_event(
            "adapter_staged",
            lora_name=lora_request.lora_name,
            stage_ms=round((loop.time() - started) * 1000, 2),
            polls=polls,
            channel=self.stage_channel,
            in_slot=in_slot,
            read=read,
            followed=followed,
            naps=naps,
            replaced=replaces,
        )

    async def add_lora(self, lora_request: Any) -> bool:
        """vLLM's ``add_lora``; for a version staged on every worker, nothing.

        vLLM installs a version its workers do not hold when the first request
        for it is scheduled, in that step (as it loads any adapter on
        demand), and the staging's model is what its loader then gets: the
        cache insert and the claim of the written slot, well under a
        millisecond. An ``add_lora`` call would do the same, but it is served
        between two steps, so under load it waited for the step in progress
        (22-25 ms p50 and up to 149 ms in the RL run on an H100) before the
        swap could resume. A version retired or replaced before any request
        came has its staging dropped by the workers' removal.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        deferred = lora_request.lora_int_id in self._ready
        if deferred:
            self._ready.discard(lora_request.lora_int_id)
            added = True
        else:
            added = bool(await self._engine.add_lora(lora_request))
        log_event(
            "adapter_installed",
            lora_name=lora_request.lora_name,
            staged=self.available,
            on_first_request=deferred,
            install_ms=round((loop.time() - started) * 1000, 2),
        )
        return added

    async def _stage(
        self, lora_request: Any, replaces: int | None, weights_fd: int | None
    ) -> tuple[int, list[dict[str, Any]]]:
        """Stage on every worker and wait until all are ready.

        Returns the polls it took and every worker's ready status.
        """
        lora_id = lora_request.lora_int_id
        fields = {
            "lora_name": lora_request.lora_name,
            "lora_int_id": lora_id,
            "lora_path": lora_request.lora_path,
        }
        await self._request_staging(fields, replaces, weights_fd)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.timeout_s
        delay = self._config.first_poll_s
        polls = 0
        asked_at = loop.time()
        while True:
            polls += 1
            by_rpc = loop.time() - asked_at >= self._config.rpc_check_s
            if by_rpc:
                asked_at = loop.time()
            statuses = await self._statuses(lora_id, by_rpc)
            states = [s["state"] for s in statuses]
            failed = [s["error"] for s in statuses if s["state"] == FAILED]
            if failed:
                await self.discard(lora_id)
                raise StagingError(failed[0])
            if all(state == READY for state in states):
                self._ready.add(lora_id)
                return polls, statuses
            if UNKNOWN in states or loop.time() > deadline:
                await self.discard(lora_id)
                raise StagingError(f"staging of adapter {lora_id} was lost or timed out")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._config.max_poll_s)

    async def _request_staging(
        self, fields: dict[str, Any], replaces: int | None, weights_fd: int | None
    ) -> None:
        """Ask every worker to stage: over the stage channel where there is
        one (no step boundary to wait for), else by RPC, after writing the
        snapshot's weights file from ``weights_fd`` (an RPC carries no file).

        Over the channel, the replaced version's drop still runs in the step
        loop, by an RPC that is sent here and not waited for: the engine
        serves its input in order, so the drop comes before any request that
        could install the new version (those are sent after the staging is
        ready, and this task sends its message at its first turn, within the
        first poll below).
        """
        channel = self._channel
        fds = () if weights_fd is None else (weights_fd,)
        message = {"request": fields, "replaces": replaces}
        if channel is not None and channel.send(message, fds):
            if replaces is not None:
                drop = asyncio.create_task(
                    compat.collective_rpc(self._engine, "skyrl_drop_replaced", replaces)
                )
                self._drops.add(drop)
                drop.add_done_callback(self._dropped)
            return
        self._channel = None
        if weights_fd is not None:
            await self._write_weights(weights_fd, fields["lora_path"])
        await compat.collective_rpc(self._engine, "skyrl_stage_lora", fields, replaces)

    @staticmethod
    async def _write_weights(weights_fd: int, snapshot: str) -> None:
        """The snapshot's weights file, copied here from the file the
        registry holds open, for workers that will read the snapshot."""
        folder = Path(snapshot)
        await asyncio.to_thread(write_weights_from, weights_fd, folder, handover.WEIGHTS_FILE)

    def _dropped(self, drop: asyncio.Task[list[Any]]) -> None:
        self._drops.discard(drop)
        if not drop.cancelled() and drop.exception() is not None:
            logger.warning("the replaced version's drop failed: %r", drop.exception())

    async def _statuses(self, lora_id: int, by_rpc: bool = False) -> list[dict[str, Any]]:
        """Every worker's status of one staging: from the files the workers
        publish (a finished staging's file is read once, then removed), else,
        or when ``by_rpc`` (a file that never came must not hang the load),
        by RPC, served between two engine steps."""
        if self._workers is not None and self._status_dir is not None:
            paths = [self._status_dir / status_file(lora_id, w) for w in self._workers]
            if all(path.exists() for path in paths):
                statuses = [json.loads(path.read_text()) for path in paths]
                for path in paths:
                    path.unlink()
                return statuses
            if not by_rpc:
                return [{"state": PENDING}]
        return list(await compat.collective_rpc(self._engine, "skyrl_lora_staged", lora_id))

    async def remove_lora(self, lora_id: int) -> bool:
        self._ready.discard(lora_id)
        return bool(await self._engine.remove_lora(lora_id))

    async def discard(self, lora_id: int) -> None:
        self._ready.discard(lora_id)
        if self.available:
            await compat.collective_rpc(self._engine, "skyrl_discard_staged", lora_id)
