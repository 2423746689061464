"""Merged downloads (``server.merged_builds``) on a real tiny model: built off the request (503 + Retry-After, then the
file), one file per content key shared by adapters with the same base, B and layout, and the kept files within their
bounds per user and in all, the least recently downloaded evicted first. The merges are real (the fake compile
queue runs ``export_merged`` in this process); a ``mobizo server`` process merges in its compile worker, never in
its own process."""

from __future__ import annotations

import io
import threading
import time
import zipfile

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.merged_builds import MergeBounds
from server.settings import Settings
from tests.server.factories import (
    ADMIN_TOKEN,
    FakeCompileQueue,
    InlinePool,
    b_flat_bytes,
    create_user,
    enroll_device,
    fake_training,
    register_model,
    submit_job,
    upload,
)
from tests.server.live import mapped, server_pid, server_process

BIG = 1 << 40


@pytest.fixture
def alice(client, tiny_model_dir):
    """The real tiny model registered, and a user with a phone."""
    register_model(client, tiny_model_dir)
    user = create_user(client)
    return user, enroll_device(client, user)


def _adapter(client, user, phone, seed: int = 1) -> int:
    """A job of the user's, leased and trained by the phone (``fake_training`` with ``seed``) → its adapter's id."""
    job = submit_job(client, user)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"], seed=seed)
    r = upload(client, phone, job["id"], b_flat_bytes(b), log)
    assert r.status_code == 201, r.text
    return r.json()["adapter_id"]


def _merged(client, user, adapter_id: int, dtype: str = "float32", **headers: str):
    return client.get(f"/v1/adapters/{adapter_id}/merged", params={"dtype": dtype}, headers={**user, **headers})


def _download(client, user, adapter_id: int, dtype: str = "float32"):
    """The merged download, asked again while it builds or waits to (each 503 or 429 carries Retry-After) → the 200
    answer."""
    deadline = time.monotonic() + 120
    while (r := _merged(client, user, adapter_id, dtype)).status_code in (429, 503):
        assert int(r.headers["retry-after"]) >= 1 and time.monotonic() < deadline, r.text
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    return r


def _kept(client) -> dict[str, int]:
    """The store's merged files → their sizes."""
    return {p.stem: p.stat().st_size for p in (client.app.state.store.root / "merged").iterdir()}


def test_a_download_while_its_merge_builds_answers_503_then_the_file(client, queue, alice):
    user, phone = alice
    adapter_id = _adapter(client, user, phone)
    assert _merged(client, create_user(client, "bob"), adapter_id).status_code == 404  # not bob's to see
    queue.merge_gate = threading.Event()
    first = _merged(client, user, adapter_id)
    assert first.status_code == 503 and int(first.headers["retry-after"]) >= 1, first.text
    again = _merged(client, user, adapter_id)  # still building: nothing more started
    assert again.status_code == 503 and int(again.headers["retry-after"]) >= 1
    assert _kept(client) == {}
    queue.merge_gate.set()
    r = _download(client, user, adapter_id)
    assert r.headers["content-type"] == "application/zip" and len(queue.merges) == 1
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert {"config.json", "model.safetensors"} <= set(zf.namelist())
    assert _merged(client, user, adapter_id, **{"If-None-Match": r.headers["etag"]}).status_code == 304


def test_two_adapters_with_the_same_b_share_one_merged_file(client, queue, alice):
    """Two jobs trained alike give the same B in two archives (each card names its job): one merge serves both."""
    user, phone = alice
    first, second = _adapter(client, user, phone), _adapter(client, user, phone)
    shown = [client.get(f"/v1/adapters/{i}", headers=user).json() for i in (first, second)]
    assert shown[0]["b_sha256"] == shown[1]["b_sha256"] and shown[0]["job_id"] != shown[1]["job_id"]
    a = _download(client, user, first)
    b = _merged(client, user, second)  # at once: the first adapter's merge is this one's
    assert b.status_code == 200 and b.headers["etag"] == a.headers["etag"] and b.content == a.content
    assert len(queue.merges) == 1 and len(_kept(client)) == 1
    other = _adapter(client, user, phone, seed=2)  # another B: another merge
    assert _download(client, user, other).headers["etag"] != a.headers["etag"] and len(_kept(client)) == 2


