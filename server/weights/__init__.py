"""Adapter weights, from a file, an upload or a trainer's memory to an engine LoRA slot.

Owns the registry of names and versions (``registry``), reading adapter files
(``adapter_file``, ``adapter_reader``, ``tensor_pickle``), copying them out of a
colocated trainer's memory (``handover``), staging a version
off the engine's step loop (``staging``, ``staging_yield``) and writing it
into a slot (``slots``, ``slot_batch``). May import only the server's
top-level modules (compat, observability, loop_monitor).
"""
