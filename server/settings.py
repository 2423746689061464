"""Server settings, read from the environment once per process (``get_settings``) or built explicitly in tests."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import SettingError

MIN_ADMIN_TOKEN = 16  # characters; `openssl rand -hex 32` gives 64


class Settings(BaseSettings):
    """Every knob of the server; environment names are ``MOBIZO_<FIELD>`` except ``DATABASE_URL``."""

    # hide_input_in_errors: a refused value (a short admin token, a URL with a password) stays out of the error
    # that stops the server, and so out of its log.
    model_config = SettingsConfigDict(env_prefix="MOBIZO_", extra="ignore", hide_input_in_errors=True)

    data_dir: Path = Field(default=Path("mobizo-data"), description="artifacts and the default SQLite file")
    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "MOBIZO_DATABASE_URL"),
        description="SQLAlchemy URL; default sqlite:///<data_dir>/mobizo.db",
    )
    admin_token: str | None = Field(
        default=None,
        description=f"bearer token of the administrator, at least {MIN_ADMIN_TOKEN} characters (unset: no admin; "
        "set but empty or shorter: the server refuses to start)",
    )
    lease_s: int = Field(default=300, ge=5, description="a lease lasts this long after the last heartbeat")
    checkin_rate: float = Field(
        default=50.0,
        gt=0,
        description="idle lease requests a second the server asks of all its devices, shared fairly among the users "
        "with devices heard from in the last hour: a 204 to a lease carries Retry-After = the user's devices x those "
        "users / this, when at least 1 s; a device asking sooner than told answers 429 (server.pace)",
    )
    max_attempts: int = Field(default=3, ge=1, description="leases per job before an expired one fails it")
    queue: Literal["local", "celery"] = Field(
        default="local",
        description="local: compile and verify in the server's own worker processes (one server per data dir); "
        "celery: on `mobizo worker` processes through the broker at MOBIZO_BROKER_URL",
    )
    broker_url: str | None = Field(
        default=None, description="Celery broker with MOBIZO_QUEUE=celery: redis://host:6379/0 or amqp://host:5672//"
    )
    broker_visibility_timeout_s: int = Field(
        default=7200,
        ge=1,
        description="Redis broker: a task not acknowledged this long after delivery is delivered again; must exceed "
        "the longest export (RabbitMQ: its consumer_timeout must)",
    )
    result_backend_url: str | None = Field(
        default=None,
        description="where Celery workers leave verification results for the server waiting on them; default: the "
        "broker URL when it is Redis (with RabbitMQ, name a Redis here)",
    )
    store_url: str | None = Field(
        default=None,
        description="s3://bucket/prefix: artifacts shared through an S3-compatible bucket (endpoint: boto3's "
        "AWS_ENDPOINT_URL), the data dir a per-machine cache of it; unset: the data dir alone (shared as a volume)",
    )
    compile_workers: int = Field(default=1, ge=1, description="processes compiling programs (MOBIZO_QUEUE=local)")
    compile_paused: bool = Field(default=False, description="accept jobs but leave them queued (fuzzing, maintenance)")
    compile_memory_mb: int | None = Field(
        default=None,
        ge=1,
        description="memory a program export may use; one that needs more fails its job with the figure, before it "
        "starts (default: the memory available on the machine when the compile starts)",
    )
    inference_builds: int = Field(
        default=4,
        ge=1,
        description="inference programs building at once (devices' POST /v1/device/inference); more: 429 "
        "Retry-After. They wait for the compile workers behind every job's compile",
    )
    inference_builds_per_user: int = Field(
        default=2, ge=1, description="inference programs the devices of one user may have building at once"
    )
    inference_builds_per_device: int = Field(
        default=1, ge=1, description="inference programs one device may have building at once"
    )
    merged_total_mb: float = Field(
        default=32768.0,
        gt=0,
        description="merged downloads kept in the data dir, in all (MiB); past it the least recently downloaded are "
        "removed, and a merge larger than it alone is refused (422)",
    )
    merged_per_user_mb: float = Field(
        default=8192.0,
        gt=0,
        description="merged downloads kept for one user's downloads (MiB); past it that user's least recently "
        "downloaded are removed first, and a merge larger than it alone is refused (422)",
    )
    merged_builds: int = Field(
        default=1,
        ge=1,
        description="merged downloads building at once (each loads its base in a compile worker); more: 429 "
        "Retry-After. They wait for the compile workers behind every job's compile",
    )
    merged_builds_per_user: int = Field(
        default=1, ge=1, description="merged downloads one user's requests may have building at once"
    )
    verify_workers: int = Field(
        default=2, ge=1, description="processes replaying uploaded results (MOBIZO_QUEUE=local)"
    )
    verify_per_user: int = Field(
        default=1, ge=1, description="verifications one user may have running or waiting (more: 429 Retry-After)"
    )
    max_upload_mb: float = Field(default=256.0, gt=0, description="largest result upload accepted")
    max_uploads: int = Field(default=8, ge=1, description="result uploads received and verified at once, in all")
    max_uploads_per_device: int = Field(default=2, ge=1, description="result uploads at once from one device")
    max_uploads_per_user: int = Field(
        default=4, ge=1, description="result uploads at once from the devices of one user (of max_uploads in all)"
    )
    upload_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="an upload's body must start to arrive this soon after its head, and then keep up "
        "upload_min_bytes_per_s (byte n by this + n / that); a slower one answers 408 and gives its slot back",
    )
    upload_min_bytes_per_s: float = Field(
        default=4096.0, gt=0, description="the slowest average pace an upload's body may arrive at"
    )
    upload_max_body_s: float = Field(
        default=600.0,
        gt=0,
        description="an upload's whole body must arrive within this many seconds of its head (a slower one answers "
        "408 and gives its slot back): the longest one upload holds a slot",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="a connection must send a request's whole head (request line and headers) this soon after it "
        "opens or after its previous answer; else the server closes it (server.http_protocol)",
    )
    upload_refusal_delay_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="an upload refused (429, 409, any error) is answered after this pause, closing its connection, "
        "so that a device retrying at once is held to one try per pause (server.limits.RefusedUploads)",
    )
    verify_timeout_s: float = Field(
        default=600.0, gt=0, description="a replay running longer is stopped (its worker killed); the upload gets 503"
    )

    privacy_budget_epsilon: float = Field(
        default=10.0,
        gt=0,
        le=1000,
        description="a user's privacy budget (epsilon at delta 1e-5 over all their private jobs) until they set one",
    )
    private_submits_per_user: int = Field(
        default=2,
        ge=1,
        description="private job submits one user (or cohort) may have in progress at once in an API process (more: "
        "429 Retry-After); each may wait on a calibration of its noise",
    )
    privacy_workers: int = Field(
        default=1,
        ge=1,
        description="processes calibrating private jobs' noise and composing their privacy (dp-accounting), off the "
        "API process; about 120 MB each, started at the first private submit",
    )
    privacy_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="a calibration running longer is stopped (its worker killed): the submit gets 503",
    )
    max_active_jobs: int = Field(default=100, ge=1, description="a user's unfinished jobs (more: 429 Retry-After)")
    max_compiles: int = Field(default=8, ge=1, description="a user's jobs queued or compiling (more: 429 Retry-After)")
    enrollment_codes_per_hour: int = Field(
        default=60, ge=1, description="enrollment codes a user may make per hour (more: 429 Retry-After)"
    )
    ui_session_hours: float = Field(
        default=12.0, gt=0, le=24 * 30, description="a dashboard sign-in lasts this long (then sign in again)"
    )
    ui_sessions_per_user: int = Field(
        default=20,
        ge=1,
        description="dashboard sessions one user (or the admin) may hold at once; signing in past it ends their oldest",
    )
    sign_in_failures_per_account: int = Field(
        default=10,
        ge=1,
        description="failed dashboard sign-ins with one user's key (the id in it), or at the admin token, from one "
        "client address (IPv6: one /64) within sign_in_window_s; past it, that account's sign-ins from that address "
        "answer 429 with Retry-After, before the key is checked (from other addresses it may still sign in)",
    )
    sign_in_failures_per_address: int = Field(
        default=50,
        ge=1,
        description="failed dashboard sign-ins from one client address at all accounts together within "
        "sign_in_window_s; past it, every sign-in from there answers 429 with Retry-After",
    )
    trusted_proxies: str = Field(
        default="",
        description="reverse proxies whose X-Forwarded-For names the client (addresses or networks, comma-separated, "
        "e.g. 127.0.0.1,10.0.0.0/8); empty: none, the client is the connection's peer (the address sign-in failures "
        "are counted by)",
    )
    sign_in_window_s: float = Field(
        default=60.0, gt=0, le=24 * 3600, description="the sliding window failed dashboard sign-ins are counted over"
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="also serve the Prometheus metrics, without a token, on this port of MOBIZO_METRICS_HOST (unset: "
        "only GET /metrics, to the admin token)",
    )
    metrics_host: str = Field(default="127.0.0.1", description="the address the metrics port listens on")

    @field_validator("admin_token")
    @classmethod
    def _admin_token(cls, value: str | None) -> str | None:
        """An empty or short admin token stops the server at start: set but empty, the dashboard's sign-in took an
        empty key as the admin's, and a short one is guessable. Surrounding whitespace is refused too: no bearer
        header and no sign-in form (which strips what is typed) can carry it."""
        if value is None:
            return None
        if len(value) < MIN_ADMIN_TOKEN:
            raise ValueError(
                f"MOBIZO_ADMIN_TOKEN must be at least {MIN_ADMIN_TOKEN} characters (it has {len(value)}); "
                "unset it to run without an admin, or make one with `openssl rand -hex 32`"
            )
        if value != value.strip():
            raise ValueError("MOBIZO_ADMIN_TOKEN starts or ends with whitespace, which no client can send")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, value: str) -> str:
        """Each an address or a network: a typo would otherwise trust nobody, or the wrong hosts, silently."""
        import ipaddress

        for entry in (e.strip() for e in value.split(",") if e.strip()):
            try:
                ipaddress.ip_network(entry, strict=False) if "/" in entry else ipaddress.ip_address(entry)
            except ValueError:
                raise ValueError("MOBIZO_TRUSTED_PROXIES: each entry must be an IP address or network") from None
        return ",".join(e.strip() for e in value.split(",") if e.strip())

    @property
    def proxies(self) -> list[str]:
        """``trusted_proxies`` as a list (empty: trust no X-Forwarded-For)."""
        return self.trusted_proxies.split(",") if self.trusted_proxies else []

    @field_validator("store_url")
    @classmethod
    def _bucket_url(cls, value: str | None) -> str | None:
        """A bad ``MOBIZO_STORE_URL`` stops the server at start, naming the setting, not at its first upload."""
        from server.object_store import parse_store_url

        if value:
            parse_store_url(value)
        return value or None

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'mobizo.db').resolve()}"

    @property
    def result_backend(self) -> str | None:
        """The Celery result backend: ``result_backend_url``, or the broker itself when it is Redis."""
        if self.result_backend_url:
            return self.result_backend_url
        return self.broker_url if self.broker_url and self.broker_url.startswith(("redis://", "rediss://")) else None

    @property
    def heartbeat_s(self) -> int:
        """What devices are told: a third of the lease, so that two lost heartbeats do not lose the lease."""
        return max(1, self.lease_s // 3)


def _env_name(field: str) -> str:
    alias = Settings.model_fields[field].validation_alias
    return alias.choices[0] if isinstance(alias, AliasChoices) else f"MOBIZO_{field.upper()}"


def setting_error(exc: ValidationError) -> SettingError:
    """Why the environment's settings were refused, in one line naming each variable (no traceback: the server
    stops with this line)."""
    reasons = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        name = _env_name(field) if field in Settings.model_fields else field
        reason = error["msg"].removeprefix("Value error, ")
        reasons.append(reason if name and reason.startswith(name) else f"{name}: {reason}")
    return SettingError("; ".join(reasons))


@lru_cache
def get_settings() -> Settings:
    """The settings from the environment; ``SettingError`` naming the variables it refuses."""
    try:
        return Settings()
    except ValidationError as exc:
        raise setting_error(exc) from None
