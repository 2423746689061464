"""The device's config file: which server, which device, its secret token, and the training backend.

Path: ``--config`` if given, else ``$MOBIZO_AGENT_CONFIG``, else ``~/.config/mobizo/agent.json``. The file holds
a bearer token, so it is written with mode 0600 (its directory 0700) and atomically; a file that others can read
is refused rather than used.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.backends import DEVICE_BACKENDS
from shared.errors import MobizoError
from shared.files import atomic_write_bytes

ENV_VAR = "MOBIZO_AGENT_CONFIG"
DEFAULT_BACKEND = "executorch"


@dataclass(frozen=True)
class AgentConfig:
    server_url: str
    device_id: str
    token: str
    backend: str = DEFAULT_BACKEND
    name: str = ""
    # The training policy (``device_agent.eligibility.Policy`` fields, ``sysfs_root``, ``check_s``,
    # ``pause_limit_s``); the ``agent run`` options override it; absent: the defaults.
    policy: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.backend not in DEVICE_BACKENDS:
            raise MobizoError(f"unknown backend {self.backend!r}: choose one of {', '.join(DEVICE_BACKENDS)}")
        if not self.server_url.startswith(("http://", "https://")):
            raise MobizoError(f"server URL must start with http:// or https://, got {self.server_url!r}")


def default_path() -> Path:
    return Path.home() / ".config" / "mobizo" / "agent.json"


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where the config lives: the explicit path, else the environment variable, else the default."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return default_path()


def save_config(cfg: AgentConfig, path: Path) -> Path:
    """Write ``cfg`` to ``path`` (mode 0600, atomically); returns the path."""
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    # mode 0600 is set before the token is written: it is never readable by others, not even for a moment.
    atomic_write_bytes(path, (json.dumps(asdict(cfg), indent=2) + "\n").encode(), mode=0o600)
    return path


def load_config(path: Path) -> AgentConfig:
    """The config at ``path``; ``MobizoError`` when it is missing, unreadable, malformed or readable by others."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MobizoError(f"{path}: no agent config; run `mobizo agent enroll` first") from None
    except OSError as exc:
        raise MobizoError(f"{path}: cannot read the agent config ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise MobizoError(f"{path}: holds a device token but is accessible by others; run chmod 600 {path}")
    try:
        fields = json.loads(raw)
        return AgentConfig(**fields)
    except (json.JSONDecodeError, TypeError) as exc:
        raise MobizoError(f"{path}: not a valid agent config ({exc})") from None
