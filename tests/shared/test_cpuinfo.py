"""A device's CPU report (shared.cpuinfo): the architecture and the kernel-deciding features of a /proc/cpuinfo."""

from __future__ import annotations

from pathlib import Path

from shared.cpuinfo import CPU_FEATURES, machine_arch, parse_cpuinfo, this_cpu

X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512vnni rdrand\n\n"
# An Armv9 phone core (Cortex-X4 class): SVE2, SME2 and i8mm, as its kernel names them
ARMV9 = (
    "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp "
    "cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm sb "
    "paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh "
    "bti sme sme2\nCPU implementer\t: 0x41\n\nprocessor\t: 1\nFeatures\t: fp asimd\n"
)


def test_features_are_the_vocabularys_in_its_order_with_the_kernels_names() -> None:
    assert parse_cpuinfo(X86) == ("x86_64", ["avx2", "fma", "avx512f", "avx512_vnni"])
    arch, features = parse_cpuinfo(ARMV9)  # the first processor's line
    assert arch == "aarch64"
    assert features == ["asimd", "dotprod", "i8mm", "bf16", "sve", "sve2", "sme", "sme2"]
    assert parse_cpuinfo("") == ("other", [])


def test_machine_names_and_this_machine() -> None:
    assert [machine_arch(m) for m in ("aarch64", "arm64", "x86_64", "AMD64", "riscv64")] == [
        "aarch64", "aarch64", "x86_64", "x86_64", "other",
    ]  # fmt: skip
    arch, features = this_cpu()
    assert arch in ("aarch64", "x86_64", "other") and set(features) <= set(CPU_FEATURES)
    assert this_cpu(Path("/nonexistent/cpuinfo"))[1] == []
