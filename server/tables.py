"""SQLAlchemy tables. Rows are the stored shapes; the public shapes live in ``shared.schemas``.

Every user-owned row carries ``user_id`` so that each query can be scoped to its user (404 for anyone else's).
Secrets (API keys, device tokens, enrollment codes) are stored only as SHA-256 hashes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, String, Text, TypeDecorator, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite drops the zone, so it is stored naive-UTC and put back)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[str]: JSON}


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Model(Base):
    __tablename__ = "models"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    architecture: Mapped[str] = mapped_column(String(128))
    modules: Mapped[dict[str, Any]] = mapped_column(doc="linear layer name -> [out_features, in_features]")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class EnrollmentCode(Base):
    __tablename__ = "enrollment_codes"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    code_hash: Mapped[str] = mapped_column(String(64), unique=True)
    expires_at: Mapped[datetime]
    used_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Device(Base):
    __tablename__ = "devices"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    platform: Mapped[str] = mapped_column(String(128))
    backend: Mapped[str] = mapped_column(String(16))
    memory_mb: Mapped[int | None]
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime | None]


class Program(Base):
    """A compiled program, shared by every job with the same model and ProgramConfig (``key`` hashes both).

    The manifest (``shared.program.export_program``) names its files with their sha256 and size.
    """

    __tablename__ = "programs"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    manifest: Mapped[dict[str, Any]]
    memory_mb: Mapped[int | None] = mapped_column(doc="RAM the program needs (the manifest's estimate)")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    task: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(doc="the JobCreate as submitted")
    answer_len: Mapped[int | None] = mapped_column(doc="resolved when the program is compiled")
    status: Mapped[str] = mapped_column(String(16), index=True)
    error: Mapped[str | None] = mapped_column(Text)
    device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id"))
    device_backend: Mapped[str | None] = mapped_column(String(16))
    # No foreign key: adapters already point at jobs, and a cycle of keys needs ALTER TABLE, which SQLite lacks.
    init_adapter_id: Mapped[int | None]
    program_id: Mapped[int | None] = mapped_column(ForeignKey("programs.id"))
    leased_device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id"))
    lease_expires_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)
    progress_step: Mapped[int | None]
    progress_loss: Mapped[float | None] = mapped_column(Float)
    progress_steps_per_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Adapter(Base):
    """One trained version; ``version`` counts per (user, model, task); lineage via ``job_id``/``parent_id``."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("user_id", "model_id", "task", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    task: Mapped[str] = mapped_column(String(64))
    version: Mapped[int]
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), unique=True)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("adapters.id"))
    rank: Mapped[int]
    alpha: Mapped[float] = mapped_column(Float)
    targets: Mapped[list[str]]
    a_seed: Mapped[int]
    b_sha256: Mapped[str] = mapped_column(String(64))  # the stored B: the replay of the log
    upload_b_sha256: Mapped[str] = mapped_column(String(64))  # the B the device uploaded: finds a repeated upload
    log_sha256: Mapped[str] = mapped_column(String(64))
    archive_sha256: Mapped[str] = mapped_column(String(64))
    archive_size: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
