"""A real S3-protocol server on loopback for the store tests: moto's standalone server (``moto_server``, from
``moto[server]``) as a process, spoken to over HTTP by boto3 exactly as AWS or MinIO would be."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.server.live import free_port

# moto accepts any credentials; boto3 refuses to sign without some
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "mobizo-test",
    "AWS_SECRET_ACCESS_KEY": "mobizo-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _moto_server() -> str:
    """The ``moto_server`` script of this interpreter's environment."""
    beside = Path(sys.executable).with_name("moto_server")
    found = str(beside) if beside.exists() else shutil.which("moto_server")
    if found is None:
        raise RuntimeError("moto_server not installed: pip install -e '.[dev]' (it brings moto[server])")
    return found


@contextmanager
def s3_server(log_file: Path, timeout: float = 60.0) -> Iterator[str]:
    """Start ``moto_server`` on a free loopback port → its endpoint URL once it answers; stopped afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            [_moto_server(), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{url}/moto-api/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start:\n{log_file.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_env(endpoint: str) -> dict[str, str]:
    """What a server (or this process's boto3) needs in its environment to reach the loopback S3."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on the server → its ``MOBIZO_STORE_URL`` (``s3://bucket/prefix``)."""
    import boto3

    bucket = f"mobizo-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/artifacts"
