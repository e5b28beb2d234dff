"""Servers on Ray: one per actor, replica groups that heal themselves.

Owns the server actor (``actor``), the replica group (``group``), how a
fresh replica is brought to the others' adapters (``replay``) and a local
server on the embedded model for scripts (``local``). May import every other
server package.
"""
