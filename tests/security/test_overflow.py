"""Issue 25 point 3: an integer of 401+ digits in a log's ``lr``, ``g`` or ``losses`` answered 500 (OverflowError,
ValueError in the verify worker), and an admin's 4,095-character model path answered 500 (OSError ENAMETOOLONG).
Now a log number that float32 cannot hold is refused with 422 naming the part and the field, and an over-long path
with 422 naming ``path``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.security.test_malformed_parts import _log_lines, _nothing_stored
from tests.server.factories import ADMIN, b_flat_bytes, fake_training, make_fake_model

HUGE_INT = "1" + "0" * 401  # float() overflows
VERY_LONG_INT = "9" * 5000  # json.loads refuses to read it (Python's 4,300-digit limit)
BEYOND_FLOAT32 = "1e39"  # a finite float64, an infinite float32

# (field, the number in the JSON text, how the line places it)
CASES = [
    ("lr", HUGE_INT, lambda r, n: {**r, "lr": n}),
    ("eps", HUGE_INT, lambda r, n: {**r, "eps": n}),
    ("g", HUGE_INT, lambda r, n: {**r, "g": [n, *r["g"][1:]]}),
    ("losses", HUGE_INT, lambda r, n: {**r, "losses": [n, *r["losses"][1:]]}),
    ("losses", "-" + HUGE_INT, lambda r, n: {**r, "losses": [*r["losses"][:-1], n]}),
    ("lr", BEYOND_FLOAT32, lambda r, n: {**r, "lr": n}),
    ("g", BEYOND_FLOAT32, lambda r, n: {**r, "g": [n, *r["g"][1:]]}),
    ("losses", BEYOND_FLOAT32, lambda r, n: {**r, "losses": [n, *r["losses"][1:]]}),
    ("g", VERY_LONG_INT, lambda r, n: {**r, "g": [n, *r["g"][1:]]}),
]
MARK = "__NUMBER__"


def test_log_numbers_float32_cannot_hold_answer_422_naming_the_field(world):
    b, _ = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    url = f"/v1/work/job-{world['job']['id']}/result"
    for field, number, place in CASES:
        records = _log_lines(world)
        records[2] = place(records[2], MARK)
        log = "".join(json.dumps(r) + "\n" for r in records).replace(f'"{MARK}"', number)
        files = {"b_flat": ("b", b_flat_bytes(b)), "log": ("log", log.encode()), "metrics": ("m", b"{}")}
        response = world["client"].post(url, files=files, headers=world["phone"]["headers"])
        assert response.status_code == 422, (field, number[:8], response.status_code, response.text)
        (item,) = response.json()["detail"]
        assert item["loc"] == ["body", "log"] and "log:3:" in item["msg"], item
        assert field in item["msg"] or "not JSON" in item["msg"], item
        assert "0000000000" not in response.text and "9999999999" not in response.text  # never the value
    _nothing_stored(world)


def test_metrics_numbers_float32_cannot_hold_answer_422(world):
    b, log = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    url = f"/v1/work/job-{world['job']['id']}/result"
    for metrics in (f'{{"losses": [{HUGE_INT}]}}', f'{{"steps": {VERY_LONG_INT}}}', '{"seconds": NaN}'):
        files = {"b_flat": ("b", b_flat_bytes(b)), "log": ("log", log.encode()), "metrics": ("m", metrics.encode())}
        response = world["client"].post(url, files=files, headers=world["phone"]["headers"])
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "metrics"]
        assert "0000000000" not in response.text and "9999999999" not in response.text


def _spelled(model: Path, length: int) -> str:
    """``model`` spelled in ``length`` characters: ``/../m`` (which ``pathlib`` keeps, unlike ``/.``) repeated,
    then trailing slashes."""
    step = f"/../{model.name}"
    spelled = str(model) + step * ((length - len(str(model))) // len(step))
    return spelled + "/" * (length - len(spelled))


def test_an_over_long_model_path_answers_422_naming_path(world, tmp_path: Path):
    model = make_fake_model(tmp_path / "m")
    http = world["client"]
    spelled = _spelled(model, 4095)  # the same directory in 4,095 characters: config.json's path is over PATH_MAX
    assert len(spelled) == 4095 and Path(spelled).is_dir()
    for path in (spelled, str(model) + "\x00", "/" + "x" * 300 + "/" + "y" * 300):
        response = http.post("/v1/models", json={"name": "long", "path": path}, headers=ADMIN)
        assert response.status_code == 422, (len(path), response.text)
        assert response.json()["detail"][0]["loc"] == ["body", "path"]
        assert "xxxxxxxx" not in response.text and "/../" not in response.text
    shorter = _spelled(model, 1000)  # the limit leaves room for real paths
    response = http.post("/v1/models", json={"name": "long", "path": shorter}, headers=ADMIN)
    assert response.status_code == 201, response.text
