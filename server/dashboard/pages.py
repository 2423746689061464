"""The dashboard's pages (mounted at ``/ui``): server-rendered (Jinja2 templates in ``templates/``, charts as
inline SVG from ``server.dashboard.charts``, no JavaScript) over the same reads, scoping and writes as the REST
API: a user sees and acts on their own jobs, devices and adapters (and their cohorts' adapters), anyone else's is a
404 page; the admin sees the cohorts' federated jobs, users, every device (and revokes any, as the REST API lets
it), models and the queues, and each cohort's page: the distribution of its members' gains from personalizing its
adapter, naming no member. Sign-in, the session cookie and CSRF: ``server.dashboard.web``.

Pages read as every request does, in autocommit (``server.db``): drawing a page, its charts included, holds no
transaction, so no writer of any tenant waits on a page view."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Annotated, Any

from fastapi import Form, HTTPException, Query, Request, Response, status
from fastapi.responses import RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.orm import Session

from server import accounts, queries, registry
from server.dashboard.charts import Node, Series, line_chart, lineage_chart, strip_chart
from server.dashboard.web import (
    PREFIX,
    SESSION_COOKIE,
    CurrentViewer,
    SignInThrottleDep,
    Viewer,
    account_of,
    check_csrf,
    check_sign_in_form,
    client_address,
    page,
    sign_in,
    sign_in_page,
)
from server.deps import JobSpecsDep, ObjectId, QueueDep, SessionDep, SettingsDep, StoreDep, get_user_or_admin
from server.registry import adapter_public
from server.responses import not_found
from server.router import Router
from server.state import leases
from server.state.jobs import cancel as cancel_job
from server.state.sessions import promotes
from server.tables import Cohort, Model
from server.views import archive_response, caller_device, caller_job, job_public, user_adapter
from shared.schemas import MAX_DB_INT, TERMINAL_STATUSES, HeldOut, JobPublic

router = Router(include_in_schema=False)  # mounted at PREFIX (``server.dashboard.create_dashboard``)
CsrfField = Annotated[str, Form(max_length=256)]
MAX_CHART_POINTS = 2000  # a longer training curve is drawn at every k-th step


def _see_other(path: str) -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}{path}", status.HTTP_303_SEE_OTHER)


def _need_user(viewer: Viewer) -> None:
    if viewer.user is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this page is a user's; the admin has no devices or adapters")


# --- signing in and out -------------------------------------------------------------------------------------------


@router.get("/")
def home() -> Response:
    """The dashboard's entry: its jobs page."""
    return _see_other("/jobs")


@router.get("/login")
def login_form(request: Request) -> Response:
    """The sign-in form."""
    return sign_in_page(request)


@router.post("/login")
def login(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    throttle: SignInThrottleDep,
    api_key: Annotated[str, Form(max_length=256)] = "",
    csrf_token: CsrfField = "",
) -> Response:
    """The API key (or the admin token), checked as the REST API checks it; a new session on success. An empty key
    is refused before anything else is looked at: no credential is empty (``Settings`` refuses an empty admin
    token), and one that was must not open a session. A client address or an account with too many recent
    failures is refused (429, ``Retry-After``) before the key is checked (``server.dashboard.web.SignInThrottle``)."""
    key = api_key.strip()
    if not key:
        return sign_in_page(request, "enter an API key or the admin token", status.HTTP_401_UNAUTHORIZED)
    check_sign_in_form(request, csrf_token)
    address, account = client_address(request), account_of(key)
    refusal = throttle.refusal(address, account)
    if refusal is not None:
        reason, retry_after_s = refusal
        refused = sign_in_page(request, reason, status.HTTP_429_TOO_MANY_REQUESTS)
        refused.headers["Retry-After"] = str(retry_after_s)
        return refused
    credentials = HTTPAuthorizationCredentials(scheme="Bearer", credentials=key)
    try:
        user = get_user_or_admin(credentials, session, settings)
    except HTTPException:
        throttle.failed(address, account)
        return sign_in_page(request, "not a valid API key or admin token", status.HTTP_401_UNAUTHORIZED)
    response = _see_other("/jobs")
    sign_in(response, session, user, settings)
    return response


