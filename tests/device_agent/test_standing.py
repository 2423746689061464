"""A standing personal job end to end (docs/guide/jobs.md, "Standing jobs"): a real server process and real ``mobizo
agent`` processes on loopback. The user's text grows day by day (the device's data file gets the next speeches of
the shipped Shakespeare sample's first user before each night); each night the agent leases the next session, which
starts from the job's promoted adapter and trains on the data the device holds then. What is checked, against the
server's own records:

- three sessions run, each a job of its own naming the standing job, each publishing a version whose server replay
  is the uploaded B bit for bit (``replay_max_abs_diff == 0``);
- promotion follows the held-out rule: a version is promoted iff its held-out loss after is below its before (the
  promoted version on the same slice); the second night runs at lr 1e-30 (each step moves B by far less than
  float32 resolves in the model's activations, so its after equals its before exactly) and is kept, not promoted,
  and the third night starts again from the promoted version;
- the standing job waits (``ready``) between sessions, its adapter is the promoted version (what the app
  downloads), and it succeeds after its ``sessions``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from device_agent import api
from device_agent.config import load_config
from tests.device_agent.stack import Stack, make_agent, ok

pytestmark = pytest.mark.slow

STEPS = 8


def _night(stack: Stack, agent, standing_id: int) -> dict:
    """One night: the agent leases the next session and runs it to its end (``--once``) → that session's job."""
    assert agent.start().wait() == 0, agent.tail()
    sessions = [j for j in ok(stack.user.get("/v1/jobs"))["data"] if j["standing_job_id"] == standing_id]
    return sessions[0]  # newest first


def _lease(agent, eligible: bool | None = None):
    with api.client(*_credentials(agent)) as http:
        return api.DeviceAPI(http).lease("executorch", None, eligible)


def _credentials(agent) -> tuple[str, str]:
    cfg = load_config(agent.config)
    return cfg.server_url, cfg.token


def _set_lr(artifacts: Path, job_id: int, lr: float) -> None:
    """Change the standing job's lr for its next sessions in the server's database (no route changes a job's
    hyperparameters): the test's way to force a session that cannot improve (lr must be positive)."""
    with sqlite3.connect(artifacts.parent / "db.sqlite") as db:
        db.execute("UPDATE jobs SET spec = json_set(spec, '$.lr', ?) WHERE id = ?", (lr, job_id))


def test_a_standing_job_learns_night_after_night_and_promotes_only_what_improves(
    stack: Stack, program_factory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from benchmarks.personal_data import jsonl, split
    from device_agent.local_data import split_held_out
    from shared.tasks import get_task
    from tests.utils.program_cache import seed_server_program
    from tests.utils.programs import TINY_TEXT_JOB

    spec = {k: v for k, v in TINY_TEXT_JOB.items() if k != "privacy"}  # not private: a standing job cannot be
    seed_server_program(stack.artifacts, tiny_model_dir, spec, program_factory)
    user = split()[0]
    records = user.records
    days = [records[: len(records) * k // 3] for k in (1, 2, 3)]
    data = tmp_path / "device"
    standing_id = stack.submit(steps=STEPS, **spec, eval_examples=8, standing=True, sessions=3)
    assert stack.job(standing_id)["status"] == "ready" and stack.job(standing_id)["sessions_run"] == 0
    agent = make_agent(stack, data, "standing")
    assert isinstance(_lease(agent, eligible=False), api.NoWork)  # a session only for a device whose policy holds

    sessions, adapters = [], []
    for night, texts in enumerate(days):
        (data / "text").mkdir(parents=True, exist_ok=True)
        (data / "text" / "train.jsonl").write_bytes(jsonl(texts))  # the user's text so far
        if night == 1:
            _set_lr(stack.artifacts, standing_id, 1e-30)
        if night == 2:
            _set_lr(stack.artifacts, standing_id, spec["lr"])
        promoted_before = stack.job(standing_id)["adapter_id"]
        session = _night(stack, agent, standing_id)
        assert session["status"] == "succeeded", session["error"]
        assert session["spec"]["init_adapter_id"] == promoted_before  # from the promoted version (none: the base)
        adapter = ok(stack.user.get(f"/v1/adapters/{session['adapter_id']}"))
        assert adapter["parent_adapter_id"] == promoted_before
        assert adapter["metrics"]["server"]["replay_max_abs_diff"] == 0.0  # the version replays bit for bit
        held = adapter["held_out"]
        held_rows = sum(len(get_task("text").rows(r)) for r in split_held_out(list(texts), 8)[1])
        assert held["n"] == held_rows  # the device's held-out slice of the data it holds: it grows with the data
        assert adapter["promoted"] == (held["after"]["loss"] < held["before"]["loss"])  # the held-out rule
        standing = stack.job(standing_id)
        assert standing["sessions_run"] == night + 1
        assert standing["adapter_id"] == (adapter["id"] if adapter["promoted"] else promoted_before)
        assert standing["status"] == ("succeeded" if night == 2 else "ready")  # waiting for its next session
        sessions.append(session)
        adapters.append(adapter)

    assert len({s["id"] for s in sessions}) == 3 and [a["version"] for a in adapters] == [1, 2, 3]
    assert adapters[0]["promoted"]  # the first night improves on the base model
    lr0 = adapters[1]["held_out"]
    assert lr0["after"]["loss"] == lr0["before"]["loss"] and adapters[1]["promoted"] is False  # kept, not promoted
    assert sessions[2]["spec"]["init_adapter_id"] == adapters[0]["id"]  # the third night starts from the promoted
    promoted = [a for a in adapters if a["promoted"]][-1]
    assert stack.job(standing_id)["adapter_id"] == promoted["id"]
    archive = stack.user.get(f"/v1/adapters/{promoted['id']}/download")
    assert archive.status_code == 200 and archive.content[:2] == b"PK"  # what the app downloads
    assert isinstance(_lease(agent), api.NoWork)  # no fourth session: the standing job ended after its three
    listed = [j["id"] for j in ok(stack.user.get("/v1/jobs"))["data"] if j["standing_job_id"] == standing_id]
    assert listed == [s["id"] for s in reversed(sessions)]
