"""Helpers for server tests: fake compile queue and worker pool (no torch), a fake model directory, and small
functions that create users, devices and jobs through the API."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from safetensors.numpy import save, save_file
from sqlalchemy.orm import Session, sessionmaker

from server.compile_queue import export_inference, export_merged
from server.settings import Settings
from server.state import jobs
from server.store import ArtifactStore
from shared.files import atomic_write_bytes as write_atomic
from shared.files import sha256_file
from tests.utils.manifests import fake_manifest

ADMIN_TOKEN = "admin-secret-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HIDDEN, LAYERS = 8, 2


def program_config(spec: dict[str, Any], answer_len: int, **resolved: Any) -> dict[str, Any]:
    """The program config (as JSON) a server compiles for ``spec`` with ``answer_len`` and what the model resolves
    (``chat``, ``objective``, ``candidates``, ``prior``) given: ``ProgramConfig.from_spec``, as
    ``server.compile.resolve_config`` ends."""
    from shared.manifest import ProgramConfig

    return ProgramConfig.from_spec(spec, answer_len, **resolved).model_dump(mode="json")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_fake_model(path: Path) -> Path:
    """A Llama-shaped directory (config + safetensors) with 8-wide projections; enough for registration."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    tensors = {"model.embed_tokens.weight": np.zeros((32, HIDDEN), np.float32)}
    for i in range(LAYERS):
        for proj, out in (("q_proj", HIDDEN), ("k_proj", 4), ("v_proj", 4), ("o_proj", HIDDEN)):
            tensors[f"model.layers.{i}.self_attn.{proj}.weight"] = np.zeros((out, HIDDEN), np.float32)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    return path


FAKE_PROGRAM_MB = 500  # the memory estimate of every fake program


class FakeCompileQueue:
    """Compiles synchronously into small fake files, through the real job transitions (``server.state``).

    ``hold = True`` leaves submitted jobs queued until ``run_pending()``; ``fail_with`` makes compiles fail. The
    LoRA layout of a fake program is the model's own (its linear layers), so a real model's adapters are real too.
    Merges are real (``export_merged``), run by ``merge_pool`` (default: in this process); each waits for
    ``merge_gate`` when one is set, and is counted in ``merges``.
    """

    def __init__(self, merge_pool: Any = None) -> None:
        self.hold = False
        self.fail_with: str | None = None
        self.pending: list[int] = []
        self.cancelled: list[int] = []
        self.merge_pool = merge_pool or InlinePool()
        self.merge_gate: threading.Event | None = None
        self.merges: list[str] = []

    def bind(self, sessions: sessionmaker[Session], store: ArtifactStore, settings: Settings) -> FakeCompileQueue:
        self.sessions, self.store = sessions, store
        return self

    def submit(self, job_id: int) -> None:
        self.pending.append(job_id)
        if not self.hold:
            self.run_pending()

    def cancel(self, job_id: int) -> None:
        self.cancelled.append(job_id)

    def recover(self) -> int:
        return 0

    def build_inference(self, model_dir: str, model_sha256: str, config: dict[str, Any], key: str) -> dict[str, Any]:
        """A real export (inference programs are not faked), in this process."""
        return export_inference(self.store, InlinePool().run, model_dir, model_sha256, config, key)

    def build_merged(self, model_dir: str, archive_sha256: str, dtype: str, key: str) -> dict[str, Any]:
        if self.merge_gate is not None:
            self.merge_gate.wait(60)
        self.merges.append(key)
        return export_merged(self.store, self.merge_pool.run, model_dir, archive_sha256, dtype, key)

    def close(self) -> None:
        pass

    def run_pending(self) -> None:
        while self.pending:
            self._compile(self.pending.pop(0))

    def _compile(self, job_id: int) -> None:
        with self.sessions() as session:
            work = jobs.start_compiling(session, job_id)
        if work is None:
            return
        with self.sessions() as session:
            if self.fail_with is not None:
                jobs.fail(session, job_id, self.fail_with, ("compiling",))
            else:
                jobs.finish_compiling(session, job_id, self._build(work.spec, work.model_sha256, work.model_dir))

    def _build(self, spec: dict[str, Any], model_sha: str, model_dir: str) -> dict[str, Any]:
        """Files and a manifest shaped like ``shared.program.export_program``'s, its LoRA layout the model's."""
        config = program_config(spec, spec["answer_len"] or 1)
        key = hashlib.sha256(json.dumps([model_sha, config], sort_keys=True).encode()).hexdigest()
        write_atomic(self.store.program(key), f"program {key}".encode())
        files = {"pte": self.store.program(key)}
        for entry, name, data in (("ptd", "weights", b"w" * 5000), ("tokenizer", "tokenizer", b"{}")):
            files[entry] = write_atomic(self.store.blobs_dir / f"{name}-{hashlib.sha256(data).hexdigest()}", data)
        lora, offset = [], 0
        for name, (out, inp) in _targets(model_dir, spec["targets"]):
            lora.append({"name": name, "in_features": inp, "out_features": out, "offset": offset})
            offset += out * spec["rank"]
        refs = {
            entry: {"file": path.name, "sha256": sha256_file(path), "size": path.stat().st_size}
            for entry, path in files.items()
        }
        manifest = fake_manifest(config, refs, lora, offset, FAKE_PROGRAM_MB)
        return {"key": key, "manifest": manifest, "answer_len": config["answer_len"]}


