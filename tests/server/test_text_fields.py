"""Text in requests, on SQLite and PostgreSQL alike (PostgreSQL stores no NUL byte in a text column: a NUL once
answered 500 there, and a device's failure report carrying one was never recorded). The rule, one for every text
field of the request schemas (``shared.text_fields.Line``, ``Text``, ``Report``): control characters are refused with a
422 naming the field, except that a text may hold tabs and newlines, and a device's failure report is always
recorded, its other control characters written out as escapes."""

from __future__ import annotations

import json

import pytest

from tests.server.factories import ADMIN, create_user, enroll_device, make_fake_model, register_model, submit_job

CONTROLS = ["a\x00b", "a\x1b[31mb", "a\x7fb", "a\x85b", "a\nb"]  # NUL, ESC, DEL, NEL (C1) and a newline


@pytest.fixture
def user(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    return create_user(client)


def _field(response, why: str = "control character") -> list:
    assert response.status_code == 422, (response.status_code, response.text)
    (error,) = response.json()["detail"]
    assert why in error["msg"], error
    assert "\x00" not in response.text and "\\u0000" not in response.text  # nothing of the input comes back
    return error["loc"]


@pytest.mark.parametrize("text", CONTROLS)
def test_control_characters_in_a_text_field_are_refused_naming_it(client, user, text):
    code = lambda: client.post("/v1/enrollment-codes", json={}, headers=user).json()["code"]  # noqa: E731
    for field in ("name", "platform"):
        body = {"code": code(), "name": "phone", "platform": "test", field: text}
        assert _field(client.post("/v1/devices", json=body)) == ["body", field]
    job = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 2}
    assert _field(client.post("/v1/jobs", json={**job, "model": text}, headers=user)) == ["body", "model"]
    labels = {"0": " bad", "1": " good"}
    custom = {**job, "task": "custom", "template": "{text} It was", "verbalizer": labels}
    assert _field(client.post("/v1/jobs", json={**custom, "verbalizer": {"0": " bad", text: " x"}}, headers=user))[:2]
    answer = client.post("/v1/jobs", json={**custom, "targets": ["q_proj", text]}, headers=user)
    assert _field(answer)[:2] == ["body", "targets"]
    assert _field(client.get("/v1/adapters", params={"model": text}, headers=user)) == ["query", "model"]
    assert _field(client.get("/v1/adapters", params={"task": text}, headers=user)) == ["query", "task"]
    cohort = {"name": "c", "model": text, "task": "sst2"}
    assert _field(client.post("/v1/cohorts", json=cohort, headers=ADMIN)) == ["body", "model"]
    model = {"name": "other", "path": f"/srv/{text}"}
    assert _field(client.post("/v1/models", json=model, headers=ADMIN)) == ["body", "path"]
    phone = enroll_device(client, user)
    inference = {"model": text}
    assert _field(client.post("/v1/device/inference", json=inference, headers=phone["headers"])) == ["body", "model"]


def test_a_template_and_answers_may_hold_tabs_and_newlines_but_no_other_control_character(client, user):
    job = {"model": "tiny", "task": "custom", "q": 2, "batch_size": 4, "steps": 3, "rank": 2}
    labels = {"0": "\tbad", "1": "\ngood"}
    ok = client.post(
        "/v1/jobs", json={**job, "template": "Review:\n\t{text}\r\nIt was", "verbalizer": labels}, headers=user
    )
    assert ok.status_code == 202, ok.text
    assert ok.json()["spec"]["template"] == "Review:\n\t{text}\r\nIt was"
    for template in ("{text}\x00", "{text}\x1b[2J", "{text}\x0b"):
        refused = client.post("/v1/jobs", json={**job, "template": template, "verbalizer": labels}, headers=user)
        assert _field(refused) == ["body", "template"]
    refused = client.post("/v1/jobs", json={**job, "template": "{text}", "verbalizer": {"0": "a\x00"}}, headers=user)
    assert _field(refused)[:2] == ["body", "verbalizer"]


def test_a_lone_surrogate_is_refused_not_a_server_error(client, user):
    code = client.post("/v1/enrollment-codes", json={}, headers=user).json()["code"]
    body = '{"code": "' + code + '", "name": "a\\ud800b"}'  # valid JSON text, no encodable string
    answer = client.post("/v1/devices", content=body, headers={"Content-Type": "application/json"})
    assert _field(answer, "valid string") == ["body", "name"]


def test_a_failure_report_with_control_characters_is_always_recorded(client, user):
    phone = enroll_device(client, user)
    job = submit_job(client, user)
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 200
    report = "oom \x00 at step 3\x1b[0m\r\nnext line\tcolumn \ud800"
    raw = json.dumps({"error": report})  # the lone surrogate as the JSON escape a runner's output might carry
    sent = client.post(
        f"/v1/work/job-{job['id']}/fail", content=raw, headers={**phone["headers"], "Content-Type": "application/json"}
    )
    assert sent.status_code == 204, sent.text
    shown = client.get(f"/v1/jobs/{job['id']}", headers=user).json()
    assert shown["status"] == "failed"
    expected = "oom \\x00 at step 3\\x1b[0m\\r\nnext line\tcolumn \\ud800"
    assert shown["error"] == f"device {phone['id']}: {expected}"


def test_a_long_failure_report_is_cut_to_its_limit_after_escaping(client, user):
    phone = enroll_device(client, user)
    job = submit_job(client, user)
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 200
    sent = client.post(f"/v1/work/job-{job['id']}/fail", json={"error": "\x00" * 4000}, headers=phone["headers"])
    assert sent.status_code == 204, sent.text
    error = client.get(f"/v1/jobs/{job['id']}", headers=user).json()["error"]
    assert error == f"device {phone['id']}: " + "\\x00" * 1000


def test_every_text_field_of_a_request_states_the_rule_in_openapi(client):
    """Every string a request body, path or query may carry has a pattern (the rule, or a stricter name pattern), an
    enumeration, is a file or a time, or is a report whose control characters are escaped: no free text escapes the
    rule."""
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    free: list[str] = []

    def walk(schema: dict, where: str, seen: set[str]) -> None:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[1]
            if name not in seen:
                walk(schemas[name], name, seen | {name})
            return
        for key in ("anyOf", "oneOf", "allOf"):
            for index, option in enumerate(schema.get(key, [])):
                walk(option, f"{where}[{index}]", seen)
        if schema.get("type") == "string" and not (
            {"pattern", "enum", "const", "x-control-characters"} & schema.keys()
        ):
            if schema.get("format") not in ("binary", "date-time"):
                free.append(where)
        for name, prop in schema.get("properties", {}).items():
            walk(prop, f"{where}.{name}", seen)
        for key in ("items", "additionalProperties", "propertyNames"):
            if isinstance(schema.get(key), dict):
                walk(schema[key], f"{where}.{key}", seen)

    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):
                if parameter["in"] in ("query", "path"):
                    walk(parameter["schema"], f"{method} {path} {parameter['name']}", set())
            for media in operation.get("requestBody", {}).get("content", {}).values():
                walk(media["schema"], f"{method} {path} body", set())
    assert free == []
