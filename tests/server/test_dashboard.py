"""The dashboard (``/ui``) and the metrics (``/metrics``) in process, on SQLite and PostgreSQL: sign-in and its
cookie, CSRF on every form, the REST API's tenant scoping, the curves' SVG, the admin's pages, and the metrics'
access and series. A real browser drives the pages in ``tests/device_agent/test_dashboard_e2e.py``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.dashboard.charts import Node, Series, line_chart, lineage_chart, nice_ticks, strip_chart
from server.dashboard.pages import quartiles
from tests.server.factories import (
    ADMIN,
    ADMIN_TOKEN,
    b_flat_bytes,
    create_user,
    enroll_device,
    fake_training,
    leased_job,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def browser(client: TestClient) -> TestClient:
    """The app over HTTPS (the session cookie is ``Secure``: httpx, like a browser, sends it over HTTPS only)."""
    client.base_url = client.base_url.copy_with(scheme="https")
    client.follow_redirects = False
    return client


def sign_in(client: TestClient, key: str) -> str:
    """Signs the client in with ``key`` → the CSRF token of its pages."""
    form = client.get("/ui/login")
    token = CSRF.search(form.text).group(1)
    answer = client.post("/ui/login", data={"api_key": key, "csrf_token": token})
    assert answer.status_code == 303 and answer.headers["location"] == "/ui/jobs", answer.text
    return CSRF.search(client.get("/ui/jobs").text).group(1)


def key_of(headers: dict[str, str]) -> str:
    return headers["Authorization"].split()[1]


def test_a_sign_in_cookie_and_token_of_another_sites_choosing_do_not_sign_in(client: TestClient) -> None:
    """Login CSRF by cookie tossing: a page of another site (a sibling subdomain, or a man in the middle of plain
    HTTP) sets the sign-in cookie to a value of its choosing and posts the same value as the form's token with its
    own key. The token is the server's HMAC of the cookie, so the pair matches nothing; and a form the browser says
    another site sent is refused even with a pair the server gave out."""
    client = browser(client)
    mallory = create_user(client, "mallory")
    for tossed in ("tossed-by-a-sibling", CSRF.search(client.get("/ui/login").text).group(1)):
        client.cookies.delete("mobizo_sign_in")
        client.cookies.set("mobizo_sign_in", tossed, domain="testserver", path="/ui")
        forged = client.post("/ui/login", data={"api_key": key_of(mallory), "csrf_token": tossed})
        assert forged.status_code == 403 and "CSRF" in forged.text, forged.text
        assert "mobizo_session" not in client.cookies
    form = client.get("/ui/login")  # a pair the server gave this browser, in a form another site posted
    token = CSRF.search(form.text).group(1)
    for site in ("cross-site", "same-site"):
        sent = client.post(
            "/ui/login", data={"api_key": key_of(mallory), "csrf_token": token}, headers={"Sec-Fetch-Site": site}
        )
        assert sent.status_code == 403 and "another site" in sent.text and "mobizo_session" not in client.cookies
    signed_in = client.post(
        "/ui/login", data={"api_key": key_of(mallory), "csrf_token": token}, headers={"Sec-Fetch-Site": "same-origin"}
    )
    assert signed_in.status_code == 303 and "mobizo_session" in client.cookies


def test_pages_need_a_session_and_sign_in_takes_a_real_key_and_the_form_token(client: TestClient) -> None:
    client = browser(client)
    alice = create_user(client)
    assert client.get("/ui/jobs").headers["location"] == "/ui/login"
    form = client.get("/ui/login")
    assert form.status_code == 200 and "default-src 'none'" in form.headers["content-security-policy"]
    token = CSRF.search(form.text).group(1)
    wrong = client.post("/ui/login", data={"api_key": key_of(alice)[:-2] + "xx", "csrf_token": token})
    assert wrong.status_code == 401 and "not a valid API key" in wrong.text
    token = CSRF.search(wrong.text).group(1)  # a failed sign-in gives a new form
    client.cookies.delete("mobizo_sign_in")  # a page of another site can post the form, not set our cookie
    forged = client.post("/ui/login", data={"api_key": key_of(alice), "csrf_token": token})
    assert forged.status_code == 403 and "CSRF" in forged.text
    assert "mobizo_session" not in client.cookies

    form = client.get("/ui/login")
    answer = client.post("/ui/login", data={"api_key": key_of(alice), "csrf_token": CSRF.search(form.text).group(1)})
    assert answer.status_code == 303
    cookie = answer.headers["set-cookie"].lower()
    assert "mobizo_session=" in cookie
    assert all(flag in cookie for flag in ("httponly", "secure", "samesite=strict", "path=/ui"))
    page = client.get("/ui/jobs")
    assert page.status_code == 200 and "alice" in page.text and "No jobs yet" in page.text


def test_a_user_sees_only_their_own_jobs_devices_and_adapters(client: TestClient, tmp_path: Path) -> None:
    client = browser(client)
    work = leased_job(client, tmp_path / "model")
    bob = create_user(client, "bob")
    bobs_phone = enroll_device(client, bob, "bobs-phone")
    bobs_job = submit_job(client, bob)
    ok = upload(client, work["phone"], work["job"]["id"], b_flat_bytes(work["b"]), work["log"])
    assert ok.status_code == 201, ok.text
    alices_adapter = ok.json()["adapter_id"]

    csrf = sign_in(client, key_of(bob))
    listed = client.get("/ui/jobs").text
    assert f'href="/ui/jobs/{bobs_job["id"]}"' in listed and f'href="/ui/jobs/{work["job"]["id"]}"' not in listed
    for path in (
        f"/ui/jobs/{work['job']['id']}",
        f"/ui/adapters/{alices_adapter}",
        f"/ui/adapters/{alices_adapter}/download",
    ):
        refused = client.get(path)
        assert refused.status_code == 404 and "not found" in refused.text, path
    for path in (f"/ui/jobs/{work['job']['id']}/cancel", f"/ui/devices/{work['phone']['id']}/revoke"):
        assert client.post(path, data={"csrf_token": csrf}).status_code == 404, path
    assert client.get(f"/v1/jobs/{work['job']['id']}", headers=work["user"]).json()["status"] == "succeeded"
    devices = client.get("/ui/devices").text
    assert f"#{bobs_phone['id']} bobs-phone" in devices and f"#{work['phone']['id']} phone" not in devices
    assert "not reported" in devices  # enrolled without a CPU report
    cpu = {"arch": "aarch64", "features": ["asimd", "dotprod", "i8mm", "sme"]}
    assert client.post("/v1/leases", json={"cpu": cpu}, headers=bobs_phone["headers"]).status_code in (200, 204)
    assert 'aarch64 <span class="muted">asimd dotprod i8mm sme</span>' in client.get("/ui/devices").text
    assert "No adapters yet" in client.get("/ui/adapters").text  # alice's adapter is hers
    assert client.get("/ui/admin").status_code == 403  # the admin's page


def test_every_form_needs_the_sessions_csrf_token(client: TestClient, tmp_path: Path) -> None:
    client = browser(client)
    register_model(client, make_fake_model(tmp_path / "model"))
    alice = create_user(client)
    job = submit_job(client, alice)
    csrf = sign_in(client, key_of(alice))
    for sent in ({}, {"csrf_token": ""}, {"csrf_token": csrf[:-1] + ("A" if csrf[-1] != "A" else "B")}):
        refused = client.post(f"/ui/jobs/{job['id']}/cancel", data=sent)
        assert refused.status_code == 403 and "CSRF" in refused.text
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json()["status"] != "cancelled"
    assert client.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf_token": csrf}).status_code == 303
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json()["status"] == "cancelled"
    assert client.post("/ui/logout", data={}).status_code == 403  # signing out too


def test_signing_out_ends_the_session_for_every_copy_of_the_cookie(client: TestClient) -> None:
    client = browser(client)
    alice = create_user(client)
    csrf = sign_in(client, key_of(alice))
    copy = client.cookies.get("mobizo_session")
    out = client.post("/ui/logout", data={"csrf_token": csrf})
    assert out.status_code == 303 and out.headers["location"] == "/ui/login"
    assert "mobizo_session" not in client.cookies  # the browser forgot it; a copy made before is refused
    client.cookies.set("mobizo_session", copy)
    assert client.get("/ui/jobs").headers["location"] == "/ui/login"


def test_a_finished_jobs_page_draws_one_point_per_logged_step(client: TestClient, tmp_path: Path) -> None:
    client = browser(client)
    work = leased_job(client, tmp_path / "model", steps=7)
    losses = [json.loads(line)["losses"] for line in work["log"].splitlines()]
    mean = [sum(step) / len(step) for step in losses]
    metrics = json.dumps({"steps": 7, "losses": mean}).encode()
    assert upload(client, work["phone"], work["job"]["id"], b_flat_bytes(work["b"]), work["log"], metrics).is_success
    sign_in(client, key_of(work["user"]))
    page = client.get(f"/ui/jobs/{work['job']['id']}").text
    curve = re.search(
        r'<polyline class="series" data-series="training loss" data-points="(\d+)" points="([^"]+)"', page
    )
    assert curve is not None and int(curve.group(1)) == 7 and len(curve.group(2).split()) == 7
    ys = [float(p.split(",")[1]) for p in curve.group(2).split()]
    assert ys.index(max(ys)) == mean.index(min(mean))  # SVG's y grows downwards: the lowest loss is drawn highest


def test_the_admin_sees_users_models_and_the_queue(client: TestClient, tmp_path: Path) -> None:
    client = browser(client)
    leased_job(client, tmp_path / "model")
    sign_in(client, ADMIN_TOKEN)
    page = client.get("/ui/admin")
    assert page.status_code == 200
    assert "alice" in page.text and "tiny" in page.text and "0 jobs queued or compiling" in page.text
    assert "1 job," in page.text  # one lease held
    assert client.get("/ui/devices").status_code == 403


def test_metrics_are_the_admins_and_count_what_happened(client: TestClient, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    work = leased_job(client, tmp_path / "model")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=work["user"]).status_code == 403

    def scrape() -> dict[tuple[str, tuple], float]:
        text = client.get("/metrics", headers=ADMIN).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = scrape()
    assert before[("mobizo_jobs", (("status", "running"),))] == 1
    assert before[("mobizo_active_leases", (("kind", "job"),))] == 1
    refused = upload(client, work["phone"], work["job"]["id"], b"not safetensors", work["log"])
    assert refused.status_code == 422
    assert upload(client, work["phone"], work["job"]["id"], b_flat_bytes(work["b"]), work["log"]).status_code == 201
    after = scrape()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert after[("mobizo_jobs", (("status", "succeeded"),))] == 1
    assert after[("mobizo_active_leases", (("kind", "job"),))] == 0
    assert grew("mobizo_uploads_total", kind="job", outcome="accepted") == 1
    assert grew("mobizo_uploads_total", kind="job", outcome="invalid_or_not_replayed") == 1
    assert grew("mobizo_verify_duration_seconds_count") == 1  # the refused one never reached a replay
    route = "/v1/work/{work}/result"
    assert grew("mobizo_http_requests_total", method="POST", route=route, status="201") == 1


def test_charts_escape_their_text_and_span_the_data() -> None:
    for low, high in ((0.12, 0.97), (3.2, 1771.0), (-0.004, 0.013)):
        ticks = nice_ticks(low, high)
        steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
        assert ticks[0] <= low and ticks[-1] >= high and 2 <= len(ticks) <= 6 and len(steps) == 1
        mantissa = steps.pop() / 10 ** math.floor(math.log10(ticks[1] - ticks[0]))
        assert round(mantissa, 9) in (1, 2, 5)
    ticks = nice_ticks(3.0, 3.0)
    assert ticks[0] <= 3.0 <= ticks[-1] and len(ticks) >= 2
    svg = line_chart([Series("<b>", [(1, 2.0), (2, float("nan")), (3, 1.0)])], "a & b", "step", "loss")
    assert "<b>" not in svg and "&lt;b&gt;" in svg and "a &amp; b" in svg
    assert 'data-points="2"' in svg  # a non-finite value is not drawn
    assert "nothing measured" in line_chart([Series("x", [])], "t", "x", "y")
    graph = lineage_chart([Node(1, "v1", None), Node(2, "v2", 1), Node(3, "v3", 1)])
    assert re.findall(r'data-from="(\d+)" data-to="(\d+)"', graph) == [("1", "2"), ("1", "3")]


def test_a_strip_chart_stacks_close_values_and_marks_the_quartiles() -> None:
    import numpy as np

    values = [0.3, -0.2, 0.3, 0.3, 1.7, float("nan")]
    for sample in (values[:5], [0.4], [1.0, 2.0]):  # as numpy's default percentiles (linear interpolation)
        assert quartiles(sorted(sample)) == pytest.approx(tuple(np.percentile(sample, [25, 50, 75])))
    svg = strip_chart(values, "<gains>", "loss", quartiles(sorted(values[:5])))
    assert "<gains>" not in svg and "&lt;gains&gt;" in svg
    dots = re.findall(r'<circle class="point" data-value="([^"]+)" cx="([^"]+)" cy="([^"]+)"', svg)
    assert len(dots) == 5  # the non-finite value is not drawn
    equal = [(float(cx), float(cy)) for value, cx, cy in dots if value == "0.3"]
    assert len({cx for cx, _ in equal}) == 1 and len({cy for _, cy in equal}) == 3  # stacked, not drawn over
    assert re.search(r'class="median" data-value="0.3"', svg)
    assert re.search(r'class="reference" data-value="0"', svg)  # the no-change line
    assert "nothing measured" in strip_chart([], "t", "x")


def test_the_metrics_port_serves_them_without_a_token(settings, queue) -> None:
    import httpx

    from server.app import create_app
    from tests.server.live import free_port

    port = free_port()
    app = create_app(settings.model_copy(update={"metrics_port": port}), queue_factory=queue.bind)
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 401  # the API's route still wants the admin token
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert scraped.status_code == 200 and 'mobizo_jobs{status="queued"} 0.0' in scraped.text
    with pytest.raises(httpx.ConnectError):  # closed with the app
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_standing_job_s_page_shows_its_held_out_figures_session_by_session(client: TestClient, tmp_path: Path):
    """Two sessions of a standing job, uploaded as a device would: the first lowers its held-out loss (promoted),
    the second raises it (kept, not promoted); the page charts before and after by session and tables each
    session's version and whether it was promoted; the standing job's adapter is the promoted one."""
    from safetensors.numpy import load

    client = browser(client)
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    phone = enroll_device(client, user)
    standing = submit_job(client, user, standing=True, sessions=2)["id"]
    figures = [(2.0, 1.5), (1.5, 1.75)]  # held-out loss (before, after) of each session
    for seed, (before, after) in enumerate(figures, start=1):
        lease = client.post("/v1/leases", headers=phone["headers"]).json()
        start = (
            None if lease["init"] is None else load(client.get(lease["init"]["url"], headers=phone["headers"]).content)
        )
        b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"], init=start and start["b_flat"], seed=seed)
        evals = [{"step": 0, "loss": before, "n": 4}, {"step": 3, "loss": after, "n": 4}]
        metrics = json.dumps({"steps": 3, "eval": evals}).encode()
        assert upload(client, phone, lease["job_id"], b_flat_bytes(b), log, metrics).status_code == 201
    shown = client.get(f"/v1/jobs/{standing}", headers=user).json()
    assert shown["status"] == "succeeded" and shown["sessions_run"] == 2
    adapters = client.get("/v1/adapters", headers=user).json()["data"][::-1]  # oldest first
    assert [a["promoted"] for a in adapters] == [True, False] and shown["adapter_id"] == adapters[0]["id"]
    assert adapters[1]["parent_adapter_id"] == adapters[0]["id"]  # the second session started from the promoted
    sign_in(client, key_of(user))
    page = client.get(f"/ui/jobs/{standing}").text
    assert re.findall(r'<td class="promoted">(\w+)</td>', page) == ["yes", "no"]
    for series in ("before (the version it started from)", "after (the new version)"):
        curve = re.search(rf'data-series="{re.escape(series)}" data-points="(\d+)" points="([^"]+)"', page)
        assert curve is not None and int(curve.group(1)) == 2
    after = re.search(r'data-series="after \(the new version\)" data-points="2" points="([^"]+)"', page)
    ys = [float(p.split(",")[1]) for p in after.group(1).split()]
    assert ys[0] > ys[1]  # SVG's y grows downwards: the second session's higher loss is drawn lower


def _personalize(client: TestClient, device: dict, before: float, after: float, seed: int) -> dict:
    """The device leases its user's next work (a job, or a standing job's session), trains from the B the lease
    starts from and uploads with held-out figures ``before`` → ``after`` as an lm task's device measures them (the
    loss per token; the server sets the perplexity from it) → the lease."""
    from safetensors.numpy import load

    lease = client.post("/v1/leases", headers=device["headers"]).json()
    start = load(client.get(lease["init"]["url"], headers=device["headers"]).content)["b_flat"]
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"], init=start, seed=seed)
    evals = [{"step": 0, "loss": before, "n": 8, "perplexity": 0}, {"step": 3, "loss": after, "n": 8, "perplexity": 0}]
    metrics = json.dumps({"steps": 3, "eval": evals}).encode()
    assert upload(client, device, lease["job_id"], b_flat_bytes(b), log, metrics).status_code == 201
    return lease


def test_a_cohorts_page_shows_its_members_gains_from_personalizing_as_a_distribution(
    client: TestClient, tmp_path: Path
):
    """A cohort's population adapter (one round), then its members' adapters trained from it, uploaded as devices
    would: a personal job (twice: the latest counts), another, a standing job's session; not counted: a member's
    job from no starting adapter, and a member who trained from it and then left. The admin's page draws the
    gains (held-out loss, and perplexity, before − after) as dots with the quartile box and tables the median,
    quartiles and share improved, naming no member; a user gets the admin's 403, an unknown cohort a 404; before
    any member's adapter the page says there is none."""
    from tests.server.test_federation import report, rounds, wait_for

    client = browser(client)
    register_model(client, make_fake_model(tmp_path / "model"))
    names = ("member-ann", "member-ben", "member-cy", "member-dee", "member-eve", "outsider-nia")
    users = {name: create_user(client, name) for name in names}
    devices = {name: enroll_device(client, key, f"phone-of-{name}") for name, key in users.items()}
    created = client.post("/v1/cohorts", json={"name": "keyboard", "model": "tiny", "task": "sst2"}, headers=ADMIN)
    cohort = created.json()["id"]
    for name in names[:5]:
        assert client.post(f"/v1/cohorts/{cohort}/join", headers=users[name]).status_code == 200
    world = {"users": users, "devices": devices, "cohort": cohort}
    federated = {"q": 2, "batch_size": 4, "steps": 3, "rank": 2, "rounds": 1, "clients_per_round": 1}
    job = client.post(f"/v1/cohorts/{cohort}/jobs", json=federated, headers=ADMIN).json()
    part = client.post("/v1/leases", json={"eligible": True}, headers=devices["member-ann"]["headers"]).json()
    assert report(client, world, "member-ann", part, 0)[0].status_code == 201
    population = wait_for(lambda: rounds(client, job["id"])[0]["adapter_id"], 60, "the round to close")

    admin = sign_in(client, ADMIN_TOKEN)
    empty = client.get(f"/ui/cohorts/{cohort}")
    assert empty.status_code == 200 and 'id="no-gains"' in empty.text and "<svg" not in empty.text
    assert f'href="/ui/cohorts/{cohort}"' in client.get("/ui/admin").text
    assert f'href="/ui/cohorts/{cohort}"' in client.get(f"/ui/jobs/{job['id']}").text
    client.post("/ui/logout", data={"csrf_token": admin})

    start = {"init_adapter_id": population}
    submit_job(client, users["member-ann"], **start)
    _personalize(client, devices["member-ann"], 2.0, 1.0, seed=1)  # replaced by her next one
    submit_job(client, users["member-ann"], **start)
    _personalize(client, devices["member-ann"], 2.0, 1.5, seed=2)  # gain 0.5
    submit_job(client, users["member-ben"], **start)
    _personalize(client, devices["member-ben"], 2.0, 1.8, seed=3)  # gain 0.2
    submit_job(client, users["member-cy"], standing=True, sessions=1, **start)
    _personalize(client, devices["member-cy"], 1.6, 1.7, seed=4)  # gain -0.1: worse, not promoted
    submit_job(client, users["member-dee"])  # her own adapter, from no cohort version: not counted
    lease = client.post("/v1/leases", headers=devices["member-dee"]["headers"]).json()
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    evals = json.dumps({"steps": 3, "eval": [{"step": 0, "loss": 9.0}, {"step": 3, "loss": 1.0}]}).encode()
    assert upload(client, devices["member-dee"], lease["job_id"], b_flat_bytes(b), log, evals).status_code == 201
    submit_job(client, users["member-eve"], **start)
    _personalize(client, devices["member-eve"], 5.0, 1.0, seed=5)  # then she leaves: not counted
    assert client.post(f"/v1/cohorts/{cohort}/leave", headers=users["member-eve"]).status_code == 200

    sign_in(client, key_of(users["member-ann"]))
    assert client.get(f"/ui/cohorts/{cohort}").status_code == 403  # a member too: the admin's page
    client.post("/ui/logout", data={"csrf_token": CSRF.search(client.get("/ui/jobs").text).group(1)})

    sign_in(client, ADMIN_TOKEN)
    assert client.get("/ui/cohorts/999").status_code == 404
    page = client.get(f"/ui/cohorts/{cohort}").text
    assert not any(name in page for name in names)  # no member is named
    assert re.search(r'id="members">4 now', page)
    charts = page.split('<svg class="chart strip"')[1:]
    assert len(charts) == 2  # loss and perplexity
    loss, perplexity = charts
    points = sorted(float(v) for v in re.findall(r'<circle class="point" data-value="([^"]+)"', loss))
    assert points == pytest.approx([-0.1, 0.2, 0.5])
    assert float(re.search(r'class="median" data-value="([^"]+)"', loss).group(1)) == pytest.approx(0.2)
    box = re.search(r'class="quartiles" data-low="([^"]+)" data-high="([^"]+)"', loss)
    assert (float(box.group(1)), float(box.group(2))) == pytest.approx((0.05, 0.35))  # inclusive: numpy's default
    xs = [float(x) for x in re.findall(r'<circle class="point" data-value="[^"]+" cx="([^"]+)"', loss)]
    zero = float(re.search(r'class="reference" data-value="0" x1="([^"]+)"', loss).group(1))
    assert sorted(x > zero for x in xs) == [False, True, True]  # right of the no-change line: improved
    ppl = sorted(float(v) for v in re.findall(r'<circle class="point" data-value="([^"]+)"', perplexity))
    expected = sorted(math.exp(b) - math.exp(a) for b, a in ((2.0, 1.5), (2.0, 1.8), (1.6, 1.7)))
    assert ppl == pytest.approx(expected, rel=1e-3)
    row = re.search(
        r'data-figure="loss"><td>loss</td><td>3</td><td class="q1">([^<]+)</td>'
        r'<td class="median">([^<]+)</td><td class="q3">([^<]+)</td>',
        page,
    )
    assert [float(v) for v in row.groups()] == pytest.approx([0.05, 0.2, 0.35])
    assert "2 of 3 members (67%)" in page and "cohort v1 (3 members)" in page
