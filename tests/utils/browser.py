"""A real Chromium for the tests that look at pages as a user does (the dashboard, the documentation site):
headless, driven through chromedriver. ``scripts/browser.sh`` installs both."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def chromium(*flags: str) -> Iterator:
    """A headless Chromium (selenium's ``webdriver.Chrome``) with ``flags`` beside the suite's own, quit after."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, "Chromium is not installed: scripts/browser.sh installs it"
    options = Options()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,1250", *flags):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    browser.set_page_load_timeout(60)
    try:
        yield browser
    finally:
        browser.quit()
