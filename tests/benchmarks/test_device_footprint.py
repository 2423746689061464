"""benchmarks/device_footprint.py: the install closures it sizes and the /proc readings it takes of an agent and its
runner (the whole run, with a server, agents and an emulated device, is the benchmark's own)."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import device_footprint, install_closure

HEAVY = {"torch", "executorch", "transformers", "fastapi", "sqlalchemy", "celery"}


def _dist(site: Path, name: str, requires: list[str], files: dict[str, int]) -> None:
    """An installed distribution in ``site``: its metadata, its files of the given sizes, and a RECORD naming them."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"] + [f"Requires-Dist: {r}\n" for r in requires]
    (info / "METADATA").write_text("".join(lines))
    for path, size in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_bytes(b"x" * size)
    (info / "RECORD").write_text("".join(f"{path},,\n" for path in files))


def test_the_closure_walks_extras_and_markers_and_counts_each_file_once(tmp_path):
    """A requirement brings its base requirements, those of the extras named (on it, or by a requirer on a
    dependency), never one whose marker fails here; a file two distributions list counts once; a required
    distribution that is not installed is named."""
    site = tmp_path / "site"
    _dist(
        site,
        "app",
        ["base", 'gpu ; extra == "device"', 'never ; python_version < "3"', 'nope ; extra == "x"'],
        {
            "app/__init__.py": 10,
        },
    )
    _dist(site, "base", ["Shared_Lib[fast]>=1"], {"base.py": 100, "common/shared.txt": 7})
    _dist(site, "gpu", ['absent ; sys_platform != "nothing"'], {"gpu.py": 1000})
    _dist(site, "shared-lib", ['speed ; extra == "fast"', 'slow ; extra == "slow"'], {"common/shared.txt": 7})
    _dist(site, "speed", [], {"speed.so": 10_000})
    for name in ("never", "nope", "slow"):
        _dist(site, name, [], {f"{name}.py": 1})
    dists = install_closure.installed([str(site)])

    plain = install_closure.closure("app", dists)
    assert [d["name"] for d in plain["distributions"]] == ["app", "base", "shared-lib", "speed"]
    assert plain["missing"] == [] and plain["bytes"] == 10 + 100 + 7 + 10_000  # shared.txt once
    device = install_closure.closure("app[device]", dists)
    assert [d["name"] for d in device["distributions"]] == ["app", "base", "gpu", "shared-lib", "speed"]
    assert device["missing"] == ["absent"] and device["bytes"] == plain["bytes"] + 1000
    assert device["files"] == plain["files"] + 1


def test_the_device_install_is_a_small_part_of_the_full_one_without_torch(tmp_path):
    """This environment's closures of mobizo[device], [export] and [all], computed by a fresh interpreter as on a
    device: the device's are among the full one's, hold the agent's packages and none of the heavy ones, and are a
    small part of its bytes; export's (torch) lies between."""
    device, export, full = device_footprint.closures([sys.executable], cwd=tmp_path)
    names = {d["name"] for d in device["distributions"]}
    everything = {d["name"] for d in full["distributions"]}
    assert device["missing"] == [] and full["missing"] == []
    assert {"mobizo", "numpy", "httpx", "pydantic", "tokenizers"} <= names <= everything
    assert not names & HEAVY and HEAVY <= everything
    assert 0 < device["bytes"] < full["bytes"] / 5 and 0 < device["files"] < full["files"]
    assert device["bytes"] < export["bytes"] < full["bytes"] and "torch" in {d["name"] for d in export["distributions"]}
    files, size = install_closure.folder_size(Path(sys.prefix))
    assert size > full["bytes"] and files > full["files"]


def test_the_readings_are_the_deepest_agents_and_its_runners(tmp_path):
    """A shell starts an "agent" that holds 40 MB, forks (a child that runs on as the agent's copy, as a fork
    before its exec does) and starts a "runner" child of 120 MB: the readings find the agent below the shell (not
    the shell, not its fork), the runner as its own process though the agent's arguments name it too (as
    ``--runner``), and the peaks of each."""
    hold = "import os, sys, time; block = b'x' * ({mb} * 2**20); {then}"
    runner = hold.format(mb=120, then="time.sleep(1.0)")
    agent = hold.format(
        mb=40,
        # the runner's name made here: the agent's own command line names it only as --runner
        then="import subprocess\nif os.fork() == 0: time.sleep(1.0); os._exit(0)\n"
        f"subprocess.run([sys.executable, '-c', {runner!r}, 'mobizo' + '_runner']); time.sleep(0.5)",
    )
    # `; true`: bash stays the agent's parent
    script = f"{sys.executable} -c {shlex.quote(agent)} agent run --runner bundle/mobizo_runner; true"
    proc = subprocess.Popen(["bash", "-c", script, "agent"])  # bash's command line names "agent" too
    watch = device_footprint.Watch(proc.pid, every_s=0.02)
    watch.phase = "training"
    assert proc.wait(timeout=60) == 0
    watch.stop()
    summary = watch.summary("training")
    assert summary["runners"] == 1 and summary["runner_samples"] > 5, summary
    # the kernel's RSS counters are per-CPU approximations: a reading of VmRSS may pass the last VmHWM by a little
    assert 120 <= summary["runner_hwm_mb"] < 160 and 120 <= summary["runner_max_rss_mb"] < summary["runner_hwm_mb"] + 1
    assert 40 <= summary["agent_max_rss_mb"] < summary["agent_hwm_mb"] + 1 < 100, summary
    assert 160 <= summary["device_max_rss_mb"] < 240, summary  # the fork's pages are the agent's, not counted twice
    with pytest.raises(RuntimeError, match="no reading of the agent while idle"):
        watch.summary("idle")


def test_a_missing_bundle_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        device_footprint.main(["--runner", str(tmp_path), "--no-arm64"])
    assert refused.value.code == 2
    assert f"--runner: {tmp_path} is no runner bundle" in capsys.readouterr().err
