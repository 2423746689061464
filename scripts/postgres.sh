#!/usr/bin/env bash
# Make sure the local PostgreSQL (127.0.0.1:5432, trust auth, database `test`) answers; start it if it is
# installed but stopped, install it from Debian's packages if absent. Prints the test database URL on success.
set -uo pipefail
URL="postgresql+psycopg://postgres@127.0.0.1:5432/test"
answers() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
if ! command -v pg_isready >/dev/null 2>&1; then
  echo "postgres: not installed; installing from Debian's packages" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2 || exit 1
fi
if ! answers; then
  echo "postgres: not answering; starting the local cluster" >&2
  for version in $(ls /etc/postgresql 2>/dev/null); do
    pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
  done
  for _ in $(seq 1 30); do answers && break; sleep 1; done
fi
answers || { echo "postgres: still not answering on 127.0.0.1:5432" >&2; exit 1; }
# trust auth and a `test` database, as on the project's machines; create them if this is a fresh install
if ! psql -h 127.0.0.1 -U postgres -d test -c 'select 1' >/dev/null 2>&1; then
  su postgres -c "psql -c \"ALTER USER postgres PASSWORD NULL\"" >/dev/null 2>&1 || true
  su postgres -c "createdb test" >/dev/null 2>&1 || true
fi
psql -h 127.0.0.1 -U postgres -d test -c 'select 1' >/dev/null 2>&1 || { echo "postgres: cannot connect as postgres to database test" >&2; exit 1; }
echo "$URL"
