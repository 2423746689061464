#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: install, build the native runner (for this machine and, cross, for
# aarch64), check PostgreSQL, run pytest.
# Extra arguments go to pytest: bash scripts/test.sh -m "not slow" (the quick loop), or a path.
# The suite always runs on SQLite; the server tests also run on PostgreSQL when it answers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
if [ -f device_agent/runner/build.sh ]; then
  echo "test: building the native runner"
  bash device_agent/runner/build.sh >/dev/null
  bash scripts/aarch64.sh  # the cross compiler and qemu-user for the aarch64 device tests
  echo "test: cross-building the native runner for aarch64"
  bash device_agent/runner/build.sh --aarch64 >/dev/null
fi
bash scripts/browser.sh  # Chromium and chromedriver for the dashboard's browser tests
if url=$(bash scripts/postgres.sh); then
  export MOBIZO_TEST_DATABASE_URL="$url"
  echo "test: PostgreSQL answers; server tests run on SQLite and on $url"
else
  echo "test: PostgreSQL unavailable; server tests run on SQLite only" >&2
fi
# Two pytest-xdist workers (MOBIZO_TEST_WORKERS=0: none), each test module on one worker: its module fixtures (a
# live server, a trained adapter) are built once. Exported programs are shared through .cache/test-programs.
# One torch thread per process while two workers share the two cores: four spinning OpenMP threads on two cores
# were slower (the numerics tests, -n 2: 74, 110 and 79 s with torch's default threads; 69 and 67 s with one).
if [ "${MOBIZO_TEST_WORKERS:-2}" != 0 ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
python -m pytest -q -p no:cacheprovider -n "${MOBIZO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
