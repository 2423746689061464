"""The training policy end to end: an agent process whose (faked) charger is unplugged mid-training checkpoints
and pauses, keeps its lease with heartbeats marked paused, and when plugged in again resumes and uploads the very
B of an uninterrupted run of the same job, bit for bit; unplugged at the start, it takes no work at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.device_agent.stack import Agent, Stack, wait_for
from tests.device_agent.test_eligibility import fake_sysfs

pytestmark = pytest.mark.slow

# About a second of tiny steps: the agent reads the charger every 0.02 s and the test watches its log every 5 ms, so
# it pauses a few steps after the unplugging, mid-job (60 steps, read every 0.1 s, all ran before the pause on a
# fast machine: the job finished first).
STEPS = 400


def _agent(stack: Stack, local_data: Path, name: str, sysfs: Path) -> Agent:
    flags = ["--sysfs-root", str(sysfs), "--policy-check-s", "0.02"]
    return Agent(stack.enroll(), stack.tmp / f"work-{name}", local_data, stack.tmp / f"agent-{name}.log", flags)


def _plug(sysfs: Path, status: str) -> None:
    (sysfs / "sys/class/power_supply/BAT0/status").write_text(status + "\n")


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_unplugging_pauses_and_plugging_in_resumes_bit_identically(
    stack: Stack, local_data: Path, tmp_path: Path, optimizer: str
):
    """With momentum the program's state is lost with the pause (setting B zeroes it): the agent rebuilds it from
    the log it kept, and the server's replay accepts the upload only if the state was right."""
    sysfs = fake_sysfs(tmp_path / "sysfs", status="Discharging")
    plain = stack.submit(steps=STEPS, seed=11, optimizer=optimizer)
    agent = _agent(stack, local_data, "pausing", sysfs).start()
    wait_for(lambda: any(e["event"] == "ineligible" for e in agent.events()), 120, "the agent to refuse work")
    assert stack.job(plain)["status"] == "ready"  # unplugged: no lease taken
    _plug(sysfs, "Charging")
    wait_for(lambda: agent.steps_logged(plain) >= 3, 300, "training to start", every=0.005)
    _plug(sysfs, "Discharging")
    wait_for(lambda: any(e["event"] == "paused" for e in agent.events()), 60, "the pause")
    paused_at = agent.steps_logged(plain)
    assert paused_at < STEPS, "the job finished before the unplugging: raise STEPS"
    wait_for(lambda: stack.job(plain)["progress"]["step"] == paused_at, 30, "a heartbeat of the paused job")
    assert agent.steps_logged(plain) == paused_at and stack.job(plain)["status"] == "running"
    _plug(sysfs, "Full")
    assert agent.wait() == 0, agent.tail()
    events = [e["event"] for e in agent.events()]
    assert events.index("paused") < events.index("resumed") < events.index("uploaded")
    assert stack.job(plain)["status"] == "succeeded"
    uninterrupted = stack.submit(steps=STEPS, seed=11, optimizer=optimizer)
    other = _agent(stack, local_data, "plugged", fake_sysfs(tmp_path / "plugged")).start()
    assert other.wait() == 0, other.tail()
    assert stack.adapter(plain)["b_sha256"] == stack.adapter(uninterrupted)["b_sha256"]
