"""Adapter weights, from a file, an upload or a trainer's memory to an engine LoRA slot.

Owns the registry of names and versions (``registry``), reading adapter files
(``adapter_file``, ``adapter_reader``, ``tensor_pickle``, ``chunked``), also
while a streamed push still writes them (``arrival``; on a GPU, straight
from the push's receive area into GPU memory: ``area_upload``),
copying them out of a colocated trainer's memory (``handover``, its CUDA
shares kept open between hand-overs: ``open_shares``), building a
known layout's model from its template (``handover_template``, with the
buffers of ``staged_buffer``, on the GPU where there is one:
``cuda_streams``, ``scale_fold``), staging a version off the engine's step
loop (the workers' side ``staging``, ``staging_yield``; the API server's
``staged_engine``, which asks over ``stage_channel`` and waits for each
worker's ``staging_status``),
writing it into a slot (``slots``, ``slot_batch``) and a hand-over's
snapshot file after the swap (``snapshot_writer``). May import only the
server's top-level modules (compat, observability, loop_monitor).
"""