@router.post("/logout")
def logout(viewer: CurrentViewer, session: SessionDep, csrf_token: CsrfField = "") -> Response:
    """End the dashboard session."""
    check_csrf(viewer.csrf, csrf_token)
    accounts.close_web_session(session, viewer.token_hash)
    response = _see_other("/login")
    response.delete_cookie(SESSION_COOKIE, path=PREFIX, secure=True, httponly=True, samesite="strict")
    return response


# --- jobs ---------------------------------------------------------------------------------------------------------


def _eta_s(job: JobPublic) -> float | None:
    step, rate = job.progress.step, job.progress.steps_per_s
    if job.status != "running" or step is None or not rate:
        return None
    return max(0.0, (job.spec.steps - step) / rate)


@router.get("/jobs")
def jobs(
    request: Request,
    viewer: CurrentViewer,
    session: SessionDep,
    specs: JobSpecsDep,
    skip: int = Query(0, ge=0, le=MAX_DB_INT),
    limit: int = Query(50, ge=1, le=500),
) -> Response:
    """The caller's jobs, newest first, with status and progress."""
    rows, count = queries.jobs_of(session, None if viewer.admin else viewer.user.id, skip, limit)
    shown = [job_public(session, *row, specs=specs) for row in rows]
    return page(
        request,
        "jobs.html",
        viewer,
        jobs=[(job, _eta_s(job)) for job in shown],
        count=count,
        skip=skip,
        limit=limit,
    )


