"""How much memory there is and what work needs: ``peak_rss_mb`` for ``metrics.json`` (training here and on
devices), ``free_memory_mb`` (what a device reports, what the server's compile worker checks), and
``export_need_mb``, the memory a program export takes, so that a compile that cannot fit fails with a clear error
instead of being killed by the kernel's OOM killer."""

from __future__ import annotations

import os
import resource
import sys

# A program export holds the float32 model, the traced graphs of every method and the lowered constants at once.
# Measured (benchmarks/program.py, export peak RSS): 0.5 GB for the tiny model (the libraries alone), 3.9 GB for
# SmolLM2-135M's 0.54 GB of float32 weights, i.e. about 6.3x the weights on top of the libraries; 7x leaves room.
EXPORT_BASE_MB = 600
EXPORT_WEIGHT_FACTOR = 7.0


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


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


def export_need_mb(float32_weight_bytes: int) -> int:
    """Peak memory (MiB) of exporting a program of a model with this many bytes of float32 weights (an estimate)."""
    return int(EXPORT_BASE_MB + EXPORT_WEIGHT_FACTOR * float32_weight_bytes / 2**20) + 1
