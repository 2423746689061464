"""How much memory there is and what work needs: ``peak_rss_mb`` for ``metrics.json`` (training here and on
devices), ``free_memory_mb`` (what a device reports, what the server's compile worker checks), and
``export_need_mb``, the memory a program export takes, so that a compile that cannot fit fails with a clear error
instead of being killed by the kernel's OOM killer."""

from __future__ import annotations

import os
import resource
import sys

# A program export holds the model, the traced graphs of every method and the lowered constants at once. Peak RSS
# measured on 2-core machines (benchmarks/export_time.py's shipped variant, `/usr/bin/time mobizo export`):
# - float32: 0.5 GB for the tiny model (the libraries alone); 2.4 GB for SmolLM2-135M's 513 MiB of float32 weights
#   (q 4, batch 16); 9.5 GB for TinyLlama-1.1B's 4,196 MiB (q 1, batch 1), nearly all of it reached while lowering
#   (TinyLlama: 0.6 GB by the end of tracing, 9.0 GB by the end of lowering): about twice the weights.
# - 8da4w: 2.9 GB for SmolLM2-135M (q 4, batch 16); 7.1 GB for TinyLlama-1.1B (q 1, batch 1). The linears are
#   quantized right after loading, so the weights count about 1.1x and the traced graphs about 2.3 GB.
# (base MiB, factor on the float32 weights' MiB) for each quantization: 4-6 % above each of these figures (and
# about 1 GB above the tiny model's, a safe side for a guard). These are one process's: an export lowers in a second
# process only where the memory available (or the compile budget, where less) is twice one process's need
# (shared.lowering.lowering_processes).
EXPORT_NEED: dict[str, tuple[int, float]] = {"none": (1500, 2.0), "8da4w": (2400, 1.2)}


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


def export_need_mb(float32_weight_bytes: int, quantize: str = "none") -> int:
    """Peak memory (MiB) of exporting a program of a model with this many bytes of float32 weights, its base
    weights quantized as ``quantize`` says (an estimate)."""
    base, factor = EXPORT_NEED[quantize]
    return int(base + factor * float32_weight_bytes / 2**20) + 1
