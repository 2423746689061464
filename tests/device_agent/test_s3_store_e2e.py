"""Two API processes on different machines (each its own data dir) sharing one database and one S3 bucket
(``MOBIZO_STORE_URL``; a real S3-protocol server on loopback, moto's standalone server): a job compiled, trained
by a real agent and verified through server A is served whole by server B, whose data dir starts empty, with the
same bytes, ETags and Range answers as A's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx

from tests.device_agent.stack import Agent, Stack, ok, server_env
from tests.server import live
from tests.server.factories import bearer
from tests.utils.s3 import new_bucket, s3_env


def test_a_second_api_process_serves_what_the_first_stored_through_the_bucket(
    artifacts: Path, local_data: Path, tiny_model_dir: Path, tmp_path: Path, s3_endpoint: str
) -> None:
    bucket = {**s3_env(s3_endpoint), "MOBIZO_STORE_URL": new_bucket(s3_endpoint)}
    db, data_b = tmp_path / "db.sqlite", tmp_path / "data-b"
    with live.server_process({**server_env(artifacts, db), **bucket}, tmp_path / "server-a.log") as url_a:
        stack = Stack(url_a, artifacts, tmp_path, tiny_model_dir)
        job_id = stack.submit(steps=4)
        agent = Agent(stack.enroll(), tmp_path / "work", local_data, tmp_path / "agent.log")
        assert agent.start().wait() == 0, agent.tail()
        job = stack.job(job_id)
        assert job["status"] == "succeeded", job["error"]

        with live.server_process({**server_env(data_b, db), **bucket}, tmp_path / "server-b.log") as url_b:
            kinds = ("programs", "blobs", "adapters", "archives")
            held = {kind: sorted(p.name for p in (data_b / kind).iterdir()) for kind in kinds}
            assert held == dict.fromkeys(kinds, []), held
            device = bearer(json.loads(agent.config.read_text())["token"])
            again = stack.submit(steps=4)  # the same program: the device downloads its files while it holds it
            stack.wait_job(again, {"ready"})
            lease = ok(httpx.post(f"{url_b}/v1/leases", headers=device, timeout=60))
            assert lease["job_id"] == again
            files = [(device, lease[entry]["url"]) for entry in ("program", "weights", "tokenizer")]
            b_sha256 = ok(httpx.get(f"{url_a}/v1/adapters/{job['adapter_id']}", headers=stack.user.headers))["b_sha256"]
            files.append((device, f"/v1/blobs/{b_sha256}"))  # its user's adapter
            files.append((stack.user.headers, f"/v1/adapters/{job['adapter_id']}/download"))
            for headers, path in files:
                a = httpx.get(url_a + path, headers=headers, timeout=60)
                b = httpx.get(url_b + path, headers=headers, timeout=60)
                assert a.status_code == b.status_code == 200, (path, b.text)
                assert b.content == a.content and b.headers["etag"] == a.headers["etag"], path
                if path.startswith("/v1/blobs/"):  # their ETag is the content's sha256
                    assert b.headers["etag"] == f'"{hashlib.sha256(b.content).hexdigest()}"', path
                tail = httpx.get(url_b + path, headers={**headers, "Range": "bytes=10-"}, timeout=60)
                assert tail.status_code == 206 and tail.content == a.content[10:], path
            # B answered from its own data dir, filled from the bucket
            assert any((data_b / "programs").iterdir()) and any((data_b / "archives").iterdir())
            assert ok(httpx.get(f"{url_b}/v1/jobs/{job_id}", headers=stack.user.headers))["status"] == "succeeded"