def test_kept_merges_stay_within_their_bounds_the_least_recently_downloaded_evicted(client, queue, alice):
    """Per user: a third merge past the user's bound evicts the user's least recently downloaded (not the oldest
    built); in all: another user's merge past the total evicts the least recently downloaded of anyone's."""
    builds = client.app.state.merged_builds
    user, phone = alice
    mine = _adapter(client, user, phone)
    _download(client, user, mine, "float32")
    _download(client, user, mine, "bfloat16")
    (f32, s32), (bf16, s16) = sorted(_kept(client).items(), key=lambda kv: -kv[1])
    assert s16 < s32
    per_user = s32 + s16 + s16 // 2  # room for the float32 and one half-precision merge
    builds.bounds = MergeBounds(per_user, BIG, 1, 1)
    _download(client, user, mine, "float32")  # downloaded again: the bfloat16 merge is now the least recent
    _download(client, user, mine, "float16")
    kept = _kept(client)
    assert f32 in kept and bf16 not in kept and len(kept) == 2 and sum(kept.values()) <= per_user
    assert len(queue.merges) == 3
    f16 = next(k for k in kept if k != f32)

    bob = create_user(client, "bob")
    theirs = _adapter(client, bob, enroll_device(client, bob), seed=2)
    total = kept[f16] + s16 + s32 // 2  # room for two half-precision merges, not for the float32 one besides
    builds.bounds = MergeBounds(BIG, total, 1, 1)
    _download(client, bob, theirs, "bfloat16")
    kept = _kept(client)
    assert f32 not in kept and f16 in kept and len(kept) == 2 and sum(kept.values()) <= total
    assert _merged(client, user, mine, "float32").status_code == 503  # evicted: built again on request


def test_a_merge_larger_than_a_bound_is_refused_and_merges_at_once_are_bounded(client, queue, alice):
    builds = client.app.state.merged_builds
    user, phone = alice
    adapter_id = _adapter(client, user, phone)
    builds.bounds = MergeBounds(1000, BIG, 1, 1)
    r = _merged(client, user, adapter_id)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "dtype"], r.text
    assert "more than the server keeps for one user's merged downloads" in r.json()["detail"][0]["msg"]
    builds.bounds = MergeBounds(BIG, BIG, 2, 1)
    queue.merge_gate = threading.Event()
    try:
        assert _merged(client, user, adapter_id, "float32").status_code == 503
        busy = _merged(client, user, adapter_id, "float16")  # a second merge of the same user's at once
        assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
        assert "merges building for your downloads: 1 (at most 1)" in busy.json()["detail"]
    finally:
        queue.merge_gate.set()
    _download(client, user, adapter_id, "float16")


@pytest.mark.slow  # a server process, and its compile worker importing torch and transformers: about 30 s
def test_a_merge_runs_in_a_compile_worker_never_in_the_api_process(tmp_path, tiny_model_dir):
    """An adapter made by a server in this process; then a ``mobizo server`` process on the same data serves its
    merged download (503 until its compile worker has built it, then the file) and never maps torch (which PEFT and
    transformers need) into its own process."""
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    with TestClient(create_app(settings.model_copy(update={"admin_token": ADMIN_TOKEN}), FakeCompileQueue().bind)) as c:
        c.app.state.verify_pool = InlinePool()
        register_model(c, tiny_model_dir)
        user = create_user(c)
        adapter_id = _adapter(c, user, enroll_device(c, user))
    env = {"MOBIZO_DATA_DIR": str(settings.data_dir), "DATABASE_URL": settings.db_url}
    with server_process(env, tmp_path / "server.log") as url, httpx.Client(base_url=url, headers=user) as http:
        pid = server_pid(url)
        first = http.get(f"/v1/adapters/{adapter_id}/merged")
        assert first.status_code == 503 and int(first.headers["retry-after"]) >= 1, first.text
        deadline = time.monotonic() + 300
        while (r := http.get(f"/v1/adapters/{adapter_id}/merged")).status_code == 503:
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        assert r.status_code == 200 and zipfile.ZipFile(io.BytesIO(r.content)).testzip() is None, r.text
        assert mapped(pid, "torch") == [] and mapped(pid, "tokenizers") == []
