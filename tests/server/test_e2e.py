"""The whole flow against a real server process (uvicorn, loopback sockets, httpx) with a tiny model.

Admin creates a user and registers the model; the user submits a job, which the server finds compiled; a device
enrolls, leases, downloads the program (checking sha256), trains with the ExecuTorch runtime, posts heartbeats
and the result; the user downloads the adapter, ``peft`` loads it onto the base model and its logits are those of
the device's B. Runs on SQLite and, when configured, on PostgreSQL; both share one artifact directory.

The artifact directory's compile cache is seeded with the suite's ``TINY_Q4`` program (``SPEC`` is its job), as a
server that compiled it before would have it: a real compile of a training program in a server's worker process is
the subject of ``tests/test_demo.py`` (and of ``tests/server/test_celery.py``'s export killed mid-compile), and
saving an export here keeps the suite within its time.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from tests.server.conftest import pg_schema
from tests.server.factories import ADMIN_TOKEN, bearer
from tests.server.live import server_process
from tests.utils.program_cache import seed_server_program
from tests.utils.programs import TINY_Q4, TINY_Q4_JOB
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.slow

SPEC = {**TINY_Q4_JOB, "steps": 4}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_model_dir, program_factory) -> Path:
    folder = tmp_path_factory.mktemp("artifacts")
    assert seed_server_program(folder, tiny_model_dir, SPEC, program_factory) == TINY_Q4
    return folder


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, artifacts, tmp_path_factory, pg_url):
    tmp = tmp_path_factory.mktemp(request.param)
    env = {"MOBIZO_DATA_DIR": str(artifacts), "MOBIZO_ADMIN_TOKEN": ADMIN_TOKEN, "MOBIZO_LEASE_S": "60"}
    if request.param == "sqlite":
        with server_process({**env, "DATABASE_URL": f"sqlite:///{tmp / 'mobizo.db'}"}, tmp / "server.log") as url:
            yield url
    else:
        with pg_schema(pg_url) as db, server_process({**env, "DATABASE_URL": db}, tmp / "server.log") as url:
            yield url


def _ok(response, code: int = 200):
    assert response.status_code == code, response.text
    return response.json() if response.content else None


def _wait_for(http, job_id: int, statuses: set[str], timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _ok(http.get(f"/v1/jobs/{job_id}"))
        if job["status"] in statuses:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")


def _download(http, ref: dict, dest: Path) -> Path:
    data = http.get(ref["url"]).raise_for_status().content
    assert len(data) == ref["size"] and hashlib.sha256(data).hexdigest() == ref["sha256"]
    dest.write_bytes(data)
    return dest


def _batches(model_dir: Path, spec: dict, n_steps: int):
    """Each step's (input_ids, attention_mask, targets) from real SST-2 rows, as the agent would build them."""
    from shared.data import batch_indices, encode, load_examples, pad_token_id, training_batch
    from shared.hf_models import load_model
    from shared.tasks import get_task, task_data_dir

    _, tokenizer = load_model(model_dir)
    rendered = load_examples(get_task("sst2"), task_data_dir() / "sst2" / "train.jsonl", limit=64)
    examples = encode(rendered, tokenizer, max_len=spec["seq_len"])
    lengths, bucket = [len(e.prompt_ids) for e in examples], spec.get("bucket", 1)
    for step in range(n_steps):
        indices = batch_indices(len(examples), spec["batch_size"], spec["seed"], step, lengths, bucket)
        chosen = [examples[i] for i in indices]
        batch = training_batch(chosen, pad_token_id(tokenizer), spec["seq_len"], spec["answer_len"])
        yield step, batch.input_ids, batch.attention_mask, batch.targets


def _train_on_device(http, model_dir: Path, lease: dict, workdir: Path) -> tuple[np.ndarray, str]:
    """The device: load the program with the ExecuTorch runtime, run every step, heartbeat, keep the log."""
    from executorch.runtime import Runtime

    from shared.noise import step_seed
    from shared.schedule import lr_at
    from shared.train_log import log_line, log_record

    pte = _download(http, lease["program"], workdir / "program.pte")
    ptd = _download(http, lease["weights"], workdir / "weights.ptd")
    _download(http, lease["tokenizer"], workdir / "tokenizer.json")
    program = Runtime.get().load_program(pte, data_path=ptd)
    methods = {name: program.load_method(name) for name in ("forward", "get_lora_b")}  # load all before running
    spec, lines = lease["spec"], []
    for step, ids, mask, targets in _batches(model_dir, spec, spec["steps"]):
        seed = step_seed(spec["seed"], step)
        schedule = (spec["lr_schedule"], spec["warmup_steps"], spec["lr_floor"])
        lr = lr_at(spec["lr"], spec["steps"], step, *schedule)  # the job's schedule (a float32 value)
        inputs = [ids, mask, targets, torch.tensor([seed]), torch.tensor([lr]), torch.tensor([spec["eps"]])]
        losses, g = methods["forward"].execute(inputs)
        lines.append(log_line(log_record(step, seed, lr, spec["eps"], g.numpy(), losses.numpy())))
        progress = {"step": step + 1, "loss": float(losses.mean())}
        beat = _ok(http.post(f"/v1/work/job-{lease['job_id']}/heartbeat", json=progress))
        assert beat["cancelled"] is False
    return methods["get_lora_b"].execute([])[0].numpy().copy(), "".join(lines)