def training_chart(metrics: dict[str, Any] | None) -> str | None:
    """The device's mean path loss at every step (every k-th past ``MAX_CHART_POINTS``); None when the upload has
    none (a private job uploads no loss)."""
    losses = (metrics or {}).get("losses")
    if not losses:
        return None
    every = -(-len(losses) // MAX_CHART_POINTS)
    points = [(step, losses[step - 1]) for step in range(1, len(losses) + 1, every)]
    title = "training loss (mean over the step's 2q paths)" + (f", every {every}th step" if every > 1 else "")
    return line_chart([Series("training loss", points)], title, "step", "loss")


def held_out_charts(held_out: HeldOut | None) -> list[str]:
    """Accuracy and loss on the device's held-out data at each measurement (``eval_every``), or before and after."""
    if held_out is None:
        return []
    curve = held_out.curve or [held_out.before, held_out.after]
    charts = []
    for name in ("accuracy", "loss"):
        points = [(e.step or 0, getattr(e, name)) for e in curve if getattr(e, name) is not None]
        if points:
            title = f"held-out {name} ({held_out.n or '?'} examples on the device)"
            y_range = (0.0, 1.0) if name == "accuracy" else None
            charts.append(line_chart([Series(f"held-out {name}", points)], title, "step", name, y_range=y_range))
    return charts


def _rounds(session: Session, job_id: int) -> tuple[list[dict[str, Any]], list[str]]:
    """A federated job's rounds (participants, refusals, the parts each close counted and their staleness) and the
    charts: the aggregate's mean loss by round, and for a buffered job its counted parts by staleness."""
    listed = queries.rounds_of(session, job_id)
    index_of = {round_.id: round_.index for round_, _ in listed}
    counted: dict[int, list[int]] = defaultdict(list)  # round id → the staleness of each part its close counted
    for _, clients in listed:
        for client in clients:
            if client.counted_in_round_id is not None:
                closer = client.counted_in_round_id
                counted[closer].append(index_of[closer] - index_of[client.round_id])
    rounds = []
    for round_, clients in listed:
        by_status = defaultdict(list)
        for client in clients:
            by_status[client.status].append(client)
        rounds.append({"round": round_, "clients": clients, "by_status": by_status, "counted": counted[round_.id]})
    charts = []
    points = [(r["round"].index, r["round"].mean_loss) for r in rounds if r["round"].mean_loss is not None]
    if points:
        charts.append(
            line_chart([Series("mean loss", points)], "reported clients' mean loss by round", "round", "loss")
        )
    ages = [s for r in rounds for s in r["counted"]]
    if ages and max(ages) > 0:
        histogram = [(s, float(ages.count(s))) for s in range(max(ages) + 1)]
        title = "counted parts by staleness (versions between lease and close)"
        charts.append(line_chart([Series("parts", histogram)], title, "staleness", "parts"))
    return rounds, charts


def _sessions(session: Session, job_id: int) -> tuple[list[dict[str, Any]], list[str]]:
    """A standing job's sessions (each with its version, held-out figures and whether it was promoted) and the chart
    of its held-out perplexity across sessions (an lm task's; loss for other tasks): each session's version after
    training beside the version it started from (before), both measured on that session's held-out slice."""
    listed = []
    for number, (job_row, adapter) in enumerate(queries.sessions_of(session, job_id), start=1):
        held = None if adapter is None or adapter.held_out is None else HeldOut.model_validate(adapter.held_out)
        listed.append({"number": number, "job": job_row, "adapter": adapter, "held_out": held})
    measured = [s for s in listed if s["held_out"] is not None]
    if not measured:
        return listed, []
    lm = all(s["held_out"].after.perplexity is not None for s in measured)
    name = "perplexity" if lm else "loss"
    series = [
        Series(f"{when} ({what})", [(s["number"], getattr(getattr(s["held_out"], when), name)) for s in measured])
        for when, what in (("before", "the version it started from"), ("after", "the new version"))
    ]
    title = f"held-out {name} by session (each on the device's held-out slice then)"
    return listed, [line_chart(series, title, "session", name)]


@router.get("/jobs/{job_id}")
def job(request: Request, job_id: ObjectId, viewer: CurrentViewer, session: SessionDep) -> Response:
    """One job: its learning curves, held-out accuracy and rounds."""
    found = caller_job(session, viewer.user, job_id)
    shown = job_public(session, found)
    adapter = registry.job_adapter(session, job_id)
    rounds, rounds_charts = _rounds(session, job_id) if found.federation is not None else ([], [])
    sessions, sessions_charts = _sessions(session, job_id) if found.standing else ([], [])
    return page(
        request,
        "job.html",
        viewer,
        job=shown,
        eta_s=_eta_s(shown),
        finished=shown.status in TERMINAL_STATUSES,
        training=training_chart(adapter.metrics if adapter is not None else None),
        private=shown.spec.privacy is not None,
        held_out=held_out_charts(shown.held_out),
        rounds=rounds,
        rounds_charts=rounds_charts,
        standing=found.standing,
        sessions=sessions,
        sessions_charts=sessions_charts,
    )


@router.post("/jobs/{job_id}/cancel")
def cancel(
    job_id: ObjectId, viewer: CurrentViewer, session: SessionDep, queue: QueueDep, csrf_token: CsrfField = ""
) -> Response:
    """Cancel a job, as POST /v1/jobs/{id}/cancel does."""
    check_csrf(viewer.csrf, csrf_token)
    found = caller_job(session, viewer.user, job_id)
    if cancel_job(session, found):
        queue.cancel(job_id)
    return _see_other(f"/jobs/{job_id}")


# --- devices ------------------------------------------------------------------------------------------------------


@router.get("/devices")
def devices(request: Request, viewer: CurrentViewer, session: SessionDep) -> Response:
    """The caller's devices and the work each holds."""
    _need_user(viewer)
    mine = queries.devices_of(session, viewer.user.id)
    work = queries.device_work(session, [d.id for d in mine])
    return page(request, "devices.html", viewer, devices=[(d, work.get(d.id, [])) for d in mine])


@router.post("/devices/{device_id}/revoke")
def revoke(device_id: ObjectId, viewer: CurrentViewer, session: SessionDep, csrf_token: CsrfField = "") -> Response:
    """Revoke a device, as ``POST /v1/devices/{id}/revoke`` does: a user their own (anyone else's is a 404), the
    admin any; then back to the page that listed it."""
    check_csrf(viewer.csrf, csrf_token)
    leases.revoke_device(session, caller_device(session, viewer.user, device_id).id)
    return _see_other("/admin" if viewer.admin else "/devices")


# --- adapters -----------------------------------------------------------------------------------------------------


@router.get("/adapters")
def adapters(request: Request, viewer: CurrentViewer, session: SessionDep) -> Response:
    """The adapters the user may see, one lineage (model, task, owner) per table, with its graph."""
    _need_user(viewer)
    rows, _ = queries.adapters_of(session, viewer.user.id, None, None, 0, 1000)
    lineages: dict[tuple, list] = defaultdict(list)
    for adapter, model, *_ in sorted(rows, key=lambda row: row[0].id):
        shown = adapter_public(session, adapter, model.name)
        lineages[(model.name, adapter.task, adapter.cohort_id)].append(shown)
    shown = [
        {
            "model": model,
            "task": task,
            "cohort_id": cohort_id,
            "versions": versions,
            "graph": lineage_chart(
                [Node(a.id, f"v{a.version}", a.parent_adapter_id or _previous(versions, a)) for a in versions]
            ),
        }
        for (model, task, cohort_id), versions in lineages.items()
    ]
    return page(request, "adapters.html", viewer, lineages=shown)


def _previous(versions: list, adapter: Any) -> int | None:
    """A cohort's version follows the one before it (round r+1 starts from round r's adapter)."""
    if adapter.cohort_id is None:
        return None
    earlier = [a.id for a in versions if a.version == adapter.version - 1]
    return earlier[0] if earlier else None


@router.get("/adapters/{adapter_id}")
def adapter(request: Request, adapter_id: ObjectId, viewer: CurrentViewer, session: SessionDep) -> Response:
    """One adapter: its version, lineage and held-out figures."""
    _need_user(viewer)
    found = user_adapter(session, viewer.user.id, adapter_id)
    shown = adapter_public(session, found, session.get_one(Model, found.model_id).name)
    return page(
        request,
        "adapter.html",
        viewer,
        adapter=shown,
        training=training_chart(shown.metrics),
        held_out=held_out_charts(shown.held_out),
    )


@router.get("/adapters/{adapter_id}/download")
def download(adapter_id: ObjectId, viewer: CurrentViewer, session: SessionDep, store: StoreDep) -> Response:
    """The PEFT archive, as ``GET /v1/adapters/{id}/download`` serves it."""
    _need_user(viewer)
    return archive_response(session, store, user_adapter(session, viewer.user.id, adapter_id))


# --- cohorts ------------------------------------------------------------------------------------------------------


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """The 25th percentile, the median and the 75th of ``values`` (at least one), interpolated between the sorted
    values as numpy's default does (``statistics.quantiles``' inclusive method)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def _latest_measured(rows: list) -> tuple[list[dict[str, Any]], int]:
    """Of ``queries.personalized_from_cohort``'s rows (oldest first), each member's latest adapter with a held-out
    loss before and after, as its figures and the cohort version it started from; and how many members have such
    adapters but none measured."""
    latest: dict[int, dict[str, Any]] = {}
    for user_id, held_out, version in rows:
        held = None if held_out is None else HeldOut.model_validate(held_out)
        if held is not None and held.before.loss is not None and held.after.loss is not None:
            latest[user_id] = {"held_out": held, "version": version, "improved": promotes(held_out)}
    return list(latest.values()), len({user_id for user_id, _, _ in rows} - latest.keys())


def cohort_gains(session: Session, cohort: Cohort) -> dict[str, Any]:
    """What personalizing the cohort's population adapter did for each member, on the member's own held-out data.

    Which adapters: each member's (now: joined, not left) latest adapter trained from one of the cohort's versions
    (``queries.personalized_from_cohort``: a personal job started from it with ``--init-adapter``, or a standing
    job's session that started from it), with a held-out loss before and after. Its held-out ``before`` is the
    cohort's version itself, measured on the member's held-out slice at step 0, and ``after`` the member's new
    version on the same slice, so before − after is the gain of personalization over the population adapter, each
    member's figure measured on the same data. The data model supports no other reading: a personal job belongs to
    no cohort (only a federated job has ``cohort_id``); what links a member's adapter to the cohort is its lineage.
    A standing job's later versions start from the member's own promoted version, so their before is that version,
    not the cohort's: they are not counted (their gains, session by session, are on the standing job's page).

    The figures are the gains' median and quartiles, in loss and, for an lm task (every measured member has a
    perplexity), in perplexity, and the share of members improved (after below before: ``state.sessions.promotes``, the
    rule that promotes a standing job's version). No member is named: the admin, who sees this page, sees no user's
    personal jobs or adapters anywhere else either."""
    measured, unmeasured = _latest_measured(queries.personalized_from_cohort(session, cohort.id))
    figures, charts = [], []
    lm = bool(measured) and all(m["held_out"].after.perplexity is not None for m in measured)
    for name in ("loss", "perplexity") if lm else ("loss",):
        gains = [getattr(m["held_out"].before, name) - getattr(m["held_out"].after, name) for m in measured]
        if not gains:
            continue
        q1, median, q3 = quartiles(gains)
        figures.append({"name": name, "n": len(gains), "q1": q1, "median": median, "q3": q3})
        title = f"gain in held-out {name} (before − after) of {len(gains)} members"
        charts.append(strip_chart(gains, title, f"{name} before − after (right of 0: improved)", (q1, median, q3)))
    versions = sorted({m["version"] for m in measured})
    return {
        "members": queries.cohort_members(session, cohort.id),
        "measured": len(measured),
        "unmeasured": unmeasured,
        "improved": sum(m["improved"] for m in measured),
        "versions": [(v, sum(m["version"] == v for m in measured)) for v in versions],
        "figures": figures,
        "charts": charts,
    }


@router.get("/cohorts/{cohort_id}")
def cohort(request: Request, cohort_id: ObjectId, viewer: CurrentViewer, session: SessionDep) -> Response:
    """A cohort (the admin's, who creates them): its members now, and the distribution of their gains from
    personalizing the cohort's population adapter (``cohort_gains``)."""
    if not viewer.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this page is the admin's")
    found = session.get(Cohort, cohort_id)
    if found is None:
        raise not_found("cohort")
    model = session.get_one(Model, found.model_id)
    return page(request, "cohort.html", viewer, cohort=found, model=model, **cohort_gains(session, found))


# --- the admin ----------------------------------------------------------------------------------------------------


@router.get("/admin")
def admin(
    request: Request,
    viewer: CurrentViewer,
    session: SessionDep,
    settings: SettingsDep,
    skip: int = Query(0, ge=0, le=MAX_DB_INT),
    limit: int = Query(100, ge=1, le=500),
) -> Response:
    """The service's state, its users, cohorts (each linking to its page) and models, and every device (``limit``
    at a time, newest first), each with the jobs it holds and a button to revoke it."""
    if not viewer.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this page is the admin's")
    by_status = queries.jobs_by_status(session)
    devices, device_count = queries.all_devices(session, skip, limit)
    work = queries.device_work(session, [device.id for device, _ in devices])
    models = queries.models(session)
    model_names = {model.id: model.name for model in models}
    return page(
        request,
        "admin.html",
        viewer,
        users=queries.users(session),
        models=models,
        cohorts=[(cohort, model_names[cohort.model_id]) for cohort in queries.cohorts(session)],
        by_status=by_status,
        depth=by_status.get("queued", 0) + by_status.get("compiling", 0),
        leases=queries.active_leases(session),
        devices=[(device, owner, work.get(device.id, [])) for device, owner in devices],
        device_count=device_count,
        skip=skip,
        limit=limit,
        settings=settings,
    )
