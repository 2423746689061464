"""Resource awareness: free memory is read where the steps run."""

from __future__ import annotations

from device_agent.resources import free_memory_mb, meminfo_available_mb

MEMINFO = "MemTotal:        8000000 kB\nMemFree:          100000 kB\nMemAvailable:    2097152 kB\n"


def test_meminfo_parsing() -> None:
    assert meminfo_available_mb(MEMINFO) == 2048
    assert meminfo_available_mb("MemTotal: 1 kB\n") is None


def test_this_machine_reports_free_memory() -> None:
    free = free_memory_mb()
    assert free is not None and free > 0
