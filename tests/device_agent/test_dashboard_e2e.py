"""The dashboard in a real browser (Debian's Chromium, headless, driven by Selenium through chromedriver) and the
metrics scraped, against a ``mobizo server`` process of this module's own on loopback, after a real job: a
device agent trained it on the tiny model with held-out measurements every 8 steps.

``scripts/test.sh`` installs Chromium when it is missing (``scripts/browser.sh``); without it these tests fail,
they are not skipped. The job page's screenshot is written to ``build/test-artifacts`` (or
``$MOBIZO_TEST_ARTIFACTS``)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.device_agent.stack import Stack, make_agent, ok, server_env
from tests.server import live
from tests.server.factories import ADMIN_TOKEN, bearer
from tests.utils.browser import chromium

STEPS, EVAL_EVERY = 20, 8
ARTIFACTS = Path(os.environ.get("MOBIZO_TEST_ARTIFACTS", live.REPO / "build" / "test-artifacts"))


@pytest.fixture(scope="module")
def finished(artifacts: Path, tiny_model_dir: Path, local_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """A fresh server (its metrics count this module's work only) where alice's device ran one job to the end and
    bob submitted one that nobody ran → (stack as alice, alice's job, bob's job)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    with live.server_process(server_env(artifacts, tmp / "db.sqlite"), tmp / "server.log") as url:
        alice = Stack(url, artifacts, tmp, tiny_model_dir)
        job_id = alice.submit(steps=STEPS, eval_examples=10, eval_every=EVAL_EVERY)
        agent = make_agent(alice, local_data, "dashboard")
        assert agent.start().wait() == 0, agent.tail()
        assert alice.job(job_id)["status"] == "succeeded"
        bob = Stack(url, artifacts, tmp, tiny_model_dir)
        bobs_job = bob.submit(steps=STEPS)
        yield alice, job_id, bobs_job


@pytest.fixture(scope="module")
def chrome() -> Iterator:
    with chromium() as browser:
        yield browser


def _wait_for(browser, url: str, prefix: bool = False) -> None:
    """Until the browser shows ``url`` (a click returns before the next page has loaded)."""
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    condition = expected_conditions.url_contains(url) if prefix else expected_conditions.url_to_be(url)
    WebDriverWait(browser, 30).until(condition)
    WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")


def _text(browser, css: str) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, css).text


def test_sign_in_see_the_curves_be_refused_elsewhere_and_sign_out(finished, chrome) -> None:
    from selenium.webdriver.common.by import By

    stack, job_id, bobs_job = finished
    key = stack.user.headers["authorization"].split()[1]
    chrome.get(f"{stack.url}/ui/jobs/{job_id}")
    assert chrome.current_url == f"{stack.url}/ui/login"  # no session: the sign-in form
    chrome.find_element(By.ID, "api-key").send_keys(key)
    chrome.find_element(By.ID, "sign-in").click()
    _wait_for(chrome, f"{stack.url}/ui/jobs")
    assert _text(chrome, "#who").startswith("user-")
    cookie = chrome.get_cookie("mobizo_session")
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"

    chrome.find_element(By.LINK_TEXT, f"#{job_id}").click()
    _wait_for(chrome, f"{stack.url}/ui/jobs/{job_id}")
    assert _text(chrome, "#job-status") == "succeeded"
    training = chrome.find_element(By.CSS_SELECTOR, '#training-curve polyline[data-series="training loss"]')
    losses = stack.adapter(job_id)["metrics"]["losses"]
    assert len(training.get_attribute("points").split()) == len(losses) == STEPS  # a vertex per logged step
    curve = stack.job(job_id)["held_out"]["curve"]
    for name in ("accuracy", "loss"):
        held_out = chrome.find_element(By.CSS_SELECTOR, f'.held-out polyline[data-series="held-out {name}"]')
        assert len(held_out.get_attribute("points").split()) == len(curve) == 4  # steps 0, 8, 16, 20
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-job.png"
    assert chrome.get_screenshot_as_file(str(shot)) and shot.stat().st_size > 10_000

    chrome.get(f"{stack.url}/ui/jobs/{bobs_job}")  # another tenant's job: as if it did not exist
    assert _text(chrome, "#error-code") == "404" and "not found" in _text(chrome, "#error-detail")

    chrome.get(f"{stack.url}/ui/devices")
    assert "test-executorch" in _text(chrome, "#devices") and "enrolled" in _text(chrome, "#devices")
    chrome.get(f"{stack.url}/ui/adapters")
    assert re.search(r"v1", _text(chrome, "main")) and chrome.find_elements(By.CSS_SELECTOR, "svg.lineage circle")

    # a form without its CSRF token (as another site's page would post it) is refused, and changes nothing
    chrome.get(f"{stack.url}/ui/devices")
    chrome.execute_script("document.querySelector('form.inline input[name=csrf_token]').remove()")
    chrome.find_element(By.CSS_SELECTOR, "form.inline button").click()
    _wait_for(chrome, f"{stack.url}/ui/devices/", prefix=True)
    assert _text(chrome, "#error-code") == "403" and "CSRF" in _text(chrome, "#error-detail")
    assert all(d["revoked_at"] is None for d in ok(stack.user.get("/v1/devices"))["data"])

    chrome.get(f"{stack.url}/ui/jobs")
    chrome.find_element(By.ID, "sign-out").click()
    _wait_for(chrome, f"{stack.url}/ui/login")
    assert chrome.get_cookie("mobizo_session") is None
    chrome.get(f"{stack.url}/ui/jobs")
    assert chrome.current_url == f"{stack.url}/ui/login"


def test_metrics_count_the_job_its_lease_upload_and_verification(finished) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    stack, job_id, _ = finished
    assert httpx.get(f"{stack.url}/metrics").status_code == 401
    text = httpx.get(f"{stack.url}/metrics", headers=bearer(ADMIN_TOKEN)).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("mobizo_jobs", (("status", "succeeded"),))] == 1
    assert samples[("mobizo_jobs", (("status", "ready"),))] == 1  # bob's, never leased
    assert samples[("mobizo_compile_queue_depth", ())] == 0
    assert samples[("mobizo_active_leases", (("kind", "job"),))] == 0
    assert samples[("mobizo_leases_total", (("kind", "job"),))] == 1
    assert samples[("mobizo_uploads_total", (("kind", "job"), ("outcome", "accepted")))] == 1
    assert samples[("mobizo_verify_duration_seconds_count", ())] == 1
    assert samples[("mobizo_export_duration_seconds_count", (("outcome", "built"),))] == 2  # alice's and bob's
    assert samples[("mobizo_heartbeats_total", (("kind", "job"),))] >= 1
    route = (("method", "POST"), ("route", "/v1/work/{work}/result"), ("status", "201"))
    assert samples[("mobizo_http_requests_total", route)] == 1
