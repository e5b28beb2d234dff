"""Property-based fuzzing of every /skyrl route from its own OpenAPI schema.

schemathesis generates requests from the schema the server publishes against
the real server. Every answer must be a status the schema documents, never a
5xx, and the server must stay healthy. Two passes: as tenant A (mostly the
authorization paths) and as the admin (the validation paths); after each
admin case that could pause, the engine and the case's adapter are resumed,
so fuzzing cannot leave the session's server frozen for later tests. A
``soak`` test: ``.ci/run`` runs it with ``SKYRL_TEST_SOAK_SCALE`` of the examples.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import TENANT_KEYS, EngineServer, soak_size

pytestmark = [pytest.mark.engine, pytest.mark.soak]

EXAMPLES_PER_ROUTE = soak_size(20, least=5)


def _skyrl_operations(server: EngineServer) -> list[Any]:
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    raw = requests.get(server.url + "/openapi.json", headers=admin, timeout=30).json()
    raw["paths"] = {p: v for p, v in raw["paths"].items() if p.startswith("/skyrl/")}
    return [result.ok() for result in schemathesis.openapi.from_dict(raw).get_all_operations()]


def _fuzz_one(operation: Any, check: Any) -> None:
    documented = {int(code) for code in operation.definition.raw.get("responses", {})}

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        check(case, documented)

    fuzz()


@pytest.mark.parametrize("who", ["tenant", "admin"])
def test_fuzzed_requests_get_documented_statuses_never_5xx(
    engine_server: EngineServer, who: str
) -> None:
    key = TENANT_KEYS["sec-a"] if who == "tenant" else engine_server.admin_key
    headers = {"Authorization": f"Bearer {key}"}
    admin = {"Authorization": f"Bearer {engine_server.admin_key}"}
    operations = _skyrl_operations(engine_server)
    assert len(operations) >= 8, [f"{o.method} {o.path}" for o in operations]
    seen: dict[str, set[int]] = {}

    def check(case: Any, documented: set[int]) -> None:
        response = case.call(base_url=engine_server.url, headers=headers, timeout=120)
        if case.path.endswith(("/pause", "/load", "/unload")):
            for body in ({}, {"lora_name": (case.body or {}).get("lora_name")}):
                requests.post(
                    engine_server.url + "/skyrl/v1/resume", json=body, headers=admin, timeout=30
                )
        where = f"{case.method} {case.path} {case.body!r:.300}"
        assert response.status_code < 500, (where, response.text)
        assert response.status_code in documented, (where, response.status_code, documented)
        seen.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)

    for operation in operations:
        _fuzz_one(operation, check)
    print(f"fuzzed statuses ({who}):", {k: sorted(v) for k, v in seen.items()})
    assert requests.get(engine_server.url + "/health", timeout=30).status_code == 200
