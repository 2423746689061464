"""The shared tier of the artifact store: an S3-compatible bucket (``MOBIZO_STORE_URL=s3://bucket/prefix``).

API processes and workers on different machines each keep their own data dir; what one of them publishes
(programs, weights, tokenizers, adapters, logs, archives, round records) is uploaded here under the same relative
name, and another fetches it on first use into its own data dir, which is then a cache (``server.store``). Names
are content addresses or program keys, written once: a name that is already in the bucket is not uploaded again.

The endpoint is boto3's own setting (``AWS_ENDPOINT_URL``, or ``AWS_ENDPOINT_URL_S3``), as are the credentials
and region (``AWS_ACCESS_KEY_ID``…, ``AWS_DEFAULT_REGION``), so any S3-protocol server works (AWS, MinIO, Ceph,
moto's server in the tests). boto3 is imported only by servers configured with a bucket.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from shared.errors import FieldError
from shared.files import PRIVATE_FILE, open_private, private_dir


class SharedObjects(Protocol):
    """What ``ArtifactStore`` needs of a shared tier."""

    def exists(self, name: str) -> bool:
        """Whether the bucket holds ``name``."""

    def put(self, name: str, path: Path) -> None:
        """Upload the file ``path`` as ``name`` unless ``name`` is there already (names are written once)."""

    def get(self, name: str, dst: Path) -> bool:
        """Download ``name`` to ``dst`` (whole, or not at all) → False when the bucket has no such object."""

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (a verify task's spool, ``server.verify_spool``)."""


def parse_store_url(url: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` → (bucket, prefix ending in ``/`` or empty); a clear error for anything else."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
        raise FieldError("store_url", f"must be s3://bucket or s3://bucket/prefix, not {url!r}")
    prefix = parsed.path.strip("/")
    return parsed.netloc, f"{prefix}/" if prefix else ""


class S3Objects:
    """``SharedObjects`` on an S3 bucket through boto3 (multipart uploads and downloads for large ``.ptd`` files)."""

    def __init__(self, url: str) -> None:
        import boto3

        self.bucket, self.prefix = parse_store_url(url)
        self._s3 = boto3.client("s3")

    def _key(self, name: str) -> str:
        return self.prefix + name

    def exists(self, name: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def put(self, name: str, path: Path) -> None:
        if not self.exists(name):
            self._s3.upload_file(str(path), self.bucket, self._key(name))

    def get(self, name: str, dst: Path) -> bool:
        """Download into a temporary sibling of ``dst``, fsync, rename: a reader never sees part of a file, and
        two processes fetching the same name at once both end with the whole file."""
        from botocore.exceptions import ClientError

        dst = Path(dst)
        if not dst.parent.is_dir():  # a program folder this machine has never seen: only made for a real object
            if not self.exists(name):
                return False
            private_dir(dst.parent)
        tmp = dst.with_name(f".tmp-{uuid.uuid4().hex}-{dst.name}")
        try:
            with open_private(tmp) as out:
                self._s3.download_fileobj(self.bucket, self._key(name), out)
                out.flush()
                os.fsync(out.fileno())
        except ClientError as exc:
            tmp.unlink(missing_ok=True)
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.chmod(tmp, PRIVATE_FILE)
        os.replace(tmp, dst)
        return True

    def delete_prefix(self, prefix: str) -> None:
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        for page in pages:
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})


def shared_objects(url: str | None) -> SharedObjects | None:
    """The shared tier ``MOBIZO_STORE_URL`` names, or None (the data dir alone; shared, if at all, as a volume)."""
    return S3Objects(url) if url else None
