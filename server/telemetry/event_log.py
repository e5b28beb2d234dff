"""Reading a server log's ``skyrl_event`` lines back, on a client's clock.

:mod:`.observability` writes them: the API process's lines carry their time
in the logger's stamp (UTC, to the millisecond), the engine process's (vLLM's
format, stamped to the second) in the event's own ``at`` (``time.time()``).
Benchmarks and the RL report line them up with windows they took with
``time.monotonic()``; ``wall_minus_monotonic_s`` (``time.time() -
time.monotonic()`` on the same machine) converts one into the other.
Standard library only: it runs where no vLLM is installed.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_API_EVENT = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*skyrl_event (\{.*\})")
_ENGINE_EVENT = re.compile(r"skyrl_event (\{\"event\": \"[a-z_]+\", \"at\": .*\})")


@dataclass(frozen=True)
class Event:
    at: float  # time.monotonic() of the reading process
    fields: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.fields.get("event"))


def read_events(lines: Iterable[str], wall_minus_monotonic_s: float) -> list[Event]:
    """The ``skyrl_event`` lines of a server log, on the reader's clock."""
    events = []
    for line in lines:
        match = _API_EVENT.match(line)
        if match is not None:
            wall = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            fields = json.loads(match.group(2))
            at = wall.replace(tzinfo=datetime.UTC).timestamp()
        elif (engine := _ENGINE_EVENT.search(line)) is not None:
            fields = json.loads(engine.group(1))
            at = fields.pop("at")
        else:
            continue
        events.append(Event(at - wall_minus_monotonic_s, fields))
    return events
