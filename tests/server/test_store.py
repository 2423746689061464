"""The artifact store's contract, passed by both ways of sharing it between machines:

- ``volume``: one data dir that every process mounts (two ``ArtifactStore`` on the same root);
- ``s3``: a data dir per machine behind one S3 bucket (two stores with different roots and the same
  ``MOBIZO_STORE_URL``), against a real S3-protocol server on loopback (moto's standalone server process).

What one machine publishes (``keep``, ``publish_program``) the other reads through the accessors, whole and
byte for byte, under the same content address; a name nobody published is absent on both.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from server.object_store import S3Objects, parse_store_url
from server.store import ArtifactStore
from shared.errors import FieldError
from tests.utils.s3 import new_bucket, s3_env


@pytest.fixture(params=["volume", "s3"])
def two_machines(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ArtifactStore, ArtifactStore]:
    if request.param == "volume":
        return ArtifactStore(tmp_path / "shared"), ArtifactStore(tmp_path / "shared")
    endpoint = request.getfixturevalue("s3_endpoint")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for name, value in s3_env(endpoint).items():
        monkeypatch.setenv(name, value)
    url = new_bucket(endpoint)
    return ArtifactStore(tmp_path / "a", S3Objects(url)), ArtifactStore(tmp_path / "b", S3Objects(url))


def _tmp_file(store: ArtifactStore, data: bytes) -> Path:
    path = store.tmp_dir() / "upload"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("kind", "suffix", "accessor"),
    [
        ("adapters", ".safetensors", "adapter_b"),
        ("logs", ".jsonl", "log"),
        ("archives", ".zip", "archive"),
        ("rounds", ".json", "round_record"),
    ],
)
def test_what_one_machine_keeps_the_other_reads(two_machines, kind, suffix, accessor):
    writer, reader = two_machines
    data = os.urandom(100_000) + kind.encode()
    path, sha256 = writer.keep(_tmp_file(writer, data), kind, suffix)
    assert sha256 == hashlib.sha256(data).hexdigest() and path.read_bytes() == data
    fetched = getattr(reader, accessor)(sha256)
    assert fetched.read_bytes() == data
    assert stat.S_IMODE(fetched.stat().st_mode) == 0o600
    assert not [p for p in fetched.parent.iterdir() if p.name.startswith(".tmp-")]  # no partial download left


def test_keeping_the_same_bytes_twice_is_one_file(two_machines):
    writer, reader = two_machines
    first, sha = writer.keep(_tmp_file(writer, b"same bytes"), "logs", ".jsonl")
    again, sha_again = reader.keep(_tmp_file(reader, b"same bytes"), "logs", ".jsonl")
    assert (sha, first.read_bytes()) == (sha_again, again.read_bytes())
    assert [p.name for p in (writer.root / "logs").iterdir()] == [f"{sha}.jsonl"]
    assert not list((writer.root / "tmp").iterdir()) or all(p.is_dir() for p in (writer.root / "tmp").iterdir())


def test_a_name_nobody_published_is_absent_on_both(two_machines):
    writer, reader = two_machines
    missing = "0" * 64
    for store in (writer, reader):
        assert not store.adapter_b(missing).exists()
        assert not store.blob(f"weights-{missing}.ptd").exists()
        assert not store.program("no-such-key").exists()


def test_a_published_program_is_read_whole_on_the_other_machine(two_machines):
    writer, reader = two_machines
    weights, tokenizer = os.urandom(300_000), b'{"model": {}}'
    weights_name = f"weights-{hashlib.sha256(weights).hexdigest()}.ptd"
    tokenizer_name = f"tokenizer-{hashlib.sha256(tokenizer).hexdigest()}.json"
    (writer.blobs_dir / weights_name).write_bytes(weights)
    (writer.blobs_dir / tokenizer_name).write_bytes(tokenizer)
    folder = writer.programs_dir / "key-1"
    folder.mkdir()
    pte = os.urandom(50_000)
    manifest = {"ptd": {"file": weights_name}, "tokenizer": {"file": tokenizer_name}, "pte": {"file": "program.pte"}}
    (folder / "program.pte").write_bytes(pte)
    (folder / "program.json").write_text(json.dumps(manifest))
    writer.publish_program("key-1", manifest)
    assert json.loads(reader.program("key-1", "program.json").read_text()) == manifest
    assert reader.program("key-1").read_bytes() == pte
    assert reader.blob(weights_name).read_bytes() == weights
    assert reader.blob(tokenizer_name).read_bytes() == tokenizer


def test_a_compile_worker_finds_a_program_another_published(two_machines):
    """``fetch_program`` (what a compile worker calls before exporting): the folder and its blobs arrive, the
    manifest last; a key nobody published is not there."""
    writer, reader = two_machines
    manifest = {"ptd": {"file": "weights-w.ptd"}, "tokenizer": {"file": "tokenizer-t.json"}}
    manifest["pte"] = {"file": "program.pte"}
    (writer.blobs_dir / "weights-w.ptd").write_bytes(b"weights")
    (writer.blobs_dir / "tokenizer-t.json").write_bytes(b"{}")
    (writer.programs_dir / "key-2").mkdir()
    (writer.programs_dir / "key-2" / "program.pte").write_bytes(b"pte")
    (writer.programs_dir / "key-2" / "program.json").write_text(json.dumps(manifest))
    writer.publish_program("key-2", manifest)
    assert reader.fetch_program("key-2")
    assert (reader.programs_dir / "key-2" / "program.pte").read_bytes() == b"pte"
    assert (reader.blobs_dir / "weights-w.ptd").read_bytes() == b"weights"
    assert json.loads((reader.programs_dir / "key-2" / "program.json").read_text()) == manifest
    assert not reader.fetch_program("key-3") and not (reader.programs_dir / "key-3").exists()


def test_store_url_names_the_setting_when_bad():
    assert parse_store_url("s3://bucket") == ("bucket", "")
    assert parse_store_url("s3://bucket/a/b/") == ("bucket", "a/b/")
    for bad in ("bucket", "http://host/bucket", "s3://", "s3://bucket?x=1"):
        with pytest.raises(FieldError, match="^store_url: must be s3://"):
            parse_store_url(bad)


@pytest.mark.parametrize("answered_first", [False, True])
def test_a_verify_task_run_twice_leaves_nothing_in_the_bucket(s3_endpoint, monkeypatch, tmp_path, answered_first):
    """The broker may deliver a verify task twice (one still running past its visibility timeout). When the API
    process took the other delivery's answer and deleted the spool before this one uploads its outputs
    (``answered_first``), the outputs are deleted again; otherwise they stay for the API process to fetch."""
    from server import verify_spool

    for name, value in s3_env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    shared = S3Objects(new_bucket(s3_endpoint))
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "log.jsonl").write_bytes(b"{}\n")
    spool = verify_spool.new_spool()
    sent, _ = verify_spool.send_args(shared, spool, (str(tmp_path / "api" / "log.jsonl"), str(tmp_path), 3))
    (tmp_path / "worker").mkdir()
    local_args, out = verify_spool.receive_args(shared, sent, tmp_path / "worker")
    assert Path(local_args[0]).read_bytes() == b"{}\n" and local_args[2] == 3
    (out / "b.safetensors").write_bytes(b"B")
    if answered_first:
        shared.delete_prefix(spool)
    answer = verify_spool.send_result(shared, spool, sent, str(out / "b.safetensors"), out)
    assert shared.exists(answer["spooled_file"]) is not answered_first
    listed = shared._s3.list_objects_v2(Bucket=shared.bucket, Prefix=f"{shared.prefix}{spool}/")
    assert listed.get("KeyCount", 0) == (0 if answered_first else 2)
