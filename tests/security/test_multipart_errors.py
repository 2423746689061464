"""Issue 25 point 4: every malformed multipart body on ``POST /v1/jobs/{id}/result`` answered an undocumented 400
(``read_parts`` caught FastAPI's ``HTTPException``, Starlette raises its own base class). Now each is the documented
422 naming the request (or the part), nothing is stored and the job keeps its lease: a valid upload still succeeds.
"""

from __future__ import annotations

from tests.security.test_malformed_parts import _nothing_stored
from tests.server.factories import b_flat_bytes, fake_training, upload

BOUNDARY = "mobizo-parts"


def _part(name: str | None, data: bytes, filename: str | None = "f", extra: str = "") -> bytes:
    disposition = "form-data" + (f'; name="{name}"' if name is not None else "")
    disposition += f'; filename="{filename}"' if filename is not None else ""
    return (
        (
            f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n{extra}"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + b"\r\n"
    )


def _body(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def _valid(world) -> dict[str, bytes]:
    b, log = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    return {"b_flat": b_flat_bytes(b), "log": log.encode(), "metrics": b'{"steps": 3}'}


def _two(v: dict[str, bytes]) -> list[bytes]:
    return [_part("b_flat", v["b_flat"]), _part("log", v["log"])]


BODIES = {
    "a fourth part": lambda v: _body(*(_part(n, d) for n, d in v.items()), _part("extra", b"x")),
    "a duplicate part": lambda v: _body(*(_part(n, d) for n, d in v.items()), _part("log", v["log"])),
    "a duplicate part within three": lambda v: _body(_part("b_flat", v["b_flat"]), *[_part("log", v["log"])] * 2),
    "an unknown part within three": lambda v: _body(*_two(v), _part("x", b"")),
    "a text part": lambda v: _body(*_two(v), _part("metrics", b"{}", None)),
    "1,000 parts": lambda v: _body(*(_part(f"p{i}", b"x") for i in range(1000))),
    "1,000 text parts": lambda v: _body(*(_part(f"p{i}", b"x", None) for i in range(1000))),
    "a part without a name": lambda v: _body(_part(None, v["b_flat"]), _part("log", v["log"])),
    "huge part headers": lambda v: _body(
        _part("b_flat", v["b_flat"], extra=f"X-Pad: {'a' * 400_000}\r\n"), _part("log", v["log"])
    ),
    "no closing boundary": lambda v: b"".join(_part(n, d) for n, d in v.items()),
    "not multipart at all": lambda v: b'{"log": "x"}',
}


def test_malformed_multipart_answers_422_and_the_job_keeps_its_lease(world):
    """Each variant in turn against the same leased job (one server for all: the cases cost milliseconds)."""
    parts = _valid(world)
    url = f"/v1/work/job-{world['job']['id']}/result"
    answers = {}
    for case, body in BODIES.items():
        multipart = f"multipart/form-data; boundary={BOUNDARY}"
        content_type = "application/json" if case == "not multipart at all" else multipart
        response = world["client"].post(
            url, content=body(parts), headers={**world["phone"]["headers"], "Content-Type": content_type}
        )
        answers[case] = response.status_code, response.json()["detail"]
    wrong = {case: answer for case, answer in answers.items() if answer[0] != 422}
    assert not wrong, wrong
    for case, (_, detail) in answers.items():
        (item,) = detail
        assert item["loc"][0] == "body" and item["loc"][1] in ("request", "b_flat", "log", "metrics"), (case, item)
        assert "aaaa" not in item["msg"] and "p999" not in item["msg"]  # the rule, not the input
    _nothing_stored(world)
    response = upload(world["client"], world["phone"], world["job"]["id"], parts["b_flat"], parts["log"].decode())
    assert response.status_code == 201, response.text


def test_a_multipart_without_boundary_answers_422(world):
    headers = {**world["phone"]["headers"], "Content-Type": "multipart/form-data"}
    response = world["client"].post(f"/v1/work/job-{world['job']['id']}/result", content=b"--x\r\n", headers=headers)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "request"]
