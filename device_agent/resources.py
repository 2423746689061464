"""What the device reports it can take on: the free memory where the training steps run.

The agent sends it, with its backend, at enrollment and with every lease request; the server leases only jobs
whose program fits (the program's manifest carries its estimate, ``shared.program.memory_estimate_mb``). For the
adb backend the memory is the phone's (``device_agent.backends.adb.Phone``).
"""

from __future__ import annotations

import os


def meminfo_available_mb(text: str) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo`` text (Linux and Android), in MiB; None when absent."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "MemAvailable":
            return int(value.split()[0]) // 1024  # kB
    return None


def free_memory_mb() -> int | None:
    """Memory available to a new process on this machine, in MiB (None when the system does not say)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            available = meminfo_available_mb(handle.read())
        if available is not None:
            return available
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError, AttributeError):
        return None
