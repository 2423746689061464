"""docker-compose.yml read against the code (no Docker engine runs here): every service's command parses with
``mobizo``'s own parser, every environment variable is a setting, and the server and the workers agree on the
database, the broker and the artifacts volume (mounted at the data dir of both)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from mobizo.cli import build_parser
from server.celery_queue import QUEUES
from server.settings import Settings

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
_DEFAULT = re.compile(r"\$\{(\w+)(?::-([^}]*)|:\?[^}]*)?\}")


def _expand(value: str) -> str:
    """Compose's ``${VAR:-default}`` as its default (``${VAR:?msg}``: a placeholder), as an unset shell gives."""
    return _DEFAULT.sub(lambda m: m.group(2) if m.group(2) is not None else f"<{m.group(1)}>", str(value))


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _env_names() -> set[str]:
    """The environment names ``Settings`` reads: MOBIZO_<FIELD>, or the field's aliases."""
    names = set()
    for name, field in Settings.model_fields.items():
        aliases = getattr(field.validation_alias, "choices", None)
        names |= set(aliases) if aliases else {f"MOBIZO_{name.upper()}"}
    return names


def _settings(service: dict, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in _env_names():
        monkeypatch.delenv(name, raising=False)
    for name, value in service["environment"].items():
        monkeypatch.setenv(name, _expand(value))
    return Settings()


def _args(service: dict):
    command = [_expand(part) for part in service["command"]]
    assert command[0] == "mobizo"
    return build_parser().parse_args(command[1:])


def _data_volume(service: dict, data_dir: Path) -> str:
    (volume,) = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == str(data_dir)]
    return volume


def test_services_and_their_settings(services, monkeypatch):
    assert {"db", "redis", "server", "worker"} <= set(services)
    for name in ("server", "worker"):
        unknown = set(services[name]["environment"]) - _env_names()
        assert not unknown, f"{name}: {unknown} are not settings"
    server, worker = _settings(services["server"], monkeypatch), _settings(services["worker"], monkeypatch)
    assert server == worker  # one configuration: same database, broker, data dir
    assert server.queue == "celery"
    assert urlparse(server.broker_url).hostname == "redis" and urlparse(server.db_url).hostname == "db"
    assert server.result_backend == server.broker_url  # Redis serves as both
    for name in ("server", "worker"):
        assert {"db", "redis"} <= set(services[name]["depends_on"])
    assert _data_volume(services["server"], server.data_dir) == _data_volume(services["worker"], worker.data_dir)


def test_commands_parse_and_scale_out(services):
    server = _args(services["server"])
    assert server.command == "server" and server.workers > 1  # allowed: MOBIZO_QUEUE is celery
    worker = _args(services["worker"])
    assert worker.command == "worker" and set(worker.queues.split(",")) == set(QUEUES) and worker.concurrency >= 1


def test_the_images_health_check_only_where_the_api_is(services):
    """The image's HEALTHCHECK asks the API's /healthz: a worker or an agent container would be reported unhealthy."""
    assert "healthcheck" not in services["server"]  # the image's own
    for name in ("worker", "agent"):
        assert services[name]["healthcheck"] == {"disable": True}


def test_the_agent_keeps_its_config_data_and_checkpoints_in_its_volume(services):
    agent = services["agent"]
    args = _args(agent)
    assert args.command == "agent"
    (mount,) = agent["volumes"]
    volume, path = mount.split(":")[:2]
    assert volume == "agent"
    for kept in (args.data_dir, args.work_dir, agent["environment"]["MOBIZO_AGENT_CONFIG"]):
        assert Path(kept).is_relative_to(path), kept
