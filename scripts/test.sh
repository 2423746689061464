#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: install, build the native runner, check PostgreSQL, run pytest.
# The suite always runs on SQLite; the server tests also run on PostgreSQL when it answers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
if [ -f device_agent/runner/build.sh ]; then
  echo "test: building the native runner"
  bash device_agent/runner/build.sh >/dev/null
fi
if url=$(bash scripts/postgres.sh); then
  export MOBIZO_TEST_DATABASE_URL="$url"
  echo "test: PostgreSQL answers; server tests run on SQLite and on $url"
else
  echo "test: PostgreSQL unavailable; server tests run on SQLite only" >&2
fi
python -m pytest -q -p no:cacheprovider "$@"
