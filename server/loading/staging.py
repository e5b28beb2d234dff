"""Stage adapter weights off the engine's step loop.

vLLM loads a LoRA adapter inside the engine core's busy loop: ``add_lora``
reads the safetensors files, parses tensor names, checks shapes, converts
dtype and pins host memory, and no step runs meanwhile, so every tenant
stalls for as long as one tenant's reload takes (tens of ms on an H100, far
more for large adapters).

Here the expensive part moves to a background thread of each worker:

1. :meth:`LoRAStagingExtension.skyrl_stage_lora` (a ``collective_rpc`` call
   that only submits work and returns at once) builds vLLM's own
   ``LoRAModel`` for the request on a worker thread, with the worker's own
   loader, so validation and layout are exactly vLLM's (only its file read
   is ours: one call into one buffer, pinned where vLLM pins, see
   :mod:`skyrl_lora.server.adapters.adapter_file`), and packs it for
   the worker's layers (fused q/k/v and gate/up, scaling folded into B,
   pinned host copies) with the model manager's own packing. Where the
   adapter is paused and drained, the call first removes the version being
   replaced, so a server with every slot in use still has one to write
   (:meth:`_WorkerStaging._drop_replaced`).
2. Where an engine LoRA slot is free, the staging thread also copies the
   packed model into it (:mod:`skyrl_lora.server.loading.slots`): no request reads
   a slot before an adapter is active in it.
3. The API server waits until the model is ready or failed: each worker
   writes the staging's final status into a folder the API server polls
   (:meth:`_WorkerStaging.publish_statuses_to`), or, for a worker that cannot
   see it, answers :meth:`LoRAStagingExtension.skyrl_lora_staged` calls.
4. Nothing is called to install it: the version's first request makes vLLM
   load the adapter in that step (:meth:`.staged_engine.StagedLoRAEngine.add_lora`), and it
   finds the staged model: the worker's ``_load_adapter`` is wrapped to hand
   it out instead of reading the files again, the model manager's packing
   skips a model staging already packed, and its activation claims the slot
   already written, so what runs in the step loop is the cache insert and
   the slot bookkeeping (the copy into a slot too, when none was free while
   staging).

A hand-over (:mod:`.handover`) or a file read in one call is one buffer of
known layout (:mod:`.staged_buffer`), and a layout seen before is built
from its template (:mod:`.handover_template`) instead of by vLLM's loader.
On a GPU worker a hand-over from GPU memory stays on the GPU until it is
in its slot: copied there, folded and written there; its host copies are
made after the swap. A snapshot's weights file that the API server did
not write (a hand-over's, or a path load's whose file it handed over open)
is written after the swap too (:mod:`.snapshot_writer`). Scalings are
folded on the GPU where the tensors are pinned or already there
(:mod:`.scale_fold`). Stage requests come over a socket
beside the step loop where the worker shares the API server's host
(:mod:`.stage_channel`).

The staging thread shares the GIL with the step loop. While it runs Python,
the step loop waits up to the interpreter's switch interval (5 ms by
default) each time it wants the GIL back, so a staging runs with a short
one (:data:`STAGING_SWITCH_INTERVAL_S`), and, while the engine steps, in
short slices with naps between them (:mod:`skyrl_lora.server.loading.staging_yield`).

The extension is injected with vLLM's ``--worker-extension-cls`` (see
:func:`skyrl_lora.server.compat.add_worker_extension`); everything else in
vLLM is untouched. Where it is absent (a user brought their own extension),
:class:`.staged_engine.StagedLoRAEngine` falls back to a plain ``add_lora``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import compat, lora_metadata
from ..adapters import arrival
from ..adapters.adapter_file import OneBufferFile, UnsupportedFile
from ..adapters.cuda_streams import AFTER_SWAP, side_stream
from ..adapters.finite_check import ensure_finite, model_tensors, on_host
from ..adapters.scale_fold import multiply_in_place
from ..adapters.snapshot_writer import SNAPSHOT_MARKERS, SnapshotWriter, write_weights_from
from ..kernels import overlap, punica_ops
from ..logits_guard import LogitsGuard
from ..telemetry.loop_monitor import watch_engine_collections
from ..telemetry.observability import log_engine_event
from ..telemetry.step_watch import NOTHING_BUSY, StepWatch
from ..transfer import handover, tensor_pickle
from ..transfer.adapter_reader import AdapterReader, ReaderRoutedLoader
from ..transfer.handover import HandedOverFile
from ..transfer.handover_template import HandoverTemplates
from ..transfer.open_shares import DEFAULT_OPEN_SHARES, OpenShares
from ..transfer.pinned_reserve import PinnedReserve, ReserveReport, reserve, slot_bytes
from .slots import SlotPrefill
from .stage_channel import StageListener, socket_path
from .staged_buffer import BufferSource, TakenBuffer
from .staging_profile import StagingProfiler
from .staging_status import (
    AREA_UPLOAD,
    FAILED,
    FILE_TEMPLATE,
    HANDOVER,
    HANDOVER_TEMPLATE,
    ONE_BUFFER,
    PENDING,
    READER,
    READY,
    SAFETENSORS,
    UNKNOWN,
    status_file,
)
from .staging_yield import StagingYield, YieldPoints, install_yield_points

#: The staging thread runs in vLLM's engine process, where only vLLM's own
#: logger tree has a handler: a child of it puts our timings in vLLM's log.
logger = logging.getLogger("vllm.skyrl_lora.staging")

# vLLM imports this module in each worker, by the extension's name, before the
# worker builds the model: the LoRA kernels must be in place before the model's
# CUDA graphs are captured, since a graph replays the kernels it captured.
punica_ops.install()
overlap.install()
# The CPU build's LoRA ops would apply the last adapter slot to base-model rows
# batched beside an adapter's (:func:`..compat.mask_base_rows_in_cpu_lora_ops`).
compat.mask_base_rows_in_cpu_lora_ops()
# vLLM's LoRA on the logits runs only while a slot holds lm_head weights.
compat.skip_logits_lora_while_unweighted()


#: The longest the step loop waits for the GIL while a staging thread holds it.
STAGING_SWITCH_INTERVAL_S = 0.0005

#: The longest a staging from the stage channel waits for the replaced
#: version's drop (one step boundary) before it leaves its slot write to vLLM.
DROP_WAIT_S = 2.0
#: How many dropped versions a worker remembers for stagings that may wait for them.
MAX_DROPS_REMEMBERED = 64


@dataclass(frozen=True)
class _Staged:
    """A staging's result: vLLM's model, packed, how its files were read, its naps."""

    model: Any
    read: str
    naps: int
    #: Its file was read as it arrived (a streamed push, :mod:`.arrival`).
    followed: bool = False


class _WorkerStaging:
    """Per-worker state: one loader thread and the models it has built."""

    def __init__(
        self,
        lora_manager: Any,
        device: Any = None,
        slot_prefill: bool = True,
        reader_process: bool = False,
        staging_yield: StagingYield | None = None,
        model_runner: Any = None,
        gpu_staging: bool = True,
        open_shares: int = DEFAULT_OPEN_SHARES,
    ) -> None:
        self._manager = lora_manager
        self._device = device
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="skyrl-lora-stage"
        )
        self._lock = threading.Lock()
        #: The staging thread's own state while it loads (its reads go to the
        #: reader process, or come from a hand-over's tensors).
        self._staging_thread = threading.local()
        #: The thread building a model now (None: none is); read by the step watch.
        self._loading_thread: int | None = None
        self._routed_reads = self._route_reads_to_reader(lora_manager) if reader_process else None
        #: Buffers for the staging thread's one-call reads, pinned where vLLM pins.
        self._host_buffers = tensor_pickle.host_buffers(compat.lora_pin_memory())
        try:
            compat.route_lora_file_opens(self._open_in_one_buffer)
        except (ImportError, AttributeError) as exc:  # a vLLM whose loader moved
            logger.warning("skyrl-lora leaves adapter file reads to safetensors: %r", exc)
        #: Each staging's result, by adapter id.
        self._staged: dict[int, concurrent.futures.Future[_Staged]] = {}
        #: Hand-overs' and files' models by layout, and where their bytes come from.
        self._templates = HandoverTemplates()
        #: Trainers' CUDA shares, open from one hand-over to the next.
        self._shares = OpenShares(open_shares)
        self._buffers = BufferSource(
            self._host_buffers, device if gpu_staging else None, self._templates, self._shares
        )
        #: Snapshots' weights files written after the swap (hand-overs', held files').
        self._snapshots = SnapshotWriter(handover.WEIGHTS_FILE, SNAPSHOT_MARKERS)
        self._load_from_files = lora_manager._load_adapter
        self._install = lora_manager.add_adapter
        self._remove = lora_manager.remove_adapter
        lora_manager._load_adapter = self._load_adapter
        lora_manager.add_adapter = self._timed_install
        lora_manager.remove_adapter = self._remove_adapter
        #: Where each staging's status is published for the API server to read
        #: without a call into the step loop (:meth:`publish_statuses_to`),
        #: and where stage requests come in beside it (:mod:`.stage_channel`).
        self._status_dir: Path | None = None
        self._listener: StageListener | None = None
        #: Path loads' weights files, open, sent over the channel (by adapter id).
        self._held_files: dict[int, int] = {}
        #: Stagings from the channel that may wait for a replaced version's
        #: slot, by adapter id; versions the step loop dropped since.
        self._dropped = threading.Condition()
        self._slot_awaits: dict[int, int] = {}
        self._dropped_ids: dict[int, None] = {}
        self.worker_token = uuid.uuid4().hex
        #: Models packed on the staging thread; the in-loop packing skips them.
        self._packed: weakref.WeakSet[Any] = weakref.WeakSet()
        model_manager = compat.lora_model_manager(lora_manager)
        self._pack = getattr(model_manager, compat.LORA_PACKING_METHOD, None)
        if self._pack is not None:
            setattr(model_manager, compat.LORA_PACKING_METHOD, self._pack_unless_packed)
        #: Writes a packed model into a free engine slot, off the step loop too.
        self._slots = (
            SlotPrefill(model_manager, device)
            if slot_prefill and self._pack is not None and SlotPrefill.supports(model_manager)
            else None
        )
        #: Off unless the environment asks for profiles of the first stagings.
        self._profiler = StagingProfiler.from_env()
        #: Where the staging thread naps while the engine steps (None: it never does).
        self.yield_points = YieldPoints(staging_yield)
        if staging_yield is not None and not install_yield_points(
            self.yield_points, model_manager, model_runner
        ):
            logger.warning("skyrl-lora cannot see this worker's steps: stagings never nap")
            self.yield_points.config = None

    def _route_reads_to_reader(self, lora_manager: Any) -> ReaderRoutedLoader | None:
        """Hand the staging thread's file reads to a reader process (:mod:`.adapter_reader`)."""
        model_cls = getattr(lora_manager, compat.LORA_MODEL_CLASS_ATTR, None)
        if model_cls is None or not hasattr(model_cls, "from_local_checkpoint"):
            return None
        try:
            reader = AdapterReader(pin_memory=compat.lora_pin_memory())
        except Exception as exc:
            logger.warning("skyrl-lora adapter reader did not start, reads stay here: %s", exc)
            return None
        routed = ReaderRoutedLoader(
            model_cls,
            reader,
            lambda: (
                self._loading_here() and getattr(self._staging_thread, "handed_over", None) is None
            ),
        )
        setattr(lora_manager, compat.LORA_MODEL_CLASS_ATTR, routed)
        return routed

    def _open_in_one_buffer(self, path: str) -> OneBufferFile | HandedOverFile | None:
        """vLLM's loader's ``safe_open``: on the staging thread, the tensors of a
        hand-over, or one read into one buffer
        (:mod:`skyrl_lora.server.adapters.adapter_file`); None elsewhere, and for
        a file that reader leaves to safetensors."""
        if not self._loading_here():
            arrival.wait_whole(Path(path).parent)
            return None
        handed_over = getattr(self._staging_thread, "handed_over", None)
        if handed_over is not None:
            return handed_over
        try:
            opened = OneBufferFile(path, self._host_buffers)
        except UnsupportedFile as exc:
            logger.info("skyrl-lora reads %s with safetensors: %s", path, exc)
            arrival.wait_whole(Path(path).parent)
            return None
        self._staging_thread.one_buffer = True
        return opened

    @property
    def open_shares(self) -> int:
        """How many trainers' CUDA shares stay open between hand-overs, at most."""
        return self._shares.limit

    @property
    def slot_prefill(self) -> bool:
        return self._slots is not None

    @property
    def reader_process(self) -> bool:
        return self._routed_reads is not None

    @property
    def gpu_staging(self) -> bool:
        return self._buffers.on_gpu

    def reserve_pinned(self, config: PinnedReserve) -> ReserveReport:
        """Take the pinned host blocks this worker's stagings will hold, before
        it serves (:mod:`.pinned_reserve`); nothing where vLLM does not pin."""
        if not compat.lora_pin_memory():
            return ReserveReport(note="vLLM does not pin adapters' host copies here")
        model_manager = compat.lora_model_manager(self._manager)
        modules = getattr(model_manager, "modules", {})
        block_bytes = slot_bytes(modules.values(), config.rank)
        report = reserve(block_bytes, config.blocks, self._host_buffers)
        log_engine_event("pinned_reserve", **asdict(report))
        return report

    def _loading_here(self) -> bool:
        return self._loading_thread == threading.get_ident()

    def busy(self) -> frozenset[str]:
        """What of this worker's runs beside the step loop now (:mod:`..step_watch`).

        Called as every step begins: nothing busy, the usual case, costs two reads.
        """
        staging, writing = self._loading_thread is not None, self._snapshots.busy
        if not (staging or writing):
            return NOTHING_BUSY
        return frozenset(
            name for name, on in (("staging", staging), ("snapshot_write", writing)) if on
        )

    @property
    def staging_yield(self) -> bool:
        return self.yield_points.config is not None

    def stage(self, lora_request: Any, replaces: int | None = None) -> None:
        """Start building ``lora_request``'s model on the staging thread (runs in the step loop).

        ``replaces``: a version nothing can run on before this one is
        installed, dropped from the engine first (see :meth:`_drop_replaced`).
        """
        if replaces is not None:
            self._drop_replaced(replaces)
        self._submit(lora_request)

    def stage_beside_loop(self, lora_request: Any, replaces: int | None = None) -> None:
        """:meth:`stage` for a request that came over the stage channel
        (:mod:`.stage_channel`), on its thread, not in the step loop.

        The replaced version can only be removed in the step loop: the API
        server asks for that by RPC (:meth:`drop_replaced`), sent before any
        request that could install this version, so vLLM still removes it
        first. The staging does not wait for it unless it needs its engine
        slot (no other is free), and then only until the next step boundary.
        """
        if replaces is not None:
            with self._dropped:
                self._slot_awaits[lora_request.lora_int_id] = replaces
        self._submit(lora_request)

    def drop_replaced(self, lora_id: int) -> None:
        """The step loop's half of :meth:`stage_beside_loop`: drop ``lora_id``
        and tell a staging waiting for its slot."""
        self._drop_replaced(lora_id)
        with self._dropped:
            self._dropped_ids[lora_id] = None
            while len(self._dropped_ids) > MAX_DROPS_REMEMBERED:  # nobody waited for the oldest
                self._dropped_ids.pop(next(iter(self._dropped_ids)))
            self._dropped.notify_all()

    def _submit(self, lora_request: Any) -> None:
        future = self._pool.submit(self._profiled_load, lora_request)
        lora_id = lora_request.lora_int_id
        with self._lock:
            self._staged[lora_id] = future
        if self._status_dir is not None:
            future.add_done_callback(lambda done: self._publish(lora_id, done))

    def _write_slot(self, model: Any, check_finite: bool = False) -> bool:
        """Write ``model`` into a free slot; where none is and its staging
        came over the channel replacing a version, once more after that
        version's drop (:meth:`stage_beside_loop`). ``check_finite``: check
        the slot's new weights (:meth:`SlotPrefill.write`)."""
        if self._slots is None:
            return False
        written = self._slots.write(model, check_finite)
        with self._dropped:
            replaced = self._slot_awaits.pop(model.id, None)
            if written or replaced is None:
                return written
            dropped = self._dropped.wait_for(
                lambda: replaced in self._dropped_ids, timeout=DROP_WAIT_S
            )
            self._dropped_ids.pop(replaced, None)
        return dropped and self._slots.write(model, check_finite)

    def publish_statuses_to(self, folder: str | None) -> bool:
        """Write each staging's final status into ``folder`` (a directory the
        API server made and polls); False where this worker cannot see it
        (another host), and the API server then asks by RPC.

        A status asked by RPC is answered between two engine steps: under
        load each poll waited for the step in progress (25-40 ms on an H100
        in the RL run), so a 20 ms staging took 77-87 ms to be seen ready.
        """
        self._status_dir = Path(folder) if folder and os.path.isdir(folder) else None
        return self._status_dir is not None

    def listen(self) -> str | None:
        """Take stage requests on a socket in the status folder
        (:mod:`.stage_channel`); its path, or None where there is no folder
        or no socket could be made (the API server then stages by RPC)."""
        if self._status_dir is None:
            return None
        if self._listener is None:
            path = socket_path(self._status_dir, self.worker_token)
            try:
                self._listener = StageListener(path, self._take_request)
            except OSError as exc:
                logger.warning("skyrl-lora takes stage requests by RPC only: %s", exc)
                return None
        return str(self._listener.path)

    def _take_request(self, message: dict[str, Any], fds: list[int]) -> None:
        """A request from the channel, with the weights file it holds open, if
        any (this owns ``fds``, whatever happens)."""
        for extra in fds[1:]:
            os.close(extra)
        weights = fds[0] if fds else None
        try:
            request = compat.lora_request_class()(**message["request"])
        except BaseException:
            if weights is not None:
                os.close(weights)
            raise
        if weights is not None:
            self._hold_file(request.lora_int_id, weights)
        try:
            self.stage_beside_loop(request, message.get("replaces"))
        except BaseException:
            held = self._take_held_file(request.lora_int_id)
            if held is not None:
                os.close(held)
            raise

    def _hold_file(self, lora_int_id: int, fd: int) -> None:
        """Keep ``fd`` for ``lora_int_id``'s staging; closes one it replaces
        (the same request sent twice)."""
        with self._lock:
            replaced = self._held_files.pop(lora_int_id, None)
            self._held_files[lora_int_id] = fd
        if replaced is not None:
            os.close(replaced)

    def _take_held_file(self, lora_int_id: int) -> int | None:
        """The weights file held for ``lora_int_id``'s staging, now the caller's to close."""
        with self._lock:
            return self._held_files.pop(lora_int_id, None)

    def _publish(self, lora_int_id: int, done: concurrent.futures.Future[_Staged]) -> None:
        """The status of a finished staging, as a file (written whole, then renamed)."""
        assert self._status_dir is not None
        with self._lock:
            future = self._staged.get(lora_int_id)
        if future is not done:  # discarded meanwhile, or staged again (a request sent twice)
            return
        path = self._status_dir / status_file(lora_int_id, self.worker_token)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(self._finished_status(lora_int_id, future)))
        os.replace(partial, path)

    def _drop_replaced(self, lora_id: int) -> None:
        """Remove a version whose adapter is paused and drained, as vLLM's ``remove_lora`` does.

        The registry names one when a trainer paused the adapter before the
        reload, so none of its requests can run until the new version is
        installed. Left in place it keeps its engine slot and its entry in
        vLLM's CPU cache until it is retired after the resume. With every slot
        in use (one adapter per slot, ``--max-loras`` tenants) the new version
        then found no slot to be written into off the loop, and vLLM copied it
        into one in the step loop. Registering it also pushed the least
        recently used adapter out of the CPU cache, often another tenant's,
        whose next step read its files again in the step loop (30-75 ms on an
        H100 at 8 tenants). Should the new version never be installed (its
        staging fails), vLLM reads the old one again from its snapshot at its
        next request, as it does for any adapter it evicted.
        """
        started = time.perf_counter()
        self.discard(lora_id)  # a version no request came for holds its staging still
        if self._slots is not None:  # vLLM's own removal, under the slot table's lock
            removed = self._slots.remove_adapter(self._remove, lora_id)
        else:
            removed = self._remove(lora_id)
        if removed:
            logger.info(
                "skyrl-lora dropped the replaced adapter %d before staging in %.2f ms",
                lora_id,
                (time.perf_counter() - started) * 1000,
            )

    def status(self, lora_int_id: int) -> dict[str, Any]:
        """Where the staging of ``lora_int_id`` stands: ``{"state": ..., ...}``."""
        with self._lock:
            future = self._staged.get(lora_int_id)
        if future is None:
            return {"state": UNKNOWN}
        if not future.done():
            return {"state": PENDING}
        status = self._finished_status(lora_int_id, future)
        if status["state"] == FAILED:
            self.discard(lora_int_id)
        return status

    def _finished_status(
        self, lora_int_id: int, future: concurrent.futures.Future[_Staged]
    ) -> dict[str, Any]:
        """A finished staging's status, as :meth:`status` answers and
        :meth:`_publish` writes it."""
        error = future.exception()
        if error is not None:
            return {"state": FAILED, "error": f"{type(error).__name__}: {error}"}
        in_slot = self._slots is not None and self._slots.reserved(lora_int_id)
        staged = future.result()
        return {
            "state": READY,
            "in_slot": in_slot,
            "read": staged.read,
            "naps": staged.naps,
            "followed": staged.followed,
        }

    def discard(self, lora_int_id: int) -> None:
        held = self._take_held_file(lora_int_id)
        if held is not None:
            os.close(held)
        with self._lock:
            self._staged.pop(lora_int_id, None)
        if self._slots is not None:
            self._slots.release(lora_int_id)

    def _remove_adapter(self, lora_int_id: int) -> bool:
        """vLLM's removal, which also drops a staging never installed: the API
        server leaves the install to the version's first request
        (:meth:`.staged_engine.StagedLoRAEngine.add_lora`), and a version can be retired or
        replaced before any request came for it."""
        self.discard(lora_int_id)
        if self._shares.forget(lora_int_id):  # the adapter's newest version: unloaded
            self._snapshots.later(self._close_retired_shares)
        return bool(self._remove(lora_int_id))

    def _close_retired_shares(self) -> None:
        """Close the trainers' shares no adapter holds any more (on the
        snapshot writer's thread, after the swap).

        On a side stream: torch synchronizes the current stream before a
        share's close, and on the default stream that waited for the step.
        """
        started = time.perf_counter()
        with torch.cuda.stream(side_stream(self._device, AFTER_SWAP)):
            closed = self._shares.close_retired()
        if closed:  # none where an earlier call closed them all
            log_engine_event(
                "handover_shares_closed",
                count=closed,
                ms=round((time.perf_counter() - started) * 1000, 2),
            )

    def _profiled_load(self, lora_request: Any) -> _Staged:
        with self._profiler.capture(lora_request.lora_name):
            return self._timed_load(lora_request)

    def _timed_load(self, lora_request: Any) -> _Staged:
        """Read, validate and pack one adapter (on the staging thread)."""
        started = time.perf_counter()
        # The thread's CPU clock beside the wall clock: a phase that waits
        # for the GIL burns none of it, one that waits for the GPU spins
        # (CUDA's default schedule with one context), so under load the
        # two clocks tell which wait a slow phase is.
        cpu_started = time.thread_time()
        copy_cpu = None
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, STAGING_SWITCH_INTERVAL_S))
        self._loading_thread = threading.get_ident()
        self._staging_thread.one_buffer = False
        self._staging_thread.handed_over = None
        copy_ms = None
        arrival.take_followed()  # none of an earlier staging's
        try:
            with self.yield_points.yielding() as naps:
                handed = self._take(lora_request)
                if handed is not None:
                    copy_ms = round((time.perf_counter() - started) * 1000, 2)
                    copy_cpu = time.thread_time()
                template = None if handed is None else self._templates.get(handed.layout)
                cover: tuple[Any, ...] = ()
                if template is not None:
                    assert handed is not None
                    instance = template.instantiate(
                        handed.model_buffer, lora_request.lora_int_id, self._device
                    )
                    model, cover = instance.model, instance.cover
                    self._packed.add(model)
                    loaded = packed = time.perf_counter()
                else:
                    model, loaded = self._build(lora_request, handed)
                    packed = time.perf_counter()
            packed_cpu = time.thread_time()
            in_slot = self._checked_into_slot(model, lora_request.lora_name, cover)
        finally:
            self._loading_thread = None
            self._staging_thread.handed_over = None
            sys.setswitchinterval(switch_interval)
        if handed is not None and handed.writes_snapshot:  # after the swap: the file
            snapshot: Any = handed.snapshot_buffer
            if handed.on_device:  # a hand-over staged on the GPU: its host copies first
                assert template is not None
                snapshot = functools.partial(self._buffers.settle_on_host, model, template, handed)
            self._snapshots.submit(handed.folder, snapshot, handed.snapshot_layout)
        if self._shares.retired:  # the trainer handed over a new buffer
            self._snapshots.later(self._close_retired_shares)
        done = time.perf_counter()
        done_cpu = time.thread_time()
        times = self._routed_reads.last_read if self._routed_reads is not None else None
        read = SAFETENSORS
        if handed is not None and not handed.is_handover:
            read = ONE_BUFFER if template is None else FILE_TEMPLATE
            if handed.on_device:
                read = AREA_UPLOAD
        elif template is not None:
            read = HANDOVER_TEMPLATE
        elif handed is not None:
            read = HANDOVER
        elif times is not None:
            read = READER
        elif self._staging_thread.one_buffer:
            read = ONE_BUFFER
        follow = arrival.take_followed()
        followed = follow is not None
        # An event, not a message: the timeline lines each phase up with the
        # others' stalls (the event's ``at`` is its end; the phases run back to back).
        log_engine_event(
            "adapter_staging",
            lora_name=lora_request.lora_name,
            ms=round((done - started) * 1000, 2),
            read=read,
            followed=followed,
            read_ms=round((loaded - started) * 1000, 2),
            reader_ms=None if times is None else round(times.child_ms, 2),
            pack_ms=round((packed - loaded) * 1000, 2),
            slot_ms=round((done - packed) * 1000, 2) if in_slot else None,
            naps=naps.count,
            nap_ms=naps.slept_ms,
            # the staging thread's CPU time, whole and in the copy and slot phases
            cpu_ms=round((done_cpu - cpu_started) * 1000, 2),
            handover_copy_cpu_ms=(
                None if copy_cpu is None else round((copy_cpu - cpu_started) * 1000, 2)
            ),
            slot_cpu_ms=round((done_cpu - packed_cpu) * 1000, 2) if in_slot else None,
            # a hand-over's copies out of the trainer's memory (or a file's
            # read, and a held file's copy for the build), within read_ms
            handover_copy_ms=copy_ms,
            # of which allocating host buffers (pinned ones cost a driver call)
            host_alloc_ms=None if handed is None else handed.alloc_ms,
            # and a CUDA hand-over's open, copies (with their wait) and close
            **(
                {} if handed is None else {f"handover_{k}": v for k, v in handed.copy_parts.items()}
            ),
            # a read that followed a push's bytes: its waits for them, and
            # what it read after its wait for the last slice
            follow_wait_ms=None if follow is None else follow.waited_ms,
            follow_after_last_ms=None if follow is None else follow.after_last_ms,
        )
        return _Staged(model, read, naps.count, followed)

    @property
    def _on_gpu(self) -> bool:
        return str(self._device).startswith("cuda")

    def _checked_into_slot(self, model: Any, name: str, cover: tuple[Any, ...] = ()) -> bool:
        """Write ``model`` into a slot, its weights checked finite first
        (:mod:`.finite_check`): where they are computed with, so a host
        model on a GPU worker is checked in its GPU slot; one that found
        no slot on the host after all. ``cover``: fewer tensors that hold
        every weight of ``model`` (a template's runs), checked in its place."""
        tensors = list(cover) if cover else list(model_tensors(model))
        in_gpu_slot = on_host(tensors) and self._on_gpu
        if not in_gpu_slot:
            ensure_finite(tensors, f"adapter {name}")
        in_slot = self._write_slot(model, check_finite=in_gpu_slot)
        if in_gpu_slot and not in_slot:
            ensure_finite(tensors, f"adapter {name}")
        return in_slot

    def _take(self, lora_request: Any) -> TakenBuffer | None:
        """The request's bytes as one buffer (:mod:`.staged_buffer`): a
        hand-over, or a file unless a reader process reads files (one still
        arriving is read here, as its bytes land); None leaves the read to
        vLLM's loader (which reads the snapshot: a weights file held open is
        copied into it first)."""
        held = self._take_held_file(lora_request.lora_int_id)
        try:
            taken = self._buffers.take_handover(lora_request)
            follows = held is not None and arrival.arriving_file(f"/proc/self/fd/{held}")
            if taken is None and (self._routed_reads is None or follows):
                taken = self._buffers.take_file(lora_request, held)
            elif taken is None and held is not None:
                folder = Path(lora_request.lora_path)
                write_weights_from(held, folder, handover.WEIGHTS_FILE)
            return taken
        finally:
            if held is not None:
                os.close(held)

    def _build(self, lora_request: Any, handed: TakenBuffer | None) -> tuple[Any, float]:
        """vLLM's model for the request, packed; when it was loaded.

        A taken buffer's tensors (a hand-over's, or a file's one read) stand
        in for the files, and its packed model becomes the template of its
        layout (:mod:`.handover_template`).
        """
        if handed is not None:
            views = handover.tensor_views(handed.model_buffer, handed.description)
            self._staging_thread.handed_over = HandedOverFile(views)
            if handed.writes_snapshot:
                # vLLM's loader looks for the file before it opens it (the
                # opening is ours); the real one replaces this after the swap,
                # and until then the folder's marker (a hand-over's
                # description, or PENDING_FILE) says it is not written.
                (handed.folder / handover.WEIGHTS_FILE).touch()
        model = self._load_from_files(lora_request)
        loaded = time.perf_counter()
        if self._pack is not None:
            # batched, on the GPU where there is one: the pack's own folds are no-ops
            folded = compat.fold_lora_scalings(model, self._fold)
            self._pack(model)
            self._packed.add(model)
            if handed is not None and not self._templates.known(handed.layout):
                self._templates.learn(handed.layout, model, handed.model_buffer, folded)
        return model, loaded

    def _fold(self, tensors: list[Any], factor: float) -> None:
        multiply_in_place(tensors, factor, self._device)

    def _pack_unless_packed(self, model: Any) -> None:
        """The model manager's packing, skipped for a model packed while staged."""
        if model not in self._packed:
            assert self._pack is not None
            self._pack(model)

    def _timed_install(self, lora_request: Any) -> Any:
        """vLLM's ``add_adapter``, timed: this is what the step loop pays per load.

        vLLM calls it for every active adapter on every step (a no-op touch
        for one it has); only a real install is logged.
        """
        if lora_request.lora_int_id in self._manager.list_adapters():
            return self._install(lora_request)
        started = time.perf_counter()
        try:
            return self._install(lora_request)
        finally:
            if self._slots is not None:  # an install that failed before claiming its slot
                self._slots.release(lora_request.lora_int_id)
            log_engine_event(
                "adapter_install",
                lora_name=lora_request.lora_name,
                ms=round((time.perf_counter() - started) * 1000, 2),
            )

    def _load_adapter(self, lora_request: Any) -> Any:
        """vLLM's loader, short-cut by a finished staging of the same adapter id."""
        with self._lock:
            future = self._staged.pop(lora_request.lora_int_id, None)
        if future is not None and future.done() and future.exception() is None:
            return future.result().model
        self._snapshots.wait(lora_request.lora_path)  # a hand-over's file, still being written
        return self._load_from_files(lora_request)


class LoRAStagingExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``.

    Method names carry a ``skyrl_`` prefix: vLLM refuses an extension whose
    attributes collide with the worker's own.
    """

    _skyrl_staging: _WorkerStaging | None = None
    _skyrl_step_watch: StepWatch | None = None

    def _skyrl_stager(
        self,
        slot_prefill: bool = True,
        reader_process: bool = False,
        staging_yield: dict[str, float] | None = None,
        gpu_staging: bool = True,
        open_shares: int = DEFAULT_OPEN_SHARES,
    ) -> _WorkerStaging:
        if self._skyrl_staging is None:
            model_runner = getattr(self, "model_runner", None)
            manager = getattr(model_runner, "lora_manager", None)
            if manager is None:
                raise RuntimeError("LoRA is not enabled on this worker (--enable-lora)")
            self._skyrl_staging = _WorkerStaging(
                manager,
                getattr(self, "device", None),
                slot_prefill=slot_prefill,
                reader_process=reader_process,
                staging_yield=None if staging_yield is None else StagingYield(**staging_yield),
                model_runner=model_runner,
                gpu_staging=gpu_staging,
                open_shares=open_shares,
            )
        return self._skyrl_staging

    def skyrl_start_staging(
        self,
        slot_prefill: bool = True,
        reader_process: bool = False,
        staging_yield: dict[str, float] | None = None,
        status_dir: str | None = None,
        gpu_staging: bool = True,
        pinned_reserve: dict[str, Any] | None = None,
        long_step_s: float | None = None,
        open_shares: int = DEFAULT_OPEN_SHARES,
        host_lora_metadata: bool = True,
    ) -> dict[str, Any]:
        """Set staging up (once, at the server's start); says which parts are on
        and which GPU the worker drives (``device_uuid``, None on a CPU).

        ``staging_yield`` holds :class:`StagingYield`'s fields (None: stagings
        never nap). Also reports the engine process's long garbage collections
        (``engine_gc_pause`` events): one holds the step loop, and so every
        tenant's next token, as long as it runs. And guards the sampler
        against rows of non-finite logits (:mod:`..logits_guard`), which
        can otherwise kill the engine on vLLM 0.26. ``status_dir``: where to
        publish stagings' statuses (:meth:`_WorkerStaging.publish_statuses_to`).
        ``pinned_reserve``: :class:`PinnedReserve`'s fields (None: no reserve).
        ``long_step_s``: log steps longer than this (:mod:`..step_watch`; None: none).
        ``open_shares``: trainers' CUDA shares kept open (:mod:`.open_shares`).
        ``host_lora_metadata``: prepare the LoRA kernels' per-step metadata on
        the host, without vLLM's two GPU syncs (:mod:`..lora_metadata`).
        Each request's prompt logprobs are computed with its own adapter's
        logits mapping where the build needs it
        (:func:`..compat.per_request_prompt_logits`).
        """
        watch_engine_collections()
        stager = self._skyrl_stager(
            slot_prefill, reader_process, staging_yield, gpu_staging, open_shares
        )
        watching = long_step_s is not None and self._skyrl_watch_steps(stager, long_step_s)
        reserved = ReserveReport()
        if pinned_reserve is not None:
            reserved = stager.reserve_pinned(PinnedReserve(**pinned_reserve))
        return {
            "long_step_watch": watching,
            "pinned_reserve": asdict(reserved),
            "logits_guard": compat.wrap_sampler(getattr(self, "model_runner", None), LogitsGuard()),
            "cpu_seeded_requests": compat.keep_cpu_seeded_requests_alive(
                getattr(self, "model_runner", None)
            ),
            "host_lora_metadata": host_lora_metadata and self._skyrl_host_lora_metadata(),
            "grouped_lora_kernels": punica_ops.installed(),
            "lora_shrink_overlap": overlap.installed(),
            "fused_lora_layers": overlap.fused_installed(),
            "prompt_logits_per_request": compat.per_request_prompt_logits(
                getattr(self, "model_runner", None)
            ),
            "slot_prefill": stager.slot_prefill,
            "gpu_staging": stager.gpu_staging,
            "open_shares": stager.open_shares,
            "reader_process": stager.reader_process,
            "staging_yield": stager.staging_yield,
            "device_uuid": handover.cuda_device_uuid(getattr(self, "device", None)),
            "status_files": stager.publish_statuses_to(status_dir),
            "stage_socket": stager.listen(),
            "worker": stager.worker_token,
        }

    def _skyrl_host_lora_metadata(self) -> bool:
        """Prepare the LoRA kernels' metadata on the host (False where the
        model has no GPU Punica wrapper: the CPU build)."""
        wrappers = compat.punica_wrappers(getattr(self, "model_runner", None))
        for wrapper in wrappers:
            lora_metadata.install(wrapper)
        return bool(wrappers)

    def _skyrl_watch_steps(self, stager: _WorkerStaging, long_step_s: float) -> bool:
        """Log this worker's long steps (once per worker)."""
        if self._skyrl_step_watch is None:
            watch = StepWatch(long_step_s, busy=stager.busy)
            if not compat.watch_model_steps(getattr(self, "model_runner", None), watch):
                return False
            self._skyrl_step_watch = watch
        return True

    def skyrl_stage_lora(self, request: dict[str, Any], replaces: int | None = None) -> None:
        self._skyrl_stager().stage(compat.lora_request_class()(**request), replaces)

    def skyrl_drop_replaced(self, lora_int_id: int) -> None:
        self._skyrl_stager().drop_replaced(lora_int_id)

    def skyrl_lora_staged(self, lora_int_id: int) -> dict[str, Any]:
        return self._skyrl_stager().status(lora_int_id)

    def skyrl_discard_staged(self, lora_int_id: int) -> None:
        self._skyrl_stager().discard(lora_int_id)
