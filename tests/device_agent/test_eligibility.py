"""The device's training policy (``device_agent.eligibility``): readings from a faked sysfs tree and from the
``dumpsys`` output of the adb stand-in, and which reading stops training."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from device_agent.eligibility import Eligibility, Policy, Readings, parse_dumpsys, read_sysfs, violation
from tests.device_agent.conftest import ADB_STANDIN_DIR


def fake_sysfs(root: Path, status: str = "Charging", capacity: int = 80, zone_mc: int | None = 35000) -> Path:
    battery = root / "sys/class/power_supply/BAT0"
    battery.mkdir(parents=True, exist_ok=True)
    for name, value in (("type", "Battery"), ("status", status), ("capacity", str(capacity))):
        (battery / name).write_text(value + "\n")
    if zone_mc is not None:
        zone = root / "sys/class/thermal/thermal_zone0"
        zone.mkdir(parents=True, exist_ok=True)
        (zone / "temp").write_text(f"{zone_mc}\n")
    return root


def test_sysfs_readings(tmp_path: Path):
    assert read_sysfs(tmp_path / "empty") == Readings(charging=True)  # no battery: plugged in
    assert read_sysfs(fake_sysfs(tmp_path / "a")) == Readings(True, 80.0, 35.0, None)
    assert read_sysfs(fake_sysfs(tmp_path / "b", "Discharging", 15, 52000)) == Readings(False, 15.0, 52.0, None)
    mains = tmp_path / "b/sys/class/power_supply/AC"
    mains.mkdir()
    (mains / "type").write_text("Mains\n")
    (mains / "online").write_text("1\n")
    assert read_sysfs(tmp_path / "b").charging  # on the charger while the battery reads Discharging


def test_policy_reasons():
    policy = Policy()
    assert violation(policy, Readings(True, 80, 30, False)) is None
    assert violation(policy, Readings(False, 80, 30, False)) == "not charging"
    assert violation(policy, Readings(True, 10, 30, False)) == "battery 10 % < 20 %"
    assert violation(policy, Readings(True, 80, 50, False)) == "temperature 50 °C > 45 °C"
    assert violation(policy, Readings(True, 80, 30, True)) == "screen on"
    assert violation(Policy(require_screen_off=False, require_charging=False), Readings(False, 80, 30, True)) is None


def test_readings_are_cached_for_check_s():
    reads = []
    states = iter([Readings(False), Readings(True)])
    eligibility = Eligibility(Policy(), lambda: reads.append(1) or next(states), check_s=3600)
    assert eligibility.reason() == "not charging" and not eligibility.holds()
    assert len(reads) == 1  # the second question was answered from the cache
    assert Eligibility(Policy(), lambda: Readings(True), check_s=0).holds()


def _adb(root: Path, *args: str) -> str:
    env = {**os.environ, "MOBIZO_FAKE_DEVICE_ROOT": str(root)}
    done = subprocess.run([str(ADB_STANDIN_DIR / "adb"), *args], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def test_dumpsys_of_the_adb_standin(tmp_path: Path):
    def readings() -> Readings:
        return parse_dumpsys(*(_adb(tmp_path, "shell", "dumpsys", s) for s in ("battery", "thermalservice", "power")))

    assert readings() == Readings(True, 90.0, 30.0, False)  # the stand-in's phone: charging, cool, screen off
    faked = tmp_path / "dumpsys"
    faked.mkdir()
    (faked / "battery.txt").write_text("  AC powered: false\n  USB powered: false\n  level: 42\n  temperature: 387\n")
    (faked / "thermalservice.txt").write_text("Temperature{mValue=47.5, mType=0, mName=skin, mStatus=1}\n")
    (faked / "power.txt").write_text("  mWakefulness=Awake\n")
    assert readings() == Readings(False, 42.0, 47.5, True)
