"""Prometheus metrics (``prometheus-client``), served at ``GET /metrics`` to the admin token, or on a port of their
own (``MOBIZO_METRICS_PORT``) for a scraper on a private network.

Two kinds of series:

- **Events**, counted by the process where they happen (this module's counters and histograms, in
  ``prometheus_client``'s default registry): HTTP requests per method, route template and status, with their
  latencies (``RequestMetrics``, a pure ASGI middleware); leases granted; heartbeats; result uploads and round
  reports by outcome (the refusals by reason, named from the answer's status); verification and export durations;
  round closes. With ``MOBIZO_QUEUE=celery`` exports and the replays run in ``mobizo worker`` processes, which have no
  scrape endpoint: the API process still counts the verifications it waited for (their durations include the
  queue), and ``mobizo_export_duration_seconds`` covers only exports of this process's own queue. With several API
  processes (``--workers``) each counts its own requests; a scraper reaches one of them per scrape.
- **State**, read from the database at scrape time (``StateCollector``), so it is the same whichever process
  answers and whoever does the work: jobs by status, the compile queue's depth (jobs queued or compiling) and the
  leases held now.

Every label takes its values from a fixed set, whatever a client sends: a request's route is its template or
``other`` (an unknown path), its method one of ``METHODS`` or ``other`` (the HTTP parser accepts some forty
methods, WebDAV's and RTSP's among them, and each would have made series of its own for anyone, unauthenticated),
its status one the server answers. The metrics port (``serve_metrics``) answers ``/metrics`` and nothing else.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, get_args
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import queries
from server.db import read_only
from server.limits import WORK_UPLOAD
from shared.schemas import JobStatus

disable_created_metrics()  # no *_created series: a counter's start time is noise to a scraper
REQUESTS = Counter("mobizo_http_requests", "HTTP requests answered", ["method", "route", "status"])
LATENCY = Histogram(
    "mobizo_http_request_duration_seconds",
    "time to answer an HTTP request (to the end of the body)",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
LEASES = Counter("mobizo_leases", "work handed to devices: a job, or a part in a federated round", ["kind"])
HEARTBEATS = Counter("mobizo_heartbeats", "device heartbeats received (rate()*60: heartbeats per minute)", ["kind"])
UPLOADS = Counter(
    "mobizo_uploads",
    "result uploads (kind job) and round reports (kind round) answered: outcome accepted, or the refusal's reason",
    ["kind", "outcome"],
)
VERIFY_SECONDS = Histogram(
    "mobizo_verify_duration_seconds",
    "replaying an upload's log (and packaging its adapter) in a verify worker, waiting included",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
EXPORT_SECONDS = Histogram(
    "mobizo_export_duration_seconds",
    "compiling a job's device program (a cached program: the lookup)",
    ["outcome"],
    buckets=(0.1, 1, 5, 15, 30, 60, 120, 300, 600, 1200, 2400),
)
ROUND_CLOSES = Counter("mobizo_round_closes", "federated round closes by outcome", ["outcome"])
PART_STALENESS = Histogram(
    "mobizo_round_part_staleness",
    "versions between the one a counted round part leased and the one its close built (buffered rounds; sync: 0)",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64),
)

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # the rest: "other"
REFUSALS = {
    400: "unparsable",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    408: "too_slow",
    409: "conflict",
    413: "too_large",
    422: "invalid_or_not_replayed",
    429: "busy",
    503: "verify_unavailable",
}


def upload_kind(path: str) -> str:
    """``job`` or ``round``: what an upload to ``/v1/work/{work}/result`` carries, by its work's name."""
    return "round" if path.split("/")[3].startswith("part-") else "job"


def upload_outcome(status: int) -> str:
    return "accepted" if status < 300 else REFUSALS.get(status, f"http_{status}")


def route_of(scope: Scope) -> str:
    """The route template a request matched (``/v1/jobs/{job_id}``, set in the scope by the router), so that ids do
    not make series; unmatched: ``other``."""
    return getattr(scope.get("route"), "path", "other")


def method_of(scope: Scope) -> str:
    """The request's method if it is one of ``METHODS``, else ``other``, so that made-up methods make no series."""
    method = scope["method"]
    return method if method in METHODS else "other"


class RequestMetrics:
    """Counts every answer and its latency by method, route template and status (outermost middleware: it sees the
    answers of the other middlewares too, such as a refused upload's 429)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route, method = route_of(scope), method_of(scope)
            REQUESTS.labels(method, route, str(status)).inc()
            LATENCY.labels(method, route).observe(time.perf_counter() - start)
            if route == WORK_UPLOAD and method == "POST":
                UPLOADS.labels(upload_kind(scope["path"]), upload_outcome(status)).inc()


class StateCollector(Collector):
    """Series read from the database at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        with read_only(self.engine) as conn:
            by_status, leases = queries.jobs_by_status(conn), queries.active_leases(conn)
        jobs = GaugeMetricFamily("mobizo_jobs", "jobs by status", labels=["status"])
        for status in get_args(JobStatus):
            jobs.add_metric([status], by_status.get(status, 0))
        yield jobs
        depth = by_status.get("queued", 0) + by_status.get("compiling", 0)
        yield GaugeMetricFamily("mobizo_compile_queue_depth", "jobs queued or compiling", value=depth)
        held = GaugeMetricFamily("mobizo_active_leases", "leases held now", labels=["kind"])
        for kind, count in leases.items():
            held.add_metric([kind], count)
        yield held


class _Events(Collector):
    """The process's event series (the default registry), forwarded into an app's registry."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


def app_registry(engine: Engine) -> CollectorRegistry:
    """A registry of an app: its database's state and this process's events."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(engine))
    registry.register(_Events())
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def only_metrics(app: WsgiApp) -> WsgiApp:
    """``app`` at ``/metrics``; 404 on every other path (``prometheus_client``'s app answers on any path)."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/metrics":
            return app(environ, start_response)
        body = b"not found: the metrics are at /metrics\n"
        start_response(
            "404 Not Found", [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        )
        return [body]

    return serve


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape on stderr."""


def serve_metrics(registry: CollectorRegistry, port: int, host: str) -> WSGIServer:
    """``GET /metrics`` of ``registry``, without a token, on ``host:port`` (``MOBIZO_METRICS_PORT``), from daemon
    threads; any other path answers 404. Stop it with ``shutdown()`` and ``server_close()``. ``prometheus_client``'s
    ``start_http_server`` with the path check: its server, its handler's quiet and its choice of address family."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(address[0], port, only_metrics(make_wsgi_app(registry)), Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics-port", daemon=True).start()
    return httpd
