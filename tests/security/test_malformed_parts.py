"""Issue 9 defect 6: malformed upload parts answered 500 (RecursionError, AttributeError, TypeError in the checks).
Now the B-file and log parsers refuse every malformed input with a reason, which the upload answers as 422 naming
the part; nothing is stored and the job keeps its lease."""

from __future__ import annotations

import json
import struct

import pytest

from tests.server.factories import b_flat_bytes, fake_training, upload


def _safetensors(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


MALFORMED_B = {
    "nested 6000 deep": _safetensors(b"[" * 6000 + b"]" * 6000),
    "nested object 3000 deep": _safetensors(b'{"a":' * 3000 + b"1" + b"}" * 3000),
    "entry not an object": _safetensors(b'{"b_flat": 5}'),
    "shape not a list": _safetensors(b'{"b_flat": {"dtype": "F32", "shape": 5, "data_offsets": [0, 4]}}'),
    "metadata not strings": _safetensors(b'{"__metadata__": [1], "b_flat": {}}'),
}


def _log_lines(world) -> list[dict]:
    _, log = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    return [json.loads(line) for line in log.splitlines()]


def _nothing_stored(world) -> None:
    job = world["client"].get(f"/v1/jobs/{world['job']['id']}", headers=world["user"]).json()
    assert job["status"] == "running" and job["adapter_id"] is None
    root = world["app"].state.store.root
    for sub in ("adapters", "logs", "archives", "tmp"):
        assert list((root / sub).iterdir()) == [], sub


@pytest.mark.parametrize("case", sorted(MALFORMED_B))
def test_malformed_b_answers_422(world, case):
    _, log = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    response = upload(world["client"], world["phone"], world["job"]["id"], MALFORMED_B[case], log)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "b_flat"]
    _nothing_stored(world)


MALFORMED_LINES = {
    "step a string": lambda r: {**r, "step": str(r["step"])},
    "step a bool": lambda r: {**r, "step": True},
    "step beyond 64 bits": lambda r: {**r, "step": 2**64},
    "seed a string": lambda r: {**r, "seed": "x"},
    "eps a string": lambda r: {**r, "eps": "x"},
    "eps an object": lambda r: {**r, "eps": {}},
    "lr null": lambda r: {**r, "lr": None},
    "losses a number": lambda r: {**r, "losses": 5},
    "losses strings": lambda r: {**r, "losses": ["a", "b"]},
    "g an object": lambda r: {**r, "g": {"0": 1.0}},
    "g strings": lambda r: {**r, "g": ["1.0", "2.0"]},
}


@pytest.mark.parametrize("case", sorted(MALFORMED_LINES))
def test_malformed_log_line_answers_422(world, case):
    b, _ = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    records = _log_lines(world)
    records[1] = MALFORMED_LINES[case](records[1])
    log = "".join(json.dumps(r) + "\n" for r in records)
    response = upload(world["client"], world["phone"], world["job"]["id"], b_flat_bytes(b), log)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "log"] and ":2:" in response.text
    _nothing_stored(world)


def test_log_line_nested_3000_deep_answers_422(world):
    b, log = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    deep = '{"step": ' + "[" * 3000 + "]" * 3000 + "}\n"
    # in place of the first line: a log with more lines than steps is refused before any line is parsed
    log = deep + "".join(log.splitlines(True)[1:])
    response = upload(world["client"], world["phone"], world["job"]["id"], b_flat_bytes(b), log)
    assert response.status_code == 422 and "nested too deep" in response.text
    _nothing_stored(world)


def test_heartbeat_step_beyond_64_bits_answers_422(world):
    url = f"/v1/work/job-{world['job']['id']}/heartbeat"
    for step in (2**63, 2**64, -1):
        response = world["client"].post(url, json={"step": step}, headers=world["phone"]["headers"])
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "step"]
    for loss in ("Infinity", "NaN", "1e999"):
        body = f'{{"step": 1, "loss": {loss}}}'
        response = world["client"].post(
            url, content=body, headers={**world["phone"]["headers"], "Content-Type": "application/json"}
        )
        assert response.status_code == 422, loss
    ok = world["client"].post(url, json={"step": 1, "loss": 0.5}, headers=world["phone"]["headers"])
    assert ok.status_code == 200
