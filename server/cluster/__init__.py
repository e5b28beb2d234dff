"""Servers as units: Ray actors, replica groups that heal themselves, child processes.

Owns the server actor (``actor``), the replica group (``group``), how a
fresh replica is brought to the others' adapters (``replay``), a local
server on the embedded model for scripts (``local``), and ``serve`` as a
child process stopped without leftovers (``process``). May import every
other server package.
"""
