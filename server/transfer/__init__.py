"""How an adapter's bytes reach the engine's host: hand-overs, receive areas, readers.

Owns copying weights out of a colocated trainer's memory (``handover``, its
CUDA shares kept open between hand-overs: ``open_shares``; a known layout's
model re-pointed from its template: ``handover_template``), a streamed push's
receive area copied to the GPU as its bytes land (``area_upload``), reading
an adapter in a process of its own, off the engine's GIL (``adapter_reader``,
whose model travels in one buffer: ``tensor_pickle``), and the host memory
those copies land in (``host_pool``, ``pinned_reserve``).

Sits above ``adapters`` and below ``loading``. May import ``adapters`` and
the server's base modules.
"""
