"""A staging's status: what a worker publishes and the API server reads.

Each worker's staging thread (:mod:`.staging`) ends a staging with a status,
written as a file into a folder the API server polls (or answered by RPC
where it cannot see that folder); the API server's
:class:`.staged_engine.StagedLoRAEngine` waits for every worker's. Both
sides take its states, how the adapter was read, and the file's name from
here.
"""

from __future__ import annotations

#: A staging's ``state`` (:meth:`.staging._WorkerStaging.status`). A ready one also says
#: whether it was written into a free engine slot (``in_slot``, see
#: :mod:`skyrl_lora.server.loading.slots`), how its files were ``read`` (below) and how
#: many ``naps`` it took (:mod:`skyrl_lora.server.loading.staging_yield`); a failed one
#: carries the ``error``.
READY = "ready"
PENDING = "pending"
UNKNOWN = "unknown"
FAILED = "failed"

#: How a staging's files were read (a ready staging's ``read``): by the
#: reader process (:mod:`.adapter_reader`), or on the engine process's
#: staging thread in one call (:mod:`.adapter_file`) or by safetensors,
#: tensor by tensor (a file the one-call reader leaves to it).
READER = "reader"
ONE_BUFFER = "one_buffer"
SAFETENSORS = "safetensors"
#: Copied out of a trainer's memory (:mod:`.handover`), not read from a file,
#: and built by vLLM's loader, or from the last model of the same layout
#: (:mod:`.handover_template`).
HANDOVER = "handover"
HANDOVER_TEMPLATE = "handover_template"
#: Read in one call (as ``one_buffer``) and built from the template of the
#: file's layout, as a hand-over is (:mod:`.staged_buffer`).
FILE_TEMPLATE = "file_template"
#: A streamed push's receive area, copied to the GPU as its bytes landed and
#: built there from its layout's template (:mod:`.area_upload`).
AREA_UPLOAD = "area_upload"


def status_file(lora_int_id: int, worker: str) -> str:
    """The name of one worker's status file for one staging."""
    return f"{lora_int_id}-{worker}.json"
