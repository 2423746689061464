"""Issue 9 items 4, 7 and 14: what a device uploads cannot break the registry.

Metrics are validated (``shared.schemas.UploadMetrics``) before they are stored; logs are checked strictly (integer
seeds, steps 0, 1, … consecutive, g following from the losses, heartbeat progress within the job); an ExecuTorch
device's B must replay bit for bit, an eager-torch device's within the tolerance, and either way the registry
stores the replayed B: for every accepted upload, stored B == replay(stored log) bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import select

from server.tables import Adapter
from shared.replay import replay
from shared.train_log import read_log
from tests.server.factories import (
    b_flat_bytes,
    create_user,
    enroll_device,
    fake_training,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)
from tests.utils.fused import fused_replay


def _lease(client, user, device, **spec):  # noqa: F811 - client is the fixture's value
    job = submit_job(client, user, **spec)
    lease = client.post("/v1/leases", headers=device["headers"]).json()
    assert lease["job_id"] == job["id"]
    return lease


@pytest.fixture
def alice(client, tmp_path):  # noqa: F811
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    return {"user": user, "phone": enroll_device(client, user, "phone", "executorch")}


def _assert_registry_replays(client) -> int:  # noqa: F811
    """Every stored adapter's B is the replay of its stored log from its parent's stored B, bit for bit."""
    store = client.app.state.store
    with client.app.state.sessionmaker() as session:
        adapters = {a.id: a for a in session.scalars(select(Adapter))}
    for adapter in adapters.values():
        b = load_file(str(store.adapter_b(adapter.b_sha256)))["b_flat"]
        start = (
            torch.zeros_like(b)
            if adapter.parent_id is None
            else load_file(str(store.adapter_b(adapters[adapter.parent_id].b_sha256)))["b_flat"]
        )
        replayed = replay(start, read_log(store.log(adapter.log_sha256)))
        assert torch.equal(replayed.view(torch.int32), b.view(torch.int32)), adapter.id
    return len(adapters)


def _one_ulp(b: np.ndarray) -> np.ndarray:
    """B with every value moved by one float32 ulp: what eager torch on other hardware might give."""
    return np.nextafter(b, np.float32(np.inf), dtype=np.float32)


def test_executorch_devices_replay_bit_for_bit(client, alice):  # noqa: F811
    lease = _lease(client, alice["user"], alice["phone"])
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    r = upload(client, alice["phone"], lease["job_id"], b_flat_bytes(_one_ulp(b)), log)
    assert r.status_code == 422 and "bit for bit" in r.text
    assert upload(client, alice["phone"], lease["job_id"], b_flat_bytes(b), log).status_code == 201
    assert _assert_registry_replays(client) == 1


def test_an_update_computed_with_fused_multiply_adds_is_refused(client, alice):  # noqa: F811
    """A device build that fuses the update's multiply-adds (GCC's default on aarch64 without -ffp-contract=off)
    uploads a B a few ulps off the replay in many elements: refused. The same arithmetic rounded twice is accepted."""
    lease = _lease(client, alice["user"], alice["phone"])
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    records = [json.loads(line) for line in log.splitlines()]
    fused = fused_replay(np.zeros_like(b), records)
    assert np.count_nonzero(fused != b) > 0
    r = upload(client, alice["phone"], lease["job_id"], b_flat_bytes(fused), log)
    assert r.status_code == 422 and "bit for bit" in r.text
    unfused = fused_replay(np.zeros_like(b), records, fused=False)
    assert upload(client, alice["phone"], lease["job_id"], b_flat_bytes(unfused), log).status_code == 201


def test_eager_torch_devices_get_the_tolerance_and_the_registry_keeps_the_replay(client, alice):  # noqa: F811
    laptop = enroll_device(client, alice["user"], "laptop", "torch")
    lease = _lease(client, alice["user"], laptop)
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    uploaded = b_flat_bytes(_one_ulp(b))
    first = upload(client, laptop, lease["job_id"], uploaded, log)
    assert first.status_code == 201, first.text
    adapter = client.get(f"/v1/adapters/{first.json()['adapter_id']}", headers=alice["user"]).json()
    assert 0 < adapter["metrics"]["server"]["replay_max_abs_diff"] <= adapter["metrics"]["server"]["replay_tolerance"]
    stored = load_file(str(client.app.state.store.adapter_b(adapter["b_sha256"])))["b_flat"].numpy()
    np.testing.assert_array_equal(stored, b)  # the replay, not the upload
    # a repeat is recognised by the uploaded bytes; the replayed B uploaded instead is a different result
    assert upload(client, laptop, lease["job_id"], uploaded, log).status_code == 200
    assert upload(client, laptop, lease["job_id"], b_flat_bytes(b), log).status_code == 409
    # a continued job starts from the stored (replayed) B, and the registry still replays
    lease2 = _lease(client, alice["user"], laptop, init_adapter_id=adapter["id"])
    b2, log2 = fake_training(lease2["spec"], lease2["manifest"]["lora_size"], init=stored, seed=2)
    assert upload(client, laptop, lease2["job_id"], b_flat_bytes(_one_ulp(b2)), log2).status_code == 201
    assert _assert_registry_replays(client) == 2


def _edit(log: str, change) -> str:
    records = [json.loads(line) for line in log.splitlines()]
    change(records)
    return "".join(json.dumps(r) + "\n" for r in records)


def _shift_steps(records: list[dict]) -> None:
    for r in records:
        r["step"] += 1


def _skip_a_step(records: list[dict]) -> None:
    records[2]["step"] = 3


def _float_seed(records: list[dict]) -> None:
    records[0]["seed"] = float(records[0]["seed"])


def _big_g(records: list[dict]) -> None:
    records[1]["g"][0] = 1e30


def _negative_loss(records: list[dict]) -> None:
    records[0]["losses"][0] = -1.0


LAX_LOGS = {
    "first step is not 0": (_shift_steps, "step"),
    "steps not consecutive": (_skip_a_step, "step"),
    "float seed": (_float_seed, "seed"),
    "g that its losses do not give": (_big_g, "losses"),
    "negative loss": (_negative_loss, "loss"),
}


@pytest.mark.parametrize("case", list(LAX_LOGS))
def test_lax_logs_are_refused(client, alice, case):  # noqa: F811
    change, words = LAX_LOGS[case]
    lease = _lease(client, alice["user"], alice["phone"])
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    r = upload(client, alice["phone"], lease["job_id"], b_flat_bytes(b), _edit(log, change))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "log"], r.text
    assert words in r.json()["detail"][0]["msg"]
    assert _assert_registry_replays(client) == 0


def test_a_log_longer_than_the_job_is_refused_before_any_replay(client, alice):  # noqa: F811
    lease = _lease(client, alice["user"], alice["phone"])
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    calls = []
    client.app.state.verify_pool.run = lambda *a, **k: calls.append(a)
    r = upload(client, alice["phone"], lease["job_id"], b_flat_bytes(b), log * 2)
    assert r.status_code == 422 and "steps logged" in r.text and calls == []


def test_heartbeat_progress_beyond_the_job_is_refused(client, alice):  # noqa: F811
    lease = _lease(client, alice["user"], alice["phone"])
    url = f"/v1/work/job-{lease['job_id']}/heartbeat"
    steps = lease["spec"]["steps"]
    assert client.post(url, json={"step": steps}, headers=alice["phone"]["headers"]).status_code == 200
    r = client.post(url, json={"step": steps + 1}, headers=alice["phone"]["headers"])
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "step"]


def _nested(depth: int) -> bytes:
    return ('{"eval": ' + "[" * depth + "]" * depth + "}").encode()


BAD_METRICS = {
    "nested 300 deep": _nested(300),
    "nested 100,000 deep": _nested(100_000),
    "NaN": b'{"steps": 3, "train_time_s": NaN}',
    "Infinity in a list": b'{"losses": [1.0, Infinity]}',
    "a string where a number goes": b'{"steps": "many"}',
    "an eval entry that is not an object": b'{"eval": [5]}',
}


@pytest.mark.parametrize("case", list(BAD_METRICS))
def test_bad_metrics_are_refused_and_the_adapter_list_stays_readable(client, alice, case):  # noqa: F811
    lease = _lease(client, alice["user"], alice["phone"])
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    r = upload(client, alice["phone"], lease["job_id"], b_flat_bytes(b), log, BAD_METRICS[case])
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "metrics"], r.text
    assert upload(client, alice["phone"], lease["job_id"], b_flat_bytes(b), log).status_code == 201
    assert client.get("/v1/adapters", headers=alice["user"]).status_code == 200


def test_unknown_metrics_keys_are_dropped_and_known_ones_kept(client, alice):  # noqa: F811
    lease = _lease(client, alice["user"], alice["phone"])
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    sent = {"steps": 3, "losses": [1.5, 1.25, 1.0], "eval": [{"step": 3, "accuracy": 0.5}], "server": 1, "deep": {}}
    r = upload(client, alice["phone"], lease["job_id"], b_flat_bytes(b), log, json.dumps(sent).encode())
    assert r.status_code == 201, r.text
    metrics = client.get(f"/v1/adapters/{r.json()['adapter_id']}", headers=alice["user"]).json()["metrics"]
    assert {k: metrics[k] for k in ("steps", "eval")} == {k: sent[k] for k in ("steps", "eval")}
    logged = [json.loads(line)["losses"] for line in log.splitlines()]
    assert metrics["losses"] == [float(np.mean(step)) for step in logged]  # the verified log's, not the claim
    assert "deep" not in metrics and metrics["server"]["replay_max_abs_diff"] == 0.0


def test_every_device_backend_has_a_named_replay_check_and_an_unknown_one_has_none():
    """The server holds a backend to the replay by name: every backend a device can enroll with is listed (a new one
    fails here until someone decides), the ExecuTorch ones bit for bit; a name with no entry raises, never defaults."""
    from server.verify import REPLAY_CHECK, exact_replay
    from shared.backends import DEVICE_BACKENDS

    assert set(REPLAY_CHECK) == set(DEVICE_BACKENDS)
    assert [exact_replay(b) for b in ("executorch", "adb", "native", "torch")] == [True, True, True, False]
    with pytest.raises(ValueError, match="'vulkan'"):
        exact_replay("vulkan")
