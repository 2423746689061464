"""``GET /metrics``: the Prometheus exposition (``server.metrics``), to the admin token. For a scraper without the
token, ``MOBIZO_METRICS_PORT`` serves the same on a port of its own (bind it to a private address)."""

from __future__ import annotations

from fastapi import Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.deps import AdminDep
from server.metrics import exposition
from server.responses import errors
from server.router import Router

router = Router(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "the metrics"}, **errors(401, 403)},
)
def metrics(request: Request, _: AdminDep) -> Response:
    """Prometheus metrics (admin token)."""
    return Response(exposition(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
