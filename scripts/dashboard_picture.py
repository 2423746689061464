"""The dashboard's job page as a user sees it, as a PNG: sign in with an API key through the login form, open the
job, screenshot (headless Chromium, ``scripts/browser.sh``). ``scripts/demo.sh`` calls it for its SmolLM2 job when
``MOBIZO_DEMO_PICTURE`` names the file; the README's picture is made so.

    python scripts/dashboard_picture.py --server URL --job ID --out docs/images/dashboard-job.png  # MOBIZO_TOKEN
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.utils.browser import chromium  # noqa: E402  (the suite's headless Chromium: one home for its flags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="the server's URL")
    parser.add_argument("--job", required=True, type=int, help="the job to show")
    parser.add_argument("--out", required=True, type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    key = os.environ.get("MOBIZO_TOKEN")
    if not key:
        parser.error("MOBIZO_TOKEN: the user's API key signs in to the dashboard")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with chromium() as browser:
        browser.get(f"{args.server}/ui/login")
        browser.find_element(By.ID, "api-key").send_keys(key)
        browser.find_element(By.ID, "sign-in").click()
        WebDriverWait(browser, 30).until(lambda b: b.current_url.rstrip("/").endswith("/ui/jobs"))
        browser.get(f"{args.server}/ui/jobs/{args.job}")
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "job-status"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if not browser.get_screenshot_as_file(str(args.out)):
            raise SystemExit(f"{args.out}: the screenshot was not written")
    print(f"dashboard: job {args.job}'s page -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
