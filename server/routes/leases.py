"""Devices take work: ``POST /v1/leases`` hands out the next ready job, heartbeats keep the lease alive.

With no job of its own user ready, an eligible device (``eligible`` not false) starts the next session of a standing
job of its user (``state.sessions.lease_session``: a job of its own, leased as any; either is one transition,
``state.leases.lease``), or else may get a part in a federated round of a cohort its user is in
(``server.federation.lease_round``): the lease then carries ``round``, and its work is ``part-{round client id}`` in
the work exchange (``routes/work.py``). Either way the lease names its files by content: the device downloads each
from ``GET /v1/blobs/{sha256}`` (``routes/blobs.py``), which grants them while the device holds the work.

An idle device is told when to ask again (204 with ``Retry-After``, its tenant's fair share of the server's check-in
rate) and refused (429) when it asks sooner (``server.pace``). A lease lasts ``lease_s`` seconds from the last
heartbeat. An expired lease returns the job to ``ready`` (the sweeper and every lease request apply that), up to
``max_attempts`` leases per job. A heartbeat on a cancelled job answers ``cancelled: true``; a heartbeat from a
device that lost its lease answers 409. A device that cannot finish reports it (``POST /v1/work/job-{id}/fail``)
and the job fails with its reason.
"""

from __future__ import annotations

from typing import Any

from fastapi import Response, status
from sqlalchemy.orm import Session

from server import federation, metrics
from server.deps import DeviceId, PaceDep, ProgramManifestsDep, SessionDep, SettingsDep, StoreDep, revoked
from server.grants import blob_ref, device_manifest
from server.lru import LRUCache
from server.responses import errors, try_later
from server.router import Router
from server.state import jobs, leases
from server.store import ArtifactStore
from server.tables import Adapter, Job, Round, RoundClient
from shared.manifest import ProgramFile, ProgramManifest
from shared.schemas import (
    FileRef,
    LeaseCreate,
    LeasePublic,
    RoundLeasePublic,
)

router = Router(tags=["leases"])


def _init_ref(store: ArtifactStore, b_sha256: str) -> FileRef:
    """The starting B of a work item."""
    return blob_ref(b_sha256, store.adapter_b(b_sha256).stat().st_size)


def _work_lease(manifest: ProgramManifest, init: FileRef | None, **fields: Any) -> LeasePublic:
    """The one lease builder: a work item (a job, or a client's part in a round) and its files, by content."""

    def ref(file: ProgramFile) -> FileRef:
        return blob_ref(file.sha256, file.size)

    program, weights, tokenizer = ref(manifest.pte), ref(manifest.ptd), ref(manifest.tokenizer)
    return LeasePublic(manifest=manifest, program=program, weights=weights, tokenizer=tokenizer, init=init, **fields)


def _lease(
    session: Session, store: ArtifactStore, manifest: ProgramManifest, job: Job, heartbeat_s: int
) -> LeasePublic:
    init = None
    if job.init_adapter_id is not None:
        init = _init_ref(store, session.get_one(Adapter, job.init_adapter_id).b_sha256)
    return _work_lease(
        manifest,
        init,
        job_id=job.id,
        attempt=job.attempts,
        spec=jobs.device_spec(job),
        expires_at=job.lease_expires_at,
        heartbeat_s=heartbeat_s,
    )


def _round_lease(
    session: Session,
    store: ArtifactStore,
    manifests: LRUCache[int, ProgramManifest],
    client: RoundClient,
    heartbeat_s: int,
) -> LeasePublic:
    round_ = session.get_one(Round, client.round_id)
    job = session.get_one(Job, round_.job_id)
    return _work_lease(
        device_manifest(session, manifests, job.program_id),
        _init_ref(store, round_.b_sha256),
        job_id=job.id,
        attempt=1,
        spec=federation.client_spec(job, client),
        expires_at=client.lease_expires_at,
        heartbeat_s=heartbeat_s,
        round=RoundLeasePublic(client_id=client.id, index=round_.index, deadline_at=round_.deadline_at),
    )


@router.post(
    "/v1/leases",
    response_model=LeasePublic,
    responses={
        204: {
            "description": "no job is ready for this device; with Retry-After (seconds) when the server's population "
            "is large: ask again no sooner (server.pace)"
        },
        **errors(
            400,
            401,
            403,
            413,
            422,
            429,
            e429="the device asked again sooner than the Retry-After it was told; Retry-After: the rest of that wait",
        ),
    },
)
def lease(
    device: DeviceId,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    manifests: ProgramManifestsDep,
    pace: PaceDep,
    body: LeaseCreate | None = None,
) -> LeasePublic | Response:
    """The next job (or round part) that fits what the device reports; 204 when none, with the wait the server
    asks of an idle device of its tenant (``server.pace``); 429 for a device asking sooner than it was told."""
    early = pace.too_soon(device.id)
    if early is not None:  # before anything is read or written for it
        raise try_later(status.HTTP_429_TOO_MANY_REQUESTS, f"asked sooner than told: retry after {early} s", early)
    leased = leases.lease(session, device, body, settings.lease_s, settings.max_attempts)
    if leased.revoked:
        raise revoked(device.id)
    if leased.job is not None:
        metrics.LEASES.labels("job").inc()
        manifest = device_manifest(session, manifests, leased.job.program_id)
        return _lease(session, store, manifest, leased.job, settings.heartbeat_s)
    if leased.eligible:  # round work, its own transitions: B_0 is published before a round 0 opens
        client = federation.lease_round(session, store, leased.device, settings.lease_s, settings)
        if client is not None:
            metrics.LEASES.labels("round").inc()
            return _round_lease(session, store, manifests, client, settings.heartbeat_s)
    wait = pace.retry_after_s(session, settings.checkin_rate, device.user_id)
    if wait is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    pace.told(device.id, wait)
    return Response(status_code=status.HTTP_204_NO_CONTENT, headers={"Retry-After": str(wait)})
