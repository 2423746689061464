"""The device config file: found where documented, private, and refused when damaged or exposed."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from device_agent.config import ENV_VAR, AgentConfig, config_path, load_config, save_config
from shared.errors import MobizoError

CFG = AgentConfig(server_url="http://127.0.0.1:8000", device_id="dev-1", token="secret", backend="adb", name="pixel")


def test_path_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert config_path() == tmp_path / "home" / ".config" / "mobizo" / "agent.json"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env.json"))
    assert config_path() == tmp_path / "env.json"
    assert config_path(tmp_path / "flag.json") == tmp_path / "flag.json"


def test_saved_config_is_private_and_reads_back(tmp_path: Path) -> None:
    path = save_config(CFG, tmp_path / "new" / "agent.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_config(path) == CFG
    assert json.loads(path.read_text())["token"] == "secret"


def test_overwriting_keeps_mode_and_replaces_content(tmp_path: Path) -> None:
    path = save_config(CFG, tmp_path / "agent.json")
    save_config(AgentConfig("https://example.org", "dev-2", "t2"), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_config(path).device_id == "dev-2"
    assert load_config(path).backend == "executorch"


def test_missing_config_says_to_enroll(tmp_path: Path) -> None:
    with pytest.raises(MobizoError, match="enroll"):
        load_config(tmp_path / "agent.json")


def test_config_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = save_config(CFG, tmp_path / "agent.json")
    path.chmod(0o644)
    with pytest.raises(MobizoError, match="chmod 600"):
        load_config(path)


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"server_url": "http://x"}), json.dumps({**CFG.__dict__, "backend": "tpu"})],
)
def test_malformed_config_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "agent.json"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(MobizoError):
        load_config(path)


def test_bad_values_are_refused() -> None:
    with pytest.raises(MobizoError, match="backend"):
        AgentConfig("http://x", "d", "t", backend="tpu")
    with pytest.raises(MobizoError, match="http"):
        AgentConfig("ftp://x", "d", "t")


def test_enroll_without_a_code_names_the_flag_and_sends_nothing(monkeypatch, capsys) -> None:
    """No --code, no MOBIZO_ENROLLMENT_CODE and an empty standard input: a usage error naming --code, before any
    request (the server's address is one where nothing listens)."""
    import io

    from mobizo.cli import main

    monkeypatch.delenv("MOBIZO_ENROLLMENT_CODE", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["agent", "enroll", "--server", "http://127.0.0.1:9", "--config", "/nonexistent/agent.json"]) == 2
    assert "argument --code: no enrollment code" in capsys.readouterr().err


def test_enroll_takes_the_code_from_the_environment(monkeypatch) -> None:
    from device_agent.commands.agent import _enrollment_code

    monkeypatch.setenv("MOBIZO_ENROLLMENT_CODE", " ABCD-EFGH-JKLM\n")
    assert _enrollment_code(None) == "ABCD-EFGH-JKLM"
    assert _enrollment_code("WXYZ") == "WXYZ"  # --code first
