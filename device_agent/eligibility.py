"""Whether this device may train now: the policy on-device learning deployments use — charging, battery at least
X %, temperature at most Y °C, and on a phone the screen off — and where its readings come from.

Readings come from sysfs on Linux and Jetson (``/sys/class/power_supply``, ``/sys/class/thermal``, under a
configurable root so that tests can fake them; a machine with no battery counts as plugged in) and, for a phone on
the adb backend, from ``dumpsys battery``, ``dumpsys thermalservice`` and ``dumpsys power`` (the adb stand-in fakes
them through the same commands): each backend's host reads its own (``device_agent.backends.transports``). A
reading that cannot be had (no thermal zone, no screen) does not count against the policy.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CHECK_S = 5.0  # re-read the readings at most this often while training


@dataclass(frozen=True)
class Policy:
    require_charging: bool = True
    min_battery_pct: float = 20.0
    max_temp_c: float = 45.0
    require_screen_off: bool = True


@dataclass(frozen=True)
class Readings:
    charging: bool
    battery_pct: float | None = None
    temp_c: float | None = None
    screen_on: bool | None = None


def violation(policy: Policy, readings: Readings) -> str | None:
    """Why the policy does not hold (the first reason), or None when it does."""
    if policy.require_charging and not readings.charging:
        return "not charging"
    if readings.battery_pct is not None and readings.battery_pct < policy.min_battery_pct:
        return f"battery {readings.battery_pct:g} % < {policy.min_battery_pct:g} %"
    if readings.temp_c is not None and readings.temp_c > policy.max_temp_c:
        return f"temperature {readings.temp_c:g} °C > {policy.max_temp_c:g} °C"
    if policy.require_screen_off and readings.screen_on:
        return "screen on"
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_sysfs(root: Path) -> Readings:
    """Linux/Jetson readings under ``root`` (``/`` on a real device): plugged in if any mains/USB supply is online or
    a battery says Charging/Full (no battery at all: plugged in); the lowest battery capacity; the hottest thermal
    zone or battery (sysfs gives millidegrees for zones, tenths of a degree for batteries)."""
    supplies = sorted((root / "sys/class/power_supply").glob("*"))
    batteries = [s for s in supplies if _read(s / "type") == "Battery"]
    online = any(_read(s / "online") == "1" for s in supplies if _read(s / "type") != "Battery")
    charging = online or not batteries or any(_read(b / "status") in ("Charging", "Full") for b in batteries)
    capacities = [float(c) for b in batteries if (c := _read(b / "capacity")) is not None]
    temps = [
        float(t) / 1000 for z in sorted((root / "sys/class/thermal").glob("thermal_zone*")) if (t := _read(z / "temp"))
    ]
    temps += [float(t) / 10 for b in batteries if (t := _read(b / "temp")) is not None]
    return Readings(charging, min(capacities, default=None), max(temps, default=None), None)


def _field(text: str, name: str) -> str | None:
    match = re.search(rf"^\s*{re.escape(name)}:\s*(.+?)\s*$", text, re.MULTILINE)
    return match.group(1) if match else None


def parse_dumpsys(battery: str, thermal: str, power: str) -> Readings:
    """A phone's readings from ``dumpsys battery`` (``AC powered``, ``USB powered``, ``Wireless powered``,
    ``level``, ``temperature`` in tenths of a degree), ``dumpsys thermalservice`` (``Temperature{mValue=…}``
    lines: the hottest) and ``dumpsys power`` (``Display Power: state=ON|OFF``, or ``mWakefulness=Awake``)."""
    charging = any(_field(battery, f"{kind} powered") == "true" for kind in ("AC", "USB", "Wireless", "Dock"))
    level = _field(battery, "level")
    temps = [float(t) / 10 for t in [_field(battery, "temperature")] if t is not None]
    temps += [float(v) for v in re.findall(r"Temperature\{mValue=([-\d.]+)", thermal)]
    display = re.search(r"Display Power: state=(\w+)", power)
    wake = re.search(r"mWakefulness=(\w+)", power)
    screen_on = display.group(1) == "ON" if display else (wake.group(1) == "Awake" if wake else None)
    return Readings(charging, None if level is None else float(level), max(temps, default=None), screen_on)


class Eligibility:
    """The policy against fresh readings, re-read at most every ``check_s`` seconds (a phone's dumpsys is slow)."""

    def __init__(self, policy: Policy, read: Callable[[], Readings], check_s: float = DEFAULT_CHECK_S) -> None:
        self.policy, self.read, self.check_s = policy, read, check_s
        self._checked_at: float | None = None
        self._reason: str | None = None

    def reason(self) -> str | None:
        """Why the device may not train now (None: it may)."""
        now = time.monotonic()
        if self._checked_at is None or now - self._checked_at >= self.check_s:
            self._reason = violation(self.policy, self.read())
            self._checked_at = now
        return self._reason

    def holds(self) -> bool:
        return self.reason() is None


def always() -> Eligibility:
    """A device with no policy: it may always train."""
    off = Policy(require_charging=False, min_battery_pct=0, max_temp_c=float("inf"), require_screen_off=False)
    return Eligibility(off, lambda: Readings(True))
