"""The backend a device runs, by name (``mobizo agent run --backend``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from device_agent.backends import Backend
from shared.backends import DEVICE_BACKENDS


def make_backend(
    name: str,
    *,
    model_dir: Path | None = None,
    registered: Callable[[], set[str]] | None = None,
    device: str | None = None,
    runner: Path | None = None,
    serial: str | None = None,
) -> Backend:
    """The backend called ``name``. torch: ``model_dir`` is the base model on this device, ``registered()`` the
    content hashes of the server's models (None: not checked), ``device`` cpu or cuda. adb: ``runner`` is the
    native runner built for the phone, ``serial`` the phone (None: the only one attached)."""
    from shared.errors import UsageError

    if name == "executorch":
        from device_agent.backends.local import executorch_backend

        return executorch_backend()
    if name == "torch":
        from device_agent.backends.torch_eager import torch_backend

        if model_dir is None:
            raise UsageError("model_dir", "the torch backend runs the base model in PyTorch: give its directory")
        return torch_backend(Path(model_dir), device, registered)
    if name == "adb":
        from device_agent.backends.adb import AdbBackend

        if runner is None:
            raise UsageError("runner", "the adb backend needs the native runner built for the phone")
        return AdbBackend(runner, serial)
    raise UsageError("backend", f"unknown backend {name!r}: choose one of {', '.join(DEVICE_BACKENDS)}")
