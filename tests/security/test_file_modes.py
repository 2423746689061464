"""Issue 9 item 11: private data and credentials are 0600 in 0700 folders whatever the umask (tested under 022).

The server's store (database, adapters, logs, archives, spool) after a real upload, and the agent's job folder
(tokenized data, training log, checkpoint, lease).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from device_agent.batches import Shape, write_batches
from device_agent.checkpoint import Checkpoint, save_checkpoint
from device_agent.job import JobDir
from device_agent.trainlog import LogWriter
from server.app import create_app
from server.settings import Settings
from shared.schemas import LeasePublic
from shared.train_log import log_record
from tests.device_agent.helpers import random_steps
from tests.server.factories import (
    ADMIN_TOKEN,
    FakeCompileQueue,
    InlinePool,
    b_flat_bytes,
    create_user,
    enroll_device,
    fake_training,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _assert_private_tree(root: Path) -> list[Path]:
    """Every folder under ``root`` (and root) 0700, every file 0600 → the files."""
    assert _mode(root) == 0o700, root
    files = []
    for path in root.rglob("*"):
        if path.is_dir():
            assert _mode(path) == 0o700, path
        else:
            assert _mode(path) == 0o600, path
            files.append(path)
    return files


def test_server_store_and_database_are_private(umask_022, tmp_path):
    data = tmp_path / "data"
    settings = Settings(data_dir=data, admin_token=ADMIN_TOKEN, lease_s=60)  # SQLite in the data dir
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    with TestClient(app) as client:
        app.state.verify_pool.close()
        app.state.verify_pool = InlinePool()
        register_model(client, make_fake_model(tmp_path / "model"))
        user = create_user(client)
        phone = enroll_device(client, user)
        submit_job(client, user)
        lease = client.post("/v1/leases", headers=phone["headers"]).json()
        b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
        assert upload(client, phone, lease["job_id"], b_flat_bytes(b), log).status_code == 201
        files = _assert_private_tree(data)
    names = {p.relative_to(data).parts[0] for p in files}
    assert {"mobizo.db", "adapters", "logs", "archives", "programs", "blobs"} <= names


def test_agent_job_folder_is_private(umask_022, tmp_path):
    jobs = JobDir(tmp_path / "work" / "jobs" / "7")
    jobs.root.mkdir(parents=True)  # made under the umask: 0755; the agent makes it private when it takes the job
    jobs.save_lease(LeasePublic.model_construct(job_id=7))
    shape = Shape(rows=2, seq_len=8, answer_len=1)
    write_batches(jobs.batches, shape, random_steps(shape, vocab=32, count=3))
    with LogWriter(jobs.log) as writer:
        writer.write(log_record(0, 1, 0.1, 0.01, [0.5], [1.0, 2.0]))
    save_checkpoint(jobs.checkpoint, Checkpoint("7", 1, np.zeros(4, np.float32)))
    files = _assert_private_tree(jobs.root)
    assert {p.name for p in files} == {"lease.json", "batches.mzb", "train_log.jsonl", "checkpoint.ckpt"}
    assert _mode(tmp_path / "work" / "jobs") == 0o755  # folders the agent did not create are left alone
