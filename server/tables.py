"""SQLAlchemy tables. Rows are the stored shapes; the public shapes live in ``shared.schemas``.

Every user-owned row carries ``user_id`` so that each query can be scoped to its user (404 for anyone else's).
Secrets (API keys, device tokens, enrollment codes) are stored only as SHA-256 hashes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
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
    # The privacy ledger (``server.privacy``): the budget the user's private jobs spend from (null: the server's
    # default), and a version every private submit bumps, so that two racing submits cannot both spend the rest.
    privacy_epsilon: Mapped[float | None] = mapped_column(Float)
    privacy_delta: Mapped[float | None] = mapped_column(Float)
    privacy_version: Mapped[int] = mapped_column(default=0, server_default="0")


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
    cpu_arch: Mapped[str | None] = mapped_column(String(16))  # shared.cpuinfo: as the device last reported it
    cpu_features: Mapped[str | None] = mapped_column(String(200))  # space-separated
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]  # set once by its user or the admin: its token is refused from then on

    @property
    def cpu(self) -> dict | None:
        """The CPU the device reported (``DevicePublic.cpu``), None if it never did."""
        if self.cpu_arch is None:
            return None
        return {"arch": self.cpu_arch, "features": (self.cpu_features or "").split()}


class DeviceIdentity(NamedTuple):
    """Who a device token names: fixed at enrollment (devices are never re-keyed or deleted), so each API process
    keeps it in memory (``server.lru``) and a heartbeat's token check reads no row. Revocation is not part of it:
    it is a state of the row, which every device route reads in the transaction it runs anyway
    (``server.deps.get_current_device``, the lease's ``accounts.as_reported``, a refused heartbeat's explanation)."""

    id: int
    user_id: int


class LeasingDevice(NamedTuple):
    """A device asking for work, as it reports itself now: which jobs fit it (``state.leases.lease_next``)."""

    id: int
    user_id: int
    backend: str
    memory_mb: int | None


class Program(Base):
    """A compiled program: a training program, shared by every job with the same model and ProgramConfig (``key``
    hashes both), or an inference program of a model and LoRA layout (``kind``).

    The manifest (``shared.program.export_program``, ``shared.inference_program``) names its files with their
    sha256 and size; devices download them by content (``GET /v1/blobs/{sha256}``, ``server.grants``).
    """

    __tablename__ = "programs"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16), default="training", server_default="training")
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    manifest: Mapped[dict[str, Any]]
    memory_mb: Mapped[int | None] = mapped_column(doc="RAM the program needs (the manifest's estimate)")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Cohort(Base):
    """A group of users who opted in to learn one shared adapter of a model on a task (created by the admin)."""

    __tablename__ = "cohorts"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    task: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The cohort's privacy ledger (``server.privacy``), as a user's: what its private federated jobs may spend of
    # each member's data (null: the server's default), and the version every private submit for it bumps.
    privacy_epsilon: Mapped[float | None] = mapped_column(Float)
    privacy_delta: Mapped[float | None] = mapped_column(Float)
    privacy_version: Mapped[int] = mapped_column(default=0, server_default="0")


class CohortMember(Base):
    """A user's consent: ``left_at`` set means the user left (and gets no round work); joining again clears it."""

    __tablename__ = "cohort_members"
    __table_args__ = (UniqueConstraint("cohort_id", "user_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    cohort_id: Mapped[int] = mapped_column(ForeignKey("cohorts.id"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    joined_at: Mapped[datetime] = mapped_column(default=utcnow)
    left_at: Mapped[datetime | None]


class Job(Base):
    """A personal job (``user_id`` set) or a federated job of a cohort (``cohort_id`` set, ``user_id`` None)."""

    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), index=True)
    cohort_id: Mapped[int | None] = mapped_column(ForeignKey("cohorts.id"), index=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    task: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(doc="the JobCreate as submitted")
    federation: Mapped[dict[str, Any] | None] = mapped_column(doc="a federated job's FederationSpec")
    answer_len: Mapped[int | None] = mapped_column(doc="resolved when the program is compiled")
    status: Mapped[str] = mapped_column(String(16), index=True)
    error: Mapped[str | None] = mapped_column(Text)
    device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id"))
    device_backend: Mapped[str | None] = mapped_column(String(16))
    private: Mapped[bool] = mapped_column(default=False, server_default=false(), doc="spec has privacy")
    # No foreign key: adapters already point at jobs, and a cycle of keys needs ALTER TABLE, which SQLite lacks.
    init_adapter_id: Mapped[int | None]
    # A standing job (``standing``) leases a new session job each time (``state.sessions.lease_session``); a session
    # names its standing job (``standing_job_id``); the standing job names its promoted version
    # (``promoted_adapter_id``).
    standing: Mapped[bool] = mapped_column(default=False, server_default=false())
    standing_job_id: Mapped[int | None] = mapped_column(index=True)
    promoted_adapter_id: Mapped[int | None]
    program_id: Mapped[int | None] = mapped_column(ForeignKey("programs.id"))
    leased_device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id"))
    lease_expires_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)
    progress_step: Mapped[int | None]
    progress_loss: Mapped[float | None] = mapped_column(Float)
    progress_steps_per_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Round(Base):
    """Round ``index`` of a federated job: it starts from ``b_sha256`` (B_r) and, once closed, has published the
    cohort adapter ``adapter_id`` (B_{r+1})."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("job_id", "index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    index: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), doc="open, closing, closed, failed")
    closing_at: Mapped[datetime | None] = mapped_column(doc="when the current close began: it names the attempt")
    b_sha256: Mapped[str] = mapped_column(String(64))
    momentum_sha256: Mapped[str | None] = mapped_column(
        String(64), doc="m_r, server-side momentum the round starts with (a B file); None: zeros or no momentum"
    )
    deadline_at: Mapped[datetime | None] = mapped_column(doc="set when the first client leases the round")
    reopened: Mapped[int] = mapped_column(default=0)
    adapter_id: Mapped[int | None]
    mean_loss: Mapped[float | None] = mapped_column(Float)
    aggregate_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    closed_at: Mapped[datetime | None]


class RoundClient(Base):
    """One device's part in a round (at most one per user): leased → reported, or expired / refused."""

    __tablename__ = "round_clients"
    __table_args__ = (UniqueConstraint("round_id", "user_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"))
    device_backend: Mapped[str] = mapped_column(String(16))
    seed: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), doc="leased, reported, expired")
    lease_expires_at: Mapped[datetime | None]
    progress_step: Mapped[int | None]
    log_sha256: Mapped[str | None] = mapped_column(String(64))
    b_sha256: Mapped[str | None] = mapped_column(String(64), doc="the replay of its log from the round's B")
    mean_loss: Mapped[float | None] = mapped_column(Float)
    replay_s: Mapped[float | None] = mapped_column(Float)
    log_bytes: Mapped[int | None]
    counted_in_round_id: Mapped[int | None] = mapped_column(
        ForeignKey("rounds.id"), index=True, doc="the round whose close aggregated its report (buffered: a later one)"
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    reported_at: Mapped[datetime | None]


class Adapter(Base):
    """One trained version; ``version`` counts per (user, model, task), lineage via ``job_id``/``parent_id``; or per
    cohort for a cohort's adapter (``cohort_id`` set, ``user_id`` and ``job_id`` None, lineage via ``round_id``)."""

    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("user_id", "model_id", "task", "version"),
        UniqueConstraint("cohort_id", "version", name="uq_adapters_cohort_version"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), index=True)
    cohort_id: Mapped[int | None] = mapped_column(ForeignKey("cohorts.id"), index=True)
    round_id: Mapped[int | None] = mapped_column(ForeignKey("rounds.id"))
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    task: Mapped[str] = mapped_column(String(64))
    version: Mapped[int]
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id"), unique=True)
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
    held_out: Mapped[dict[str, Any] | None]  # shared.schemas.HeldOut: before/after on the device's held-out data
    promoted: Mapped[bool | None]  # a standing job's session's version: whether it was promoted; None: not a session's
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MergedFile(Base):
    """A merged download kept in the store (``server.merged_builds``): ``merged/<key>.zip``, an adapter folded into
    its base. ``key`` hashes what the merge is made of (``server.merged.merge_key``: the base, B, the LoRA layout and
    the dtype), so every adapter with the same shares the file. Its bytes count against the user whose download built
    it; when a bound is passed the least recently downloaded (``used_at``) go first."""

    __tablename__ = "merged_files"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    sha256: Mapped[str] = mapped_column(String(64))  # of the zip: its ETag
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    used_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class WebSession(Base):
    """A signed-in browser of the dashboard (``server.dashboard.web``): the cookie holds a random secret, the row its
    SHA-256, the user (or the admin: ``user_id`` None) and the CSRF token its forms carry. Signing out deletes the row.

    An admin session also holds the SHA-256 of the admin token it was opened with (``admin_token_hash``): once the
    server's token is another, or unset, the session is refused and deleted
    (``server.dashboard.web.current_viewer``)."""

    __tablename__ = "web_sessions"
    id: Mapped[int] = mapped_column(primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), index=True)
    admin_token_hash: Mapped[str | None] = mapped_column(String(64))
    csrf_token: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ServerKey(Base):
    """A secret of the server itself, made at random by the first process that needs it (``accounts.server_key``;
    ``sign_in``: the dashboard's sign-in form tokens, ``server.dashboard.web``): every API process reads the same one
    from the database."""

    __tablename__ = "server_keys"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))
