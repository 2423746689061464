"""Model registration reads a server-side directory without torch; any token may list the models."""

from __future__ import annotations

from tests.server.factories import ADMIN, create_user, make_fake_model, register_model


def test_register_and_list(client, tmp_path):
    model = register_model(client, make_fake_model(tmp_path / "m"))
    assert model["architecture"] == "LlamaForCausalLM"
    assert model["modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]  # embeddings and norms are not targets
    assert len(model["sha256"]) == 64
    listing = client.get("/v1/models", headers=create_user(client)).json()
    assert listing["count"] == 1 and listing["data"][0]["name"] == "tiny"


def test_same_files_same_hash_and_names_are_unique(client, tmp_path):
    a = register_model(client, make_fake_model(tmp_path / "a"), "a")
    b = register_model(client, make_fake_model(tmp_path / "b"), "b")
    assert a["sha256"] == b["sha256"]
    r = client.post("/v1/models", json={"name": "a", "path": str(tmp_path / "a")}, headers=ADMIN)
    assert r.status_code == 409


def test_bad_directories_answer_422_naming_path(client, tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        r = client.post("/v1/models", json={"name": "x", "path": str(path)}, headers=ADMIN)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "path"]
    assert client.get("/v1/models", headers=ADMIN).json()["count"] == 0


def test_only_admin_registers(client, tmp_path):
    user = create_user(client)
    r = client.post("/v1/models", json={"name": "x", "path": str(make_fake_model(tmp_path / "m"))}, headers=user)
    assert r.status_code == 403
    assert client.get("/v1/models").status_code == 401


def test_a_relative_path_is_refused_naming_path(client, tmp_path, monkeypatch):
    """A relative path would be read from the server process's working directory: refused even where it names a
    model there."""
    make_fake_model(tmp_path / "here")
    monkeypatch.chdir(tmp_path)
    for path in ("here", "./here", "../" + tmp_path.name + "/here"):
        r = client.post("/v1/models", json={"name": "x", "path": path}, headers=ADMIN)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "path"], r.text
        assert "absolute" in r.json()["detail"][0]["msg"]
    assert client.get("/v1/models", headers=ADMIN).json()["count"] == 0
