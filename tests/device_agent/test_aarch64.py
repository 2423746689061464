"""The device side on aarch64, emulated: every phone and Jetson this service is for is aarch64, and the server
accepts an ExecuTorch device's B only if it equals the replay of its log bit for bit.

The runner cross-built against the aarch64 wheel of the pinned executorch, in its self-contained bundle
(``device_agent/runner/build.sh --aarch64 --bundle``: the runner, the wheel's libraries, Debian's arm64 glibc and
its loader), runs under ``qemu-aarch64`` with no sysroot (no ``-L``, no ``QEMU_LD_PREFIX``): nothing is taken from
the machine it runs on, as on an Android phone, whose libc is not glibc. It plays the phone's runner on the adb
stand-in, which starts it under ``qemu-aarch64 -cpu cortex-a76`` (``MOBIZO_FAKE_DEVICE_EMULATOR``). A real agent
trains a job of the tiny model with it and uploads to a real server over loopback; the server accepts the upload
bit for bit. The same log's update with fused multiply-adds, which a build without ``-ffp-contract=off`` would
compute, differs from that B (the server refuses any such B: ``tests/security/test_result_integrity.py``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.adapter import read_adapter
from shared.replay import replay
from tests.device_agent.stack import Stack, make_agent, ok
from tests.device_agent.test_agent_e2e import assert_adapter_is_replay_of_uploaded_log, backend_setup
from tests.utils.fused import fused_replay

pytestmark = pytest.mark.slow

# A phone's core (Armv8.2-A with dotprod), and no sysroot: the bundle brings its own C library and loader.
EMULATOR = "qemu-aarch64 -cpu cortex-a76"
LOADER = "ld-linux-aarch64.so.1"
ELF_AARCH64 = 183
CORTEX_A76_CPUINFO = (
    "processor\t: 0\nBogoMIPS\t: 38.40\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp "
    "asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
    "CPU part\t: 0xd0b\n\n"
)


def is_aarch64_elf(path: Path) -> bool:
    header = path.read_bytes()[:20]
    return header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == ELF_AARCH64


@pytest.fixture
def no_sysroot(monkeypatch: pytest.MonkeyPatch) -> None:
    """No QEMU_LD_PREFIX: qemu finds no aarch64 library but what the command names."""
    monkeypatch.delenv("QEMU_LD_PREFIX", raising=False)


def test_the_aarch64_bundle_runs_under_qemu_without_a_sysroot(
    no_sysroot: None, runner_bundle_aarch64: Path, tmp_path: Path
) -> None:
    """Copied anywhere, the bundle starts through its own loader under qemu with no ``-L``: the runner answers its
    usage error (exit 2), and the loader resolves every library inside the bundle, its own C library included."""
    assert shutil.which("qemu-aarch64"), "qemu-user is not installed (bash scripts/aarch64.sh)"
    bundle = shutil.copytree(runner_bundle_aarch64, tmp_path / "elsewhere")
    assert all(is_aarch64_elf(bundle / name) for name in (LOADER, "mobizo_runner.bin", "libc.so.6", "libstdc++.so.6"))
    loader = ["qemu-aarch64", "-cpu", "cortex-a76", str(bundle / LOADER), "--library-path", str(bundle)]
    usage = subprocess.run([*loader, str(bundle / "mobizo_runner.bin")], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage error" in usage.stderr, usage.stderr
    listed = subprocess.run([*loader, "--list", str(bundle / "mobizo_runner.bin")], capture_output=True)
    resolved = [line.split(b" => ")[1].split(b" (")[0] for line in listed.stdout.splitlines() if b" => " in line]
    assert listed.returncode == 0 and len(resolved) >= 10, listed.stdout + listed.stderr  # the wheel's, libc, ...
    assert {Path(path.decode()).parent for path in resolved} == {bundle}


def test_a_job_trained_on_an_emulated_aarch64_phone_is_accepted_bit_for_bit(
    no_sysroot: None, stack: Stack, local_data: Path, runner_bundle_aarch64: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert shutil.which("qemu-aarch64"), "qemu-user is not installed (bash scripts/aarch64.sh)"
    extra, env = backend_setup("adb", tmp_path, runner_bundle_aarch64, tiny_model_dir)
    env["MOBIZO_FAKE_DEVICE_EMULATOR"] = EMULATOR
    cpuinfo = tmp_path / "phone" / "proc" / "cpuinfo"  # the phone's, as a cortex-a76's kernel lists it
    cpuinfo.parent.mkdir(parents=True)
    cpuinfo.write_text(CORTEX_A76_CPUINFO)
    job_id = stack.submit(steps=20)
    agent = make_agent(stack, local_data, "arm-phone", "adb", extra, env)
    assert agent.start().wait() == 0, agent.tail()
    (device,) = ok(stack.user.get("/v1/devices"))["data"]
    assert device["cpu"] == {"arch": "aarch64", "features": ["asimd", "dotprod"]}  # reported by the agent
    (pushed,) = (tmp_path / "phone/data/local/tmp/mobizo/bin").iterdir()  # the whole bundle, named by its files
    assert pushed.name.startswith("bundle-") and is_aarch64_elf(pushed / LOADER)
    assert sorted(p.name for p in pushed.iterdir()) == sorted(p.name for p in runner_bundle_aarch64.iterdir())

    job = stack.job(job_id)
    assert job["status"] == "succeeded" and job["progress"]["step"] == 20
    metrics = stack.adapter(job_id)["metrics"]
    assert metrics["backend"] == "adb" and metrics["server"]["replay_max_abs_diff"] == 0.0
    assert_adapter_is_replay_of_uploaded_log(stack, job_id, tmp_path)

    # The accepted B is the replay's, whose update rounds every multiply and add; fused, they would have moved it.
    records = [json.loads(line) for line in stack.uploaded_log(job_id).read_text().splitlines() if line.strip()]
    _, _, lora_b = read_adapter(tmp_path / "downloaded")  # where the replay check above put the download
    d = sum(b.numel() for b in lora_b.values())
    replayed = replay(torch.zeros(d), records).numpy()
    assert np.array_equal(
        fused_replay(np.zeros(d, np.float32), records, fused=False).view(np.int32), replayed.view(np.int32)
    )
    assert np.count_nonzero(fused_replay(np.zeros(d, np.float32), records) != replayed) > d // 10
