"""A device's part in a federated round, and the admin's view of a job's rounds.

A round lease (``POST /v1/leases`` answering with ``round`` set) names a round client; its device downloads the
cached program, weights, tokenizer and B_r (``init``) by content (``GET /v1/blobs/{sha256}``), and heartbeats,
gives up or uploads its log alone through the work exchange as ``part-{client id}`` (``routes/work.py``,
``server.results``). The server replays the log from B_r in a verify worker and records the client's B; the K-th
report closes the round (``server.federation``). An upload after the round closed, or after the client's lease ran
out, answers 409. Only the device holding the part sees any of it (404 for anyone else).
"""

from __future__ import annotations

from server import queries
from server.deps import AdminDep, ObjectId, SessionDep
from server.responses import errors, not_found
from server.router import Router
from server.tables import Job, RoundClient
from shared.schemas import (
    RoundClientPublic,
    RoundPublic,
    RoundsPublic,
)

router = Router(tags=["rounds"])


def _client_public(client: RoundClient) -> RoundClientPublic:
    return RoundClientPublic.model_validate(client, from_attributes=True)


@router.get("/v1/jobs/{job_id}/rounds", response_model=RoundsPublic, responses=errors(401, 403, 404, 422))
def list_rounds(job_id: ObjectId, _: AdminDep, session: SessionDep) -> RoundsPublic:
    """A federated job's rounds, each with its clients in aggregation order (admin)."""
    job = session.get(Job, job_id)
    if job is None or job.cohort_id is None:
        raise not_found("federated job")
    data = []
    for round_, clients in queries.rounds_of(session, job.id):
        fields = {name: getattr(round_, name) for name in RoundPublic.model_fields if name != "clients"}
        data.append(RoundPublic(**fields, clients=[_client_public(c) for c in clients]))
    return RoundsPublic(data=data, count=len(data))
