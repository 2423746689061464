"""The REST client commands against a live server on loopback (uvicorn in a thread, fake compile queue)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from mobizo.cli import main
from server.app import create_app
from tests.server.factories import (
    ADMIN_TOKEN,
    FakeCompileQueue,
    InlinePool,
    b_flat_bytes,
    bearer,
    fake_training,
    make_fake_model,
)
from tests.server.live import app_in_thread


@pytest.fixture
def server_url(settings, tmp_path) -> Iterator[str]:
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    with app_in_thread(app) as url:
        app.state.verify_pool.close()
        app.state.verify_pool = InlinePool()
        httpx.post(
            f"{url}/v1/models",
            json={"name": "tiny", "path": str(make_fake_model(tmp_path / "m"))},
            headers=bearer(ADMIN_TOKEN),
        ).raise_for_status()
        yield url


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _device(url: str, user_key: str) -> dict[str, str]:
    code = httpx.post(f"{url}/v1/enrollment-codes", json={}, headers=bearer(user_key)).json()["code"]
    token = httpx.post(f"{url}/v1/devices", json={"code": code, "name": "phone"}).json()["token"]
    return bearer(token)


def test_user_job_and_adapter_commands(server_url, capsys, tmp_path):
    code, out, _ = _run(capsys, "users", "create", "alice", "--server", server_url, "--token", ADMIN_TOKEN)
    assert code == 0
    key = json.loads(out)["api_key"]
    conn = ["--server", server_url, "--token", key]

    code, out, _ = _run(capsys, "enroll-code", "--json", *conn)
    assert code == 0 and len(json.loads(out)["code"]) == 14

    code, out, _ = _run(
        capsys,
        "jobs",
        "submit",
        "--model",
        "tiny",
        "--task",
        "sst2",
        "--q",
        "2",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--rank",
        "2",
        "--targets",
        "q_proj,v_proj",
        *conn,
    )
    job = json.loads(out)
    assert code == 0 and job["status"] == "queued" and job["spec"]["targets"] == ["q_proj", "v_proj"]

    code, out, _ = _run(capsys, "jobs", "list", *conn)
    assert code == 0 and "ready" in out.splitlines()[1]

    device = _device(server_url, key)
    lease = httpx.post(f"{server_url}/v1/leases", headers=device).json()
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    files = {"b_flat": ("b", b_flat_bytes(b)), "log": ("l", log.encode()), "metrics": ("m", b"{}")}
    httpx.post(f"{server_url}/v1/work/job-{job['id']}/result", files=files, headers=device).raise_for_status()

    code, out, _ = _run(capsys, "adapters", "list", "--json", *conn)
    assert code == 0 and json.loads(out)["data"][0]["version"] == 1
    code, out, _ = _run(capsys, "adapters", "download", "1", "--out", str(tmp_path / "adapter"), *conn)
    assert code == 0
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "mobizo_base.json",
        "mobizo_card.json",
    ]

    code, out, _ = _run(capsys, "jobs", "show", str(job["id"]), *conn)
    assert json.loads(out)["status"] == "succeeded"
    code, _, err = _run(capsys, "jobs", "cancel", str(job["id"]), *conn)
    assert code == 1 and "HTTP 409" in err

    cpu = {"arch": "aarch64", "features": ["asimd", "dotprod"]}
    assert httpx.post(f"{server_url}/v1/leases", json={"cpu": cpu}, headers=device).status_code == 204
    code, out, _ = _run(capsys, "devices", "list", *conn)
    assert code == 0 and out.splitlines()[1].split()[:2] == ["1", "phone"] and out.splitlines()[1].endswith("-")
    assert "aarch64 asimd dotprod" in out.splitlines()[1]
    code, out, _ = _run(capsys, "devices", "revoke", "1", *conn)
    assert code == 0 and json.loads(out)["revoked_at"] is not None
    assert httpx.post(f"{server_url}/v1/leases", headers=device).status_code == 401
    code, _, err = _run(capsys, "devices", "revoke", "2", *conn)
    assert code == 1 and "device not found" in err


def test_errors_from_the_server_exit_1_with_the_reason(server_url, capsys):
    code, _, err = _run(capsys, "users", "create", "alice", "--server", server_url, "--token", "wrong")
    assert code == 1 and "HTTP 401" in err
    code, _, err = _run(capsys, "jobs", "show", "42", "--server", server_url, "--token", "wrong")
    assert code == 1 and "invalid token" in err


def test_bad_options_exit_2_naming_them(capsys):
    code, _, err = _run(
        capsys, "jobs", "submit", "--model", "m", "--task", "sst2", "--q", "3", "--batch-size", "4", "--token", "t"
    )
    assert code == 2 and "--batch-size" in err
    code, _, err = _run(
        capsys, "jobs", "submit", "--model", "m", "--template", "{x}", "--verbalizer", "{", "--token", "t"
    )
    assert code == 2 and "--verbalizer" in err
    for option in ("--device", "--init-adapter"):  # fields device_id, init_adapter_id: the table names their flags
        code, _, err = _run(capsys, "jobs", "submit", "--model", "m", "--task", "sst2", option, "0", "--token", "t")
        assert code == 2 and f"argument {option}: " in err
    code, _, err = _run(capsys, "enroll-code", "--ttl", "5", "--token", "t")
    assert code == 2 and "--ttl" in err
    base = ("jobs", "submit", "--model", "m", "--task", "sst2", "--steps", "5", "--token", "t")
    for extra, option in ((("--warmup-steps", "5"), "--warmup-steps"), (("--lr-floor", "1.5"), "--lr-floor")):
        code, _, err = _run(capsys, *base, *extra)
        assert code == 2 and f"argument {option}: " in err, err


def test_submit_sends_the_lr_schedule_options():
    from mobizo.cli import build_parser
    from server.commands.jobs import job_body

    args = ["jobs", "submit", "--model", "m", "--task", "sst2", "--steps", "9", "--lr-schedule", "cosine"]
    body = job_body(build_parser().parse_args([*args, "--warmup-steps", "3", "--lr-floor", "0.25"]))
    assert (body["lr_schedule"], body["warmup_steps"], body["lr_floor"]) == ("cosine", 3, 0.25)
    assert "lr_schedule" not in job_body(build_parser().parse_args(args[:-2]))  # left out: the server's default


def test_models_register_and_list(server_url, capsys, tmp_path):
    model_dir = make_fake_model(tmp_path / "second")
    code, out, _ = _run(
        capsys, "models", "register", "second", "--path", str(model_dir), "--server", server_url, "--token", ADMIN_TOKEN
    )
    assert code == 0 and json.loads(out)["name"] == "second"
    code, out, _ = _run(capsys, "models", "list", "--json", "--server", server_url, "--token", ADMIN_TOKEN)
    assert code == 0 and {m["name"] for m in json.loads(out)["data"]} == {"tiny", "second"}
    code, _, err = _run(
        capsys,
        "models",
        "register",
        "third",
        "--path",
        str(tmp_path / "missing"),
        "--server",
        server_url,
        "--token",
        ADMIN_TOKEN,
    )
    assert code == 1 and "HTTP 4" in err


def test_models_register_refuses_a_relative_path_before_asking_the_server(capsys, tmp_path, monkeypatch):
    make_fake_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    unreachable = "http://127.0.0.1:9"  # nothing is sent: the path is refused first
    code, out, err = _run(capsys, "models", "register", "m", "--path", "model", "--server", unreachable, "--token", "t")
    assert code == 2 and out == ""
    error = err.strip().splitlines()[-1]  # argparse's usage, then one line naming the option
    assert error.startswith("mobizo models register: error: argument --path:") and "absolute" in error, err


def test_token_file_keeps_the_token_out_of_the_process_list(server_url, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("MOBIZO_ADMIN_TOKEN", raising=False)
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    code, out, _ = _run(capsys, "users", "create", "carol", "--server", server_url, "--token-file", str(token_file))
    assert code == 0 and json.loads(out)["name"] == "carol"
    code, _, err = _run(capsys, "users", "create", "dave", "--server", server_url, "--token-file", str(tmp_path / "no"))
    assert code == 2 and "--token-file" in err


def test_cohort_commands_and_a_federated_job(server_url, capsys, monkeypatch):
    admin = ["--server", server_url, "--token", ADMIN_TOKEN]
    code, out, _ = _run(capsys, "users", "create", "carol", *admin)
    user = ["--server", server_url, "--token", json.loads(out)["api_key"]]
    code, out, _ = _run(capsys, "cohorts", "create", "kb", "--model", "tiny", "--task", "sst2", *admin)
    assert code == 0
    cohort = json.loads(out)["id"]
    code, out, _ = _run(capsys, "cohorts", "join", str(cohort), *user)
    assert code == 0 and json.loads(out)["member"] is True
    code, out, _ = _run(capsys, "cohorts", "list", *user)
    assert code == 0 and "kb" in out and "True" in out
    base = ["jobs", "submit", "--cohort", str(cohort), "--q", "2", "--batch-size", "4", "--rank", "2"]
    rounds = ["--rounds", "2", "--clients-per-round", "3", "--local-steps", "5", "--aggregation", "median"]
    code, _, err = _run(capsys, *base, *rounds, "--steps", "5", *admin)
    assert code == 2 and "--steps" in err
    code, _, err = _run(capsys, *base, "--clients-per-round", "3", "--local-steps", "5", *admin)
    assert code == 2 and "--rounds" in err
    code, _, err = _run(capsys, *base, *rounds, "--min-clients", "4", *admin)
    assert code == 2 and "--min-clients" in err
    code, _, err = _run(capsys, "jobs", "submit", "--model", "tiny", "--task", "sst2", "--rounds", "2", *user)
    assert code == 2 and "--rounds" in err
    monkeypatch.setenv("MOBIZO_ADMIN_TOKEN", ADMIN_TOKEN)  # --cohort takes the admin token by default
    code, _, err = _run(capsys, *base, *rounds, "--dp-epsilon", "8", "--server", server_url)
    assert code == 2 and "--dp-min-examples" in err
    private = ["--dp-epsilon", "8", "--dp-min-examples", "64", "--server-momentum", "0.9", "--optimizer", "momentum"]
    code, out, err = _run(capsys, *base, *rounds, *private, "--server", server_url)
    assert code == 0, err
    job = json.loads(out)
    assert job["cohort_id"] == cohort and job["federation"]["aggregation"] == "median" and job["spec"]["steps"] == 5
    assert job["federation"]["server_momentum"] == 0.9 and job["spec"]["optimizer"] == "momentum"
    assert job["spec"]["privacy"]["noise_multiplier"] > 0  # calibrated by the server over rounds x local steps
    code, out, _ = _run(capsys, "privacy", "show", "--cohort", str(cohort), "--json", *user)  # the cohort's ledger
    assert code == 0 and [e["job_id"] for e in json.loads(out)["jobs"]] == [job["id"]]
    code, _, err = _run(capsys, "privacy", "budget", "--cohort", str(cohort), "--epsilon", "1", *admin)
    assert code == 1 and "spent" in err  # below what the cohort's job spends
    code, out, _ = _run(capsys, "privacy", "budget", "--cohort", str(cohort), "--epsilon", "9", *admin)
    assert code == 0 and "budget: epsilon 9 at delta 1e-05" in out
    code, out, _ = _run(capsys, "jobs", "show", str(job["id"]), *admin)
    assert code == 0 and json.loads(out)["federation_progress"]["rounds"] == 2
    code, _, _ = _run(capsys, "jobs", "show", str(job["id"]), *user)
    assert code == 1  # not the user's job: 404
    code, out, _ = _run(capsys, "cohorts", "leave", str(cohort), *user)
    assert code == 0 and json.loads(out)["member"] is False


@pytest.mark.parametrize(
    ("argv", "env", "named", "exit_code"),
    [
        (["worker"], {}, "MOBIZO_BROKER_URL is not set", 1),
        (["worker", "--queues", "compile,export"], {"MOBIZO_BROKER_URL": "redis://127.0.0.1:1/0"}, "queues", 2),
        (["worker", "--concurrency", "0"], {"MOBIZO_BROKER_URL": "redis://127.0.0.1:1/0"}, "concurrency", 2),
        (["server", "--workers", "2"], {}, "MOBIZO_QUEUE=celery", 2),
        (["server", "--workers", "0"], {"MOBIZO_QUEUE": "celery"}, "workers", 2),
    ],
)
def test_worker_and_server_refuse_bad_settings_naming_them(capsys, monkeypatch, tmp_path, argv, env, named, exit_code):
    from server.settings import get_settings

    monkeypatch.setenv("MOBIZO_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("MOBIZO_BROKER_URL", raising=False)
    monkeypatch.delenv("MOBIZO_QUEUE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        code, _, err = _run(capsys, *argv)
    finally:
        get_settings.cache_clear()
    assert code == exit_code and named in err
