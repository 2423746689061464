"""The device's side of the REST API (``/v1``), parsed with the server's own schemas (``shared.schemas``).

Every call is one attempt that raises ``shared.http_client.ServerError`` (an ``httpx.HTTPStatusError``) or
``httpx.TransportError`` on failure, so the caller's retry policy (``shared.retry``) can tell "try later" from
"never". What the agent sends: its
enrollment (name, platform, backend, memory), lease requests (backend, free memory), heartbeats (step, loss,
steps/s), results (B, the training log, metrics) and why it gave up on a job — never the training data.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import httpx

from shared import http_client
from shared.http_client import checked
from shared.manifest import InferenceConfig
from shared.retry import retry_after_header
from shared.schemas import (
    AdapterPublic,
    CpuReport,
    DeviceCreate,
    DeviceEnrolled,
    HeartbeatCreate,
    HeartbeatPublic,
    InferenceCreate,
    InferencePublic,
    JobFailureCreate,
    LeaseCreate,
    LeasePublic,
    ModelsPublic,
    ResultPublic,
    RoundReportPublic,
    work_name,
)

USER_AGENT = "mobizo-agent"


def client(
    server_url: str, token: str | None = None, transport: httpx.BaseTransport | None = None, timeout: float = 60.0
) -> httpx.Client:
    """The agent's client (``shared.http_client.client``), naming itself ``mobizo-agent`` in its requests."""
    return http_client.client(server_url, token, transport, timeout, USER_AGENT)


def enroll(http: httpx.Client, body: DeviceCreate) -> DeviceEnrolled:
    return DeviceEnrolled.model_validate(checked(http.post("/v1/devices", json=body.model_dump())).json())


def work_path(work: int | str) -> str:
    """Where a piece of work's heartbeats, result and failure go: a lease's ``work_path`` as it is; a bare job id
    (a job the agent ran before it kept the lease) → ``/v1/work/job-{id}``."""
    return work if isinstance(work, str) else f"/v1/work/{work_name(work)}"


@dataclass(frozen=True)
class NoWork:
    """No job for this device now; ask again no sooner than ``retry_after_s`` (0: whenever; ``server.pace``)."""

    retry_after_s: float = 0.0


class DeviceAPI:
    """Calls made with a device token."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def lease(
        self, backend: str, memory_mb: int | None, eligible: bool | None = None, cpu: CpuReport | None = None
    ) -> LeasePublic | NoWork:
        """The next job that fits what this device reports now (its backend, its free memory, whether its policy
        holds: round work only then; and its CPU), or ``NoWork`` (204) with the wait the server asks for."""
        body = LeaseCreate(backend=backend, memory_mb=memory_mb, eligible=eligible, cpu=cpu).model_dump()
        response = checked(self.http.post("/v1/leases", json=body))
        if response.status_code == 204:
            return NoWork(retry_after_header(response) or 0.0)
        return LeasePublic.model_validate(response.json())

    def heartbeat(self, work: int | str, body: HeartbeatCreate) -> HeartbeatPublic:
        response = self.http.post(f"{work_path(work)}/heartbeat", json=body.model_dump())
        return HeartbeatPublic.model_validate(checked(response).json())

    def upload(
        self, work: int | str, b_flat: bytes | None, log: bytes, metrics: bytes
    ) -> ResultPublic | RoundReportPublic:
        """A work item's result: B (None for an item whose ``spec.upload`` is ``log``, as every round part's),
        the log and metrics. A job answers its adapter version (``ResultPublic``); a round part, the B its log
        replays to (``RoundReportPublic``)."""
        files = (
            {} if b_flat is None else {"b_flat": ("b_flat.safetensors", io.BytesIO(b_flat), "application/octet-stream")}
        )
        files["log"] = ("train_log.jsonl", io.BytesIO(log), "application/x-ndjson")
        files["metrics"] = ("metrics.json", io.BytesIO(metrics), "application/json")
        path = work_path(work)
        answer = checked(self.http.post(f"{path}/result", files=files)).json()
        part = path.rpartition("/")[2].startswith("part-")
        return (RoundReportPublic if part else ResultPublic).model_validate(answer)

    def fail(self, work: int | str, error: str) -> None:
        """Give up on a leased job (it fails on the server with this reason, which reaches the user), or on a part in
        a round (its slot goes to another device)."""
        body = JobFailureCreate(error=error[:4000]).model_dump()
        checked(self.http.post(f"{work_path(work)}/fail", json=body))

    def registered_models(self) -> set[str]:
        """Content hashes of the server's models (the torch backend checks its local copy against them)."""
        models = ModelsPublic.model_validate(checked(self.http.get("/v1/models")).json())
        return {model.sha256 for model in models.data}

    def adapter(self, adapter_id: int) -> AdapterPublic:
        """One of this device's user's adapters (model and LoRA layout; 404 for anyone else's)."""
        return AdapterPublic.model_validate(checked(self.http.get(f"/v1/device/adapters/{adapter_id}")).json())

    def inference_program(self, model: str, config: InferenceConfig) -> InferencePublic:
        """The model's inference program for this LoRA layout; 503 + Retry-After while the server compiles it."""
        body = InferenceCreate(model=model, config=config).model_dump(mode="json")
        return InferencePublic.model_validate(checked(self.http.post("/v1/device/inference", json=body)).json())
