"""The device's side of the REST API (``/v1``), parsed with the server's own schemas (``shared.schemas``).

Every call is one attempt that raises ``shared.http_client.ServerError`` (an ``httpx.HTTPStatusError``) or
``httpx.TransportError`` on failure, so the caller's retry policy (``shared.retry``) can tell "try later" from
"never". What the agent sends: its
enrollment (name, platform, backend, memory), lease requests (backend, free memory), heartbeats (step, loss,
steps/s), results (B, the training log, metrics) and why it gave up on a job — never the training data.
"""

from __future__ import annotations

import io

import httpx

from shared import http_client
from shared.http_client import checked
from shared.schemas import (
    DeviceCreate,
    DeviceEnrolled,
    HeartbeatCreate,
    HeartbeatPublic,
    JobFailureCreate,
    LeaseCreate,
    LeasePublic,
    ModelsPublic,
    ResultPublic,
)

USER_AGENT = "mobizo-agent"


def client(
    server_url: str, token: str | None = None, transport: httpx.BaseTransport | None = None, timeout: float = 60.0
) -> httpx.Client:
    """The agent's client (``shared.http_client.client``), naming itself ``mobizo-agent`` in its requests."""
    return http_client.client(server_url, token, transport, timeout, USER_AGENT)


def enroll(http: httpx.Client, body: DeviceCreate) -> DeviceEnrolled:
    return DeviceEnrolled.model_validate(checked(http.post("/v1/devices", json=body.model_dump())).json())


class DeviceAPI:
    """Calls made with a device token."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def lease(self, backend: str, memory_mb: int | None) -> LeasePublic | None:
        """The next job that fits what this device reports now (its backend, its free memory), or None (204)."""
        body = LeaseCreate(backend=backend, memory_mb=memory_mb).model_dump()
        response = checked(self.http.post("/v1/leases", json=body))
        return None if response.status_code == 204 else LeasePublic.model_validate(response.json())

    def heartbeat(self, job_id: int, body: HeartbeatCreate) -> HeartbeatPublic:
        response = self.http.post(f"/v1/jobs/{job_id}/heartbeat", json=body.model_dump())
        return HeartbeatPublic.model_validate(checked(response).json())

    def upload(self, job_id: int, b_flat: bytes, log: bytes, metrics: bytes) -> ResultPublic:
        files = {
            "b_flat": ("b_flat.safetensors", io.BytesIO(b_flat), "application/octet-stream"),
            "log": ("train_log.jsonl", io.BytesIO(log), "application/x-ndjson"),
            "metrics": ("metrics.json", io.BytesIO(metrics), "application/json"),
        }
        return ResultPublic.model_validate(checked(self.http.post(f"/v1/jobs/{job_id}/result", files=files)).json())

    def fail(self, job_id: int, error: str) -> None:
        """Give up on a leased job: it fails on the server with this reason (which reaches the user)."""
        checked(self.http.post(f"/v1/jobs/{job_id}/fail", json=JobFailureCreate(error=error[:4000]).model_dump()))

    def registered_models(self) -> set[str]:
        """Content hashes of the server's models (the torch backend checks its local copy against them)."""
        models = ModelsPublic.model_validate(checked(self.http.get("/v1/models")).json())
        return {model.sha256 for model in models.data}
