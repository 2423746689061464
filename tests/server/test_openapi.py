"""OpenAPI lists every endpoint of the REST contract with its auth and shapes."""

from __future__ import annotations

import pytest

CONTRACT = [
    ("post", "/v1/users"),
    ("post", "/v1/models"),
    ("get", "/v1/models"),
    ("post", "/v1/enrollment-codes"),
    ("post", "/v1/devices"),
    ("get", "/v1/devices"),
    ("post", "/v1/jobs"),
    ("get", "/v1/jobs"),
    ("get", "/v1/jobs/{job_id}"),
    ("post", "/v1/jobs/{job_id}/cancel"),
    ("post", "/v1/leases"),
    ("get", "/v1/blobs/{sha256}"),
    ("post", "/v1/work/{work}/heartbeat"),
    ("post", "/v1/work/{work}/fail"),
    ("post", "/v1/work/{work}/result"),
    ("get", "/v1/adapters"),
    ("get", "/v1/adapters/{adapter_id}"),
    ("get", "/v1/adapters/{adapter_id}/download"),
    ("get", "/healthz"),
]


@pytest.fixture(scope="module")
def schema():
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    # No lifespan: the schema is built from the routes alone.
    return TestClient(create_app(Settings(database_url="sqlite://"))).get("/openapi.json").json()


@pytest.mark.parametrize(("method", "path"), CONTRACT)
def test_endpoint_is_documented(schema, method, path):
    assert method in schema["paths"][path]


def test_bearer_auth_and_shapes_are_documented(schema):
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    submit = schema["paths"]["/v1/jobs"]["post"]
    assert "202" in submit["responses"] and submit["security"]
    assert {"JobCreate", "JobPublic", "LeasePublic", "AdapterPublic", "HeartbeatPublic"} <= set(
        schema["components"]["schemas"]
    )
    result = schema["paths"]["/v1/work/{work}/result"]["post"]
    assert "multipart/form-data" in result["requestBody"]["content"]
    assert {"200", "201", "409", "413", "422"} <= set(result["responses"])
    assert "204" in schema["paths"]["/v1/leases"]["post"]["responses"]
