"""A device install, simulated on a developer's machine: with this folder first on PYTHONPATH, the packages of the
roles a device does not install (``mobizo.cli.ROLE_OF``: the export and server extras) cannot be imported, as on a
device that installed ``mobizo[device]`` alone. Used by ``tests/device_agent/test_device_install.py`` and the native
backend's end-to-end test; the real thing runs on an emulated arm64 device (``scripts/arm64_device.sh``)."""

from __future__ import annotations

import importlib.abc
import sys

_BLOCKED = {
    "torch", "torchao", "executorch", "transformers", "peft", "gguf", "dp_accounting", "scipy",
    "fastapi", "starlette", "uvicorn", "multipart", "python_multipart", "sqlalchemy", "alembic", "psycopg",
    "pydantic_settings", "celery", "kombu", "redis", "boto3", "botocore", "prometheus_client", "jinja2",
}  # fmt: skip


class NotOnADevice(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in a device install)", name=name)
        return None


sys.meta_path.insert(0, NotOnADevice())
