"""Issue 9 defect 12: OpenAPI listed half the statuses (schemathesis counted 1,407 undocumented 401/403/404/409/
413/429 answers) and ``OPTIONS /v1/jobs`` named only POST. Now every operation documents its errors with the
error model, and a 405 names every method of the path."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def operations(live):
    with live.client() as client:
        schema = client.get("/openapi.json").json()
    return [(method, path, op) for path, item in schema["paths"].items() for method, op in item.items()]


def test_every_operation_documents_the_errors_it_can_give(operations):
    for method, path, op in operations:
        codes = set(op["responses"])
        if op.get("security"):
            assert "401" in codes, (method, path)
        if "{" in path:
            assert {"404", "422"} <= codes, (method, path)
        if method == "post":
            assert "413" in codes, (method, path)
        if "requestBody" in op:
            assert "422" in codes, (method, path)
        for code, response in op["responses"].items():
            if code.startswith("4"):
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorPublic"}, (method, path, code)


def test_result_upload_documents_429_and_its_multipart_body(operations):
    (op,) = [op for method, path, op in operations if path == "/v1/work/{work}/result"]
    assert {"200", "201", "401", "403", "404", "409", "413", "422", "429"} <= set(op["responses"])
    body = op["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert body["required"] == ["log", "metrics"]  # b_flat only where the item's spec.upload is b
    assert set(body["properties"]) == {"b_flat", "log", "metrics"}


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("OPTIONS", "/v1/jobs", "GET, HEAD, POST"),
        ("DELETE", "/v1/jobs", "GET, HEAD, POST"),
        ("DELETE", "/v1/jobs/1", "GET, HEAD"),
        ("GET", "/v1/work/job-1/result", "POST"),
        ("PUT", "/healthz", "GET, HEAD"),
    ],
)
def test_405_names_every_method_of_the_path(live, method, path, allow):
    with live.client() as client:
        response = client.request(method, path)
    assert response.status_code == 405 and response.headers["Allow"] == allow


def test_work_names_and_merge_dtypes_are_bounded_in_the_schema(operations):
    """A work item's id is stated up to 2**31 - 1 (the ids' range), not ten digits; the merged download's dtype as
    its enumeration: a client reading the schema sends nothing the server must refuse for its form."""
    import re

    from shared.backends import MERGE_DTYPES
    from shared.schemas import MAX_DB_INT, decimal_up_to

    works = [op for method, path, op in operations if path.startswith("/v1/work/{work}/")]
    patterns = {p["schema"]["pattern"] for op in works for p in op["parameters"] if p["name"] == "work"}
    (pattern,) = patterns
    for kind in ("job", "part"):
        for number in (1, 9, 10, 99, 2**31 - 2, MAX_DB_INT):
            assert re.match(pattern, f"{kind}-{number}"), (kind, number)
        for number in ("0", "01", str(MAX_DB_INT + 1), str(2**32), "9999999999", "10000000000"):
            assert not re.match(pattern, f"{kind}-{number}"), (kind, number)
    checked = re.compile(f"^{decimal_up_to(MAX_DB_INT)}$")
    for number in [*range(0, 2000), *range(MAX_DB_INT - 2000, MAX_DB_INT + 2000, 7), 10**9, 2 * 10**9, 3 * 10**9]:
        assert bool(checked.match(str(number))) == (1 <= number <= MAX_DB_INT), number

    (merged,) = [op for method, path, op in operations if path == "/v1/adapters/{adapter_id}/merged"]
    (dtype,) = [p for p in merged["parameters"] if p["name"] == "dtype"]
    assert dtype["schema"]["enum"] == list(MERGE_DTYPES)
