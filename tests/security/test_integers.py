"""Issue 9 defect 5: integers beyond 64 bits (in a path, a query, a body or a token) answered 500 and closed the
connection. Now every one answers 4xx: 422 for a field out of range, 401 for a token naming an impossible id."""

from __future__ import annotations

import pytest

from tests.security.conftest import on_both_databases
from tests.server.factories import bearer

HUGE = [2**31, 2**63 - 1, 2**63, 2**64, 10**30]


@on_both_databases
@pytest.mark.parametrize("value", HUGE)
def test_ids_in_paths_answer_422(live, people, value):
    user, device = people["user"], people["device"]["headers"]
    calls = [
        ("get", f"/v1/jobs/{value}", user, None),
        ("post", f"/v1/jobs/{value}/cancel", user, None),
        ("get", f"/v1/adapters/{value}", user, None),
        ("get", f"/v1/adapters/{value}/download", user, None),
        ("post", f"/v1/work/job-{value}/heartbeat", device, {"step": 1}),
        ("post", f"/v1/work/job-{value}/fail", device, {"error": "x"}),
        ("post", f"/v1/work/job-{value}/result", device, None),
    ]
    client = people["client"]
    for method, path, headers, body in calls:
        response = client.request(method, path, headers=headers, json=body)
        assert response.status_code == 422, (path, response.status_code)


@on_both_databases
@pytest.mark.parametrize("value", HUGE)
def test_counts_and_ids_in_queries_and_bodies_answer_422(live, people, value):
    client, user, device = people["client"], people["user"], people["device"]["headers"]
    job = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 2}
    responses = [
        client.get("/v1/jobs", params={"skip": value}, headers=user),
        client.get("/v1/adapters", params={"skip": value}, headers=user),
        client.post("/v1/jobs", json={**job, "device_id": value}, headers=user),
        client.post("/v1/jobs", json={**job, "init_adapter_id": value}, headers=user),
        client.post("/v1/devices", json={"code": "ABCD-EFGH-JKLM", "name": "x", "memory_mb": value}),
        client.post("/v1/leases", json={"memory_mb": value}, headers=device),
        client.post(f"/v1/work/job-{people['job']['id']}/heartbeat", json={"step": value}, headers=device),
    ]
    assert [r.status_code for r in responses] == [422] * len(responses), [r.text for r in responses]


@on_both_databases
@pytest.mark.parametrize("kind", ["mbzu", "mbzd"])
@pytest.mark.parametrize("row_id", [2**31, 2**63, 9999999999999999999])
def test_a_token_naming_an_impossible_id_answers_401(live, people, kind, row_id):
    response = people["client"].get("/v1/jobs", headers=bearer(f"{kind}_{row_id}_{'A' * 43}"))
    assert response.status_code == 401
