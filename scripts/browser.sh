#!/usr/bin/env bash
# Chromium and its WebDriver for the dashboard's browser tests (tests/device_agent/test_dashboard_e2e.py): Debian's
# packages chromium and chromium-driver, installed with apt when they are missing (as root, or through sudo). Nothing
# is downloaded at test time; the tests fail, not skip, when the browser is absent.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
echo "browser: installing Debian's chromium and chromium-driver for the browser tests (apt)"
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null \
  || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }
echo "browser: $(chromium --version)"
