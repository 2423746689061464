#!/bin/sh
# A fresh PGDATA: initdb with POSTGRES_USER as the superuser (password auth over TCP) and POSTGRES_DB created;
# then run the command. An initialised PGDATA (a kept volume) is used as it is.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}" > "$pwfile"
  initdb -D "$PGDATA" -U "${POSTGRES_USER:-postgres}" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "${POSTGRES_DB:-postgres}" != postgres ]; then
    echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"${POSTGRES_USER:-postgres}\";" \
      | postgres --single -D "$PGDATA" postgres >/dev/null
  fi
fi
exec "$@"
