"""A real server on a free loopback port, for end-to-end tests: a ``mobizo server`` process (``server_process``),
or an app built in the test served by uvicorn in a thread (``app_in_thread``), to plug in a fake compile queue;
and a ``mobizo worker`` process (``worker_process``) for the Celery queue."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(env: dict[str, str], log_file: Path, timeout: float = 60.0, workers: int = 1) -> Iterator[str]:
    """Start the server (``workers`` API processes) with ``env`` added to the environment; yields its URL once
    ``/healthz`` answers."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mobizo", "server", "--host", "127.0.0.1", "--port", str(port)]
            + ["--workers", str(workers)],
            cwd=REPO,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, log_file, timeout)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def server_pid(url: str) -> int:
    """The pid of the ``mobizo server`` process (``server_process``) listening at ``url``, found by its command
    line."""
    port = url.rsplit(":", 1)[1].encode()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mobizo" in argv and b"server" in argv and port in argv:
            return int(proc.name)
    raise RuntimeError(f"no mobizo server process listens at {url}")


def mapped(pid: int, package: str) -> list[str]:
    """The files of ``package`` (a folder of site-packages: ``torch``) mapped into process ``pid``: the shared
    libraries of an imported extension."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in lines if f"/site-packages/{package}/" in line})


def _wait_healthy(url: str, proc: subprocess.Popen, log_file: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_file.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server did not answer within {timeout} s:\n{log_file.read_text()[-3000:]}")


@contextmanager
def app_in_thread(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` (lifespan included) on a free loopback port from a thread; yields its URL once started."""
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread exited before starting")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def worker_process(env: dict[str, str], log_file: Path, queues: str = "compile,verify") -> Iterator[int]:
    """Start ``mobizo worker`` in a session of its own; yields its pid once Celery says it is ready. Stopped with
    its whole process group (pool processes included), so a test may also SIGKILL the group itself."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mobizo", "worker", "--queues", queues, "--concurrency", "1"],
            cwd=REPO,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while b" ready." not in log_file.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start ({proc.poll()}):\n{log_file.read_text()[-3000:]}")
            time.sleep(0.2)
        yield proc.pid
    finally:
        kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait()


def kill_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group led by ``pid`` (gone already: nothing to do)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