def _logits_with_b(model_dir: Path, spec: dict, b: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the base model with LoRA-FA (A from the seed) and the device's B, by mobizo's own layers."""
    from shared.hf_models import load_model
    from shared.lora import inject_lora

    model, _ = load_model(model_dir)
    lora = inject_lora(model, tuple(spec["targets"]), spec["rank"], spec["alpha"], spec["a_seed"])
    lora.apply(torch.from_numpy(b)[None])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _peft_logits(model_dir: Path, archive: bytes, workdir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        zf.extractall(workdir / "adapter")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(base, workdir / "adapter")
        return base_logits, peft_model(input_ids=ids).logits


def test_full_flow(server, tiny_model_dir, tmp_path):
    import httpx

    admin = httpx.Client(base_url=server, headers=bearer(ADMIN_TOKEN), timeout=60)
    key = _ok(admin.post("/v1/users", json={"name": "alice"}), 201)["api_key"]
    _ok(admin.post("/v1/models", json={"name": "tiny", "path": str(tiny_model_dir)}), 201)
    user = httpx.Client(base_url=server, headers=bearer(key), timeout=60)

    job = _ok(user.post("/v1/jobs", json=SPEC), 202)
    assert job["status"] == "queued"
    compiled = _wait_for(user, job["id"], {"ready", "failed"})
    assert compiled["status"] == "ready", compiled["error"]

    code = _ok(user.post("/v1/enrollment-codes", json={}), 201)["code"]
    enroll = {"code": code, "name": "phone", "backend": "executorch"}
    enrolled = _ok(httpx.post(f"{server}/v1/devices", json=enroll), 201)
    device = httpx.Client(base_url=server, headers=bearer(enrolled["token"]), timeout=60)
    lease = _ok(device.post("/v1/leases"))
    assert lease["job_id"] == job["id"] and lease["spec"]["answer_len"] >= 1

    b, log = _train_on_device(device, tiny_model_dir, lease, tmp_path)
    assert np.abs(b).max() > 0
    files = {
        "b_flat": ("b_flat.safetensors", _safetensors(b)),
        "log": ("log.jsonl", log.encode()),
        "metrics": ("metrics.json", json.dumps({"steps": SPEC["steps"]}).encode()),
    }
    result = _ok(device.post(f"/v1/work/job-{job['id']}/result", files=files), 201)
    assert result["version"] == 1
    assert _ok(user.get(f"/v1/jobs/{job['id']}"))["status"] == "succeeded"

    archive = user.get(f"/v1/adapters/{result['adapter_id']}/download").raise_for_status().content
    ids = torch.tensor([[1, 17, 42, 99, 7, 256, 3, 11]])
    base_logits, peft_logits = _peft_logits(tiny_model_dir, archive, tmp_path, ids)
    expected = _logits_with_b(tiny_model_dir, {**lease["spec"]}, b, ids)
    # PEFT's LoRA and the MP-LoRA layers round differently: within the forward bound, relative to the logits' size
    atol = loss_rtol(AutoConfig.from_pretrained(tiny_model_dir)) * float(expected.abs().max())
    assert (peft_logits - base_logits).abs().max() > 10 * atol  # the adapter changes the model ...
    torch.testing.assert_close(peft_logits, expected, rtol=0, atol=atol)  # ... exactly as the device's B says


def test_cached_program_and_cancel_stops_the_device(server, tiny_model_dir):
    """Runs after test_full_flow on the same server: same config → the program is ready in seconds."""
    import httpx

    admin = httpx.Client(base_url=server, headers=bearer(ADMIN_TOKEN), timeout=60)
    key = _ok(admin.post("/v1/users", json={"name": "bob"}), 201)["api_key"]
    user = httpx.Client(base_url=server, headers=bearer(key), timeout=60)
    started = time.monotonic()
    job = _ok(user.post("/v1/jobs", json=SPEC), 202)
    compiled = _wait_for(user, job["id"], {"ready", "failed"}, timeout=60)
    assert compiled["status"] == "ready", compiled["error"]
    assert time.monotonic() - started < 30
    code = _ok(user.post("/v1/enrollment-codes", json={}), 201)["code"]
    token = _ok(httpx.post(f"{server}/v1/devices", json={"code": code, "name": "phone"}), 201)["token"]
    device = httpx.Client(base_url=server, headers=bearer(token), timeout=60)
    assert _ok(device.post("/v1/leases"))["job_id"] == job["id"]
    _ok(user.post(f"/v1/jobs/{job['id']}/cancel"))
    beat = _ok(device.post(f"/v1/work/job-{job['id']}/heartbeat", json={"step": 1}))
    assert beat["cancelled"] is True


def _safetensors(b: np.ndarray) -> bytes:
    from safetensors.numpy import save

    return save({"b_flat": np.ascontiguousarray(b, dtype=np.float32)})
