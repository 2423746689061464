"""The backend a device runs, by name (``mobizo agent run --backend``), and where its steps run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from device_agent.backends import Backend
from device_agent.backends.transports import Host, LocalHost, Phone, ThisMachine, Transport
from shared.backends import DEVICE_BACKENDS, RUNNER_BACKENDS

# How to build the runner each runner backend pushes, for the message when there is none.
RUNNER_BUILDS = {
    "adb": "device_agent/runner/build.sh --aarch64 --bundle, or build_android.sh",
    "native": "device_agent/runner/build.sh",
}


def make_host(name: str, serial: str | None = None) -> Host:
    """Where the backend called ``name`` runs its steps: the phone ``serial`` for adb, else this machine (what
    enrollment reports before any backend is built)."""
    return Phone(serial) if name == "adb" else ThisMachine()


def make_transport(name: str, serial: str | None = None, work_dir: Path | None = None) -> Transport:
    """The runner backend ``name``'s transport: the phone ``serial`` (adb), or this machine under ``work_dir``."""
    from shared.errors import UsageError

    if name == "adb":
        return Phone(serial)
    if work_dir is None:
        raise UsageError("work_dir", "the native backend stages the runner's files in the agent's work folder")
    return LocalHost(Path(work_dir) / "native")


def make_backend(
    name: str,
    *,
    model_dir: Path | None = None,
    registered: Callable[[], set[str]] | None = None,
    device: str | None = None,
    runner: Path | None = None,
    serial: str | None = None,
    work_dir: Path | None = None,
) -> Backend:
    """The backend called ``name``. torch: ``model_dir`` is the base model on this device, ``registered()`` the
    content hashes of the server's models (None: not checked), ``device`` cpu or cuda. adb and native: ``runner``
    is the native runner built for the device (a binary or a bundle folder); adb: ``serial`` the phone (None: the
    only one attached); native: the runner's files go under ``work_dir``/native."""
    from shared.errors import UsageError

    if name == "executorch":
        from device_agent.backends.local import executorch_backend

        return executorch_backend()
    if name == "torch":
        from device_agent.backends.torch_eager import torch_backend

        if model_dir is None:
            raise UsageError("model_dir", "the torch backend runs the base model in PyTorch: give its directory")
        return torch_backend(Path(model_dir), device, registered)
    if name in RUNNER_BACKENDS:
        from device_agent.backends.runner import RunnerBackend

        if runner is None:
            raise UsageError("runner", f"the {name} backend needs the native runner ({RUNNER_BUILDS[name]})")
        return RunnerBackend(name, make_transport(name, serial, work_dir), runner, RUNNER_BUILDS[name])
    raise UsageError("backend", f"unknown backend {name!r}: choose one of {', '.join(DEVICE_BACKENDS)}")


def make_generator(name: str, runner: Path, serial: str | None = None, work_dir: Path | None = None):
    """Greedy generation in the runner of the runner backend ``name`` (``mobizo agent generate --backend``)."""
    from device_agent.backends.runner import RunnerGenerator

    return RunnerGenerator(make_transport(name, serial, work_dir), runner, RUNNER_BUILDS[name])