def _targets(model_dir: str, targets: list[str]) -> list[tuple[str, list[int]]]:
    """The model's linear layers of ``targets`` (name, [out, in]) in the order a program's LoRA takes them: layer by
    layer, in the order of the targets within a layer."""
    from shared.model_files import linear_modules

    found = [(name, shape) for name, shape in linear_modules(Path(model_dir)).items() if name.split(".")[-1] in targets]

    def place(item: tuple[str, list[int]]) -> tuple[int, int]:
        parts = item[0].split(".")
        return int(parts[2]), ORDER.index(parts[-1])

    return sorted(found, key=place)


ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class InlinePool:
    """Runs worker tasks in the test process (no spawn), as ``server.pool.WorkerPool`` would in a worker."""

    def run(self, fn, *args, timeout=None, key=None, owner=None):
        return fn(*args)

    def owner_full(self, owner) -> bool:
        return False  # no task waits: each runs in the request that asked for it

    def close(self) -> None:
        pass


def create_user(client: TestClient, name: str = "alice") -> dict[str, str]:
    r = client.post("/v1/users", json={"name": name}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return bearer(r.json()["api_key"])


def register_model(client: TestClient, path: Path, name: str = "tiny") -> dict[str, Any]:
    r = client.post("/v1/models", json={"name": name, "path": str(path)}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()


def enroll_device(client: TestClient, user: dict[str, str], name: str = "phone", backend: str = "executorch") -> dict:
    """→ {"id": device id, "headers": device bearer headers}."""
    code = client.post("/v1/enrollment-codes", json={}, headers=user).json()["code"]
    r = client.post("/v1/devices", json={"code": code, "name": name, "platform": "test", "backend": backend})
    assert r.status_code == 201, r.text
    return {"id": r.json()["device_id"], "headers": bearer(r.json()["token"])}


def submit_job(client: TestClient, user: dict[str, str], **overrides: Any) -> dict[str, Any]:
    body = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 2, **overrides}
    r = client.post("/v1/jobs", json=body, headers=user)
    assert r.status_code == 202, r.text
    return r.json()


def leased_job(client: TestClient, model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A user, their phone and a job (``overrides`` of its spec) it has leased on a fake model (fake compile), with a
    fake training's B and log: what the result and inference tests start from."""
    register_model(client, make_fake_model(model_dir))
    user = create_user(client)
    phone = enroll_device(client, user)
    job = submit_job(client, user, **overrides)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    return {"user": user, "phone": phone, "job": job, "lease": lease, "b": b, "log": log}


def b_flat_bytes(values: np.ndarray, name: str = "b_flat") -> bytes:
    return save({name: values})


def fake_training(
    spec: dict[str, Any], d: int, init: np.ndarray | None = None, seed: int = 1
) -> tuple[np.ndarray, str]:
    """A log a device could have written (random losses, their g, the job's seeds and lr schedule; a private job's:
    small noisy g alone) and the B it leads to (with the job's optimizer)."""
    import torch

    from server.verify import expected_lr
    from shared.noise import step_seed
    from shared.replay import replay
    from shared.train_log import log_line, log_record

    rng = np.random.default_rng(seed)
    lines = []
    for step in range(spec["steps"]):
        losses = rng.uniform(1, 2, size=2 * spec["q"]).astype(np.float32)
        g = (losses[0::2] - losses[1::2]) / (np.float32(spec["eps"]) * np.float32(2))  # as the program computes it
        if spec.get("privacy"):  # within the job's bound on |g|; the losses stay on the device
            g, losses = (rng.standard_normal(spec["q"]) * 0.1).astype(np.float32), None
        lr = expected_lr(spec, step)  # the job's schedule, as the device's batches carry it
        lines.append(log_line(log_record(step, step_seed(spec["seed"], step), lr, spec["eps"], g, losses)))
    start = torch.zeros(d) if init is None else torch.from_numpy(init)
    records = [json.loads(line) for line in lines]
    return replay(start, records, spec.get("optimizer") or "sgd").numpy(), "".join(lines)


def upload(client: TestClient, device: dict, job_id: int, b: bytes, log: str, metrics: bytes = b'{"steps": 3}'):
    files = {
        "b_flat": ("b_flat.safetensors", b),
        "log": ("log.jsonl", log.encode()),
        "metrics": ("metrics.json", metrics),
    }
    return client.post(f"/v1/work/job-{job_id}/result", files=files, headers=device["headers"])


def run_out_the_clock(db_url: str, job_id: int) -> None:
    """Move the job's open round's deadline into the past, as if its timeout had passed (the server's sweeper,
    every 0.5 s, acts on it): deadline tests then wait for no clock, however slow the machine. Works on the
    database of a server in another process too."""
    from datetime import timedelta

    from sqlalchemy import update

    from server.db import make_engine
    from server.tables import Round, utcnow

    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            moved = conn.execute(
                update(Round)
                .where(Round.job_id == job_id, Round.status == "open", Round.deadline_at.is_not(None))
                .values(deadline_at=utcnow() - timedelta(seconds=1))
            ).rowcount
        assert moved == 1, "no open round with a running clock"
    finally:
        engine.dispose()
