"""Submitting jobs: validation (every bad spec a 422 naming its field), scoping, compile states, cancel."""

from __future__ import annotations

import pytest

from tests.server.factories import create_user, enroll_device, make_fake_model, register_model, submit_job

GOOD = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 2}


@pytest.fixture
def user(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    return create_user(client)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": "nope"}, "model"),
        ({"task": "sst3"}, None),
        ({"task": None}, None),
        ({"task": None, "template": "{text} It was"}, None),
        ({"task": None, "template": "{0} It was", "verbalizer": {"0": " bad", "1": " good"}}, None),
        ({"task": "sst2", "verbalizer": {"0": " bad", "1": " good"}}, None),
        ({"q": 3}, None),
        ({"q": 0}, "q"),
        ({"lr": 0}, "lr"),
        ({"lr": 2}, "lr"),
        ({"eps": -1e-3}, "eps"),
        ({"steps": 0}, "steps"),
        ({"rank": 0}, "rank"),
        ({"seq_len": 4}, "seq_len"),
        ({"targets": ["gate_proj"]}, "targets"),
        ({"targets": []}, "targets"),
        ({"task": "lm"}, "answer_len"),
        ({"answer_len": 8, "seq_len": 8}, None),
        ({"device_id": 999}, "device_id"),
        ({"init_adapter_id": 5}, "init_adapter_id"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"probe_weights": "fancy"}, "probe_weights"),
    ],
)
def test_bad_specs_answer_4xx_naming_the_field_and_store_nothing(client, user, change, field):
    r = client.post("/v1/jobs", json={**GOOD, **change}, headers=user)
    assert r.status_code in (404, 422), r.text
    detail = r.json()["detail"]
    assert detail and detail[0]["msg"]
    if field is not None:
        assert field in detail[0]["loc"]
    assert client.get("/v1/jobs", headers=user).json()["count"] == 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sessions": 3}, "sessions"),
        ({"standing": True, "eval_examples": 0}, "eval_examples"),
        ({"standing": True, "privacy": {"epsilon": 3.0, "min_examples": 100}}, "standing"),
    ],
)
def test_a_standing_job_s_bad_spec_answers_422_naming_its_field(client, user, change, field):
    r = client.post("/v1/jobs", json={**GOOD, **change}, headers=user)
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith(f"Value error, {field}:"), r.text
    assert client.get("/v1/jobs", headers=user).json()["count"] == 0


@pytest.mark.parametrize("change", [{"parallel": "outer"}, {"privacy": {"epsilon": 3.0, "min_examples": 100}}])
def test_curvature_weights_where_they_do_not_apply_answer_422_naming_them(client, user, change):
    r = client.post("/v1/jobs", json={**GOOD, "probe_weights": "curvature", **change}, headers=user)
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("Value error, probe_weights:"), r.text
    assert client.get("/v1/jobs", headers=user).json()["count"] == 0
    r = client.post("/v1/jobs", json={**GOOD, "probe_weights": "curvature"}, headers=user)
    assert r.status_code == 202 and r.json()["spec"]["probe_weights"] == "curvature", r.text


def test_custom_task_compiles_and_gets_its_own_registry_key(client, user, queue):
    job = submit_job(client, user, task=None, template="{text} It was", verbalizer={"0": " bad", "1": " good"})
    assert job["status"] == "queued"  # the answer is given before compilation
    shown = client.get(f"/v1/jobs/{job['id']}", headers=user).json()
    assert shown["status"] == "ready" and shown["task"].startswith("custom-")


def test_a_builtin_task_reads_through_the_models_chosen_prompt_unless_told_not_to(client, tmp_path, queue):
    """The model folder's mobizo_prompts.json gives a job naming sst2 and no prompt its template and answers (stored
    in the spec a device renders with, and a registry key of their own); --prompt builtin keeps the task's own; an
    unreadable file is a 422 naming model."""
    from shared.prompts import PROMPTS_FILE, write_model_prompt

    folder = make_fake_model(tmp_path / "model")
    chosen = {"template": "Review: {sentence}\nSentiment:", "verbalizer": {"0": " bad", "1": " good"}}
    write_model_prompt(folder, "sst2", chosen | {"chat_template": False})
    register_model(client, folder)
    user = create_user(client)
    job = client.get(f"/v1/jobs/{submit_job(client, user)['id']}", headers=user).json()
    assert {k: job["spec"][k] for k in chosen} == chosen and job["task"].startswith("sst2-")
    own = client.get(f"/v1/jobs/{submit_job(client, user, prompt='builtin')['id']}", headers=user).json()
    assert own["spec"]["template"] is None and own["task"] == "sst2"
    given = {"template": "{sentence}!", "verbalizer": {"0": " no", "1": " yes"}}
    mine = client.get(f"/v1/jobs/{submit_job(client, user, **given)['id']}", headers=user).json()
    assert {k: mine["spec"][k] for k in given} == given  # a job's own prompt wins
    (folder / PROMPTS_FILE).write_text('{"sst2": {"template": "{text}", "verbalizer": {"0": "a", "1": "b"}}}')
    r = client.post("/v1/jobs", json=GOOD, headers=user)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "model", r.text
    assert "no field 'text'" in r.json()["detail"][0]["msg"]


