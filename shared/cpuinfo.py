"""What a device's CPU can do, as the device reports it to the server: its architecture and the instruction-set
features that decide which kernels XNNPACK (and, on Arm, KleidiAI) choose for a program's matmuls — dot products,
int8 matrix multiply, SVE, SME on Arm; AVX2, FMA, AVX-512, VNNI, AMX on x86-64. Read from Linux's ``/proc/cpuinfo``
(an Android phone's through ``adb shell``). Standard library only.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Literal, get_args

CpuArch = Literal["aarch64", "x86_64", "other"]
CPU_ARCHES: tuple[str, ...] = get_args(CpuArch)
CpuFeature = Literal[
    "asimd", "dotprod", "i8mm", "bf16", "sve", "sve2", "sme", "sme2",
    "avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8",
]  # fmt: skip
CPU_FEATURES: tuple[str, ...] = get_args(CpuFeature)
# /proc/cpuinfo's names where they differ from the ones above
_ALIASES = {"asimddp": "dotprod", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}
_MACHINES = {"aarch64": "aarch64", "arm64": "aarch64", "x86_64": "x86_64", "amd64": "x86_64"}


def machine_arch(machine: str) -> str:
    """``uname -m`` (or ``platform.machine()``) as one of ``CPU_ARCHES``."""
    return _MACHINES.get(machine.strip().lower(), "other")


def parse_cpuinfo(text: str) -> tuple[str, list[str]]:
    """(architecture, features) from a ``/proc/cpuinfo``: Arm kernels list ``Features``, x86 ones ``flags``; the
    features are those of ``CPU_FEATURES`` the first processor has, in that order."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("features", "flags"):
            have = {_ALIASES.get(word, word) for word in value.split()}
            return ("aarch64" if key == "features" else "x86_64"), [f for f in CPU_FEATURES if f in have]
    return "other", []


def this_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """This machine's (architecture, features); no features where there is no ``/proc/cpuinfo`` (macOS)."""
    arch = machine_arch(platform.machine())
    try:
        _, features = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    except OSError:
        features = []
    return arch, features