def test_job_goes_queued_compiling_ready(client, user, queue):
    queue.hold = True
    job = submit_job(client, user)
    assert client.get(f"/v1/jobs/{job['id']}", headers=user).json()["status"] == "queued"
    queue.run_pending()
    shown = client.get(f"/v1/jobs/{job['id']}", headers=user).json()
    assert shown["status"] == "ready" and shown["error"] is None
    assert shown["spec"]["q"] == 2 and shown["attempts"] == 0


def test_compile_failure_is_recorded_with_its_error(client, user, queue):
    queue.fail_with = "compile failed: RuntimeError: out of memory"
    job = submit_job(client, user)
    shown = client.get(f"/v1/jobs/{job['id']}", headers=user).json()
    assert shown["status"] == "failed" and "out of memory" in shown["error"]


def test_cancel_before_compiling_skips_the_compile(client, user, queue):
    queue.hold = True
    job = submit_job(client, user)
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=user)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    queue.run_pending()
    assert client.get(f"/v1/jobs/{job['id']}", headers=user).json()["status"] == "cancelled"
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=user).status_code == 409


def test_other_users_jobs_are_404(client, user):
    job = submit_job(client, user)
    bob = create_user(client, "bob")
    assert client.get(f"/v1/jobs/{job['id']}", headers=bob).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=bob).status_code == 404
    assert client.get("/v1/jobs", headers=bob).json()["count"] == 0
    assert client.get(f"/v1/jobs/{job['id']}", headers=user).status_code == 200


def test_another_users_device_cannot_be_targeted(client, user):
    bob = create_user(client, "bob")
    bobs_phone = enroll_device(client, bob)
    r = client.post("/v1/jobs", json={**GOOD, "device_id": bobs_phone["id"]}, headers=user)
    assert r.status_code == 404 and r.json()["detail"][0]["loc"] == ["body", "device_id"]


def test_device_backend_must_match_the_named_device(client, user):
    phone = enroll_device(client, user, backend="executorch")
    r = client.post("/v1/jobs", json={**GOOD, "device_id": phone["id"], "device_backend": "torch"}, headers=user)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "device_backend"]


def test_list_is_newest_first_and_paginated(client, user):
    ids = [submit_job(client, user)["id"] for _ in range(3)]
    page = client.get("/v1/jobs", params={"limit": 2}, headers=user).json()
    assert page["count"] == 3 and [j["id"] for j in page["data"]] == ids[::-1][:2]


def test_a_list_parses_each_job_spec_once_per_process(client, user):
    """A job's spec never changes: a list shown again reuses what the first showing parsed (the app's ``job_specs``)."""
    job = submit_job(client, user)
    shown = client.get("/v1/jobs", headers=user).json()["data"][0]
    parsed = client.app.state.job_specs.get(job["id"])
    assert parsed is not None and parsed.model_dump(mode="json") == shown["spec"] == job["spec"]
    assert client.get("/v1/jobs", headers=user).json()["data"][0]["spec"] == job["spec"]
    assert client.app.state.job_specs.get(job["id"]) is parsed


def test_the_schedule_and_quantization_of_a_job_spec_are_part_of_its_program() -> None:
    """``parallel`` and ``quantize`` travel from the job spec into the program config, hence its key: two jobs
    differing only there share no program; a spec stored before the fields existed gets the defaults."""
    from server.compile import program_key
    from shared import defaults
    from shared.schemas import HyperParams
    from tests.server.factories import program_config

    base = HyperParams(q=2, batch_size=4).model_dump(mode="json")
    configs = {p: program_config(base | {"parallel": p}, answer_len=1) for p in ("both", "outer", "inner", "none")}
    assert [c["parallel"] for c in configs.values()] == ["both", "outer", "inner", "none"]
    assert len({program_key("m", c, 1) for c in configs.values()}) == 4
    assert program_config(base | {"quantize": "8da4w"}, 1)["quantize"] == "8da4w"
    old = {k: v for k, v in base.items() if k not in ("parallel", "quantize", "group_size")}
    assert program_config(old, 1) == program_config(base, 1)
    assert program_config(old, 1)["parallel"] == defaults.PARALLEL
    # probe weights: part of the program and its key; "none" leaves the config (and every earlier key) as it was
    curvature = program_config(base | {"probe_weights": "curvature"}, 1)
    assert curvature["probe_weights"] == "curvature" and "probe_weights" not in program_config(base, 1)
    assert program_key("m", curvature, 1) != program_key("m", program_config(base, 1), 1)
