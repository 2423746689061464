#!/usr/bin/env bash
# docker-compose.yml on a Debian host that cannot pull from Docker Hub: the engine from Debian's packages, the
# images built on a Debian bookworm root of our own (debootstrap), the stack on the host's network with
# docker-compose.local.yml (every service on loopback, on ports of its own).
#
#   compose.sh images     the engine, the base root and the images (mobizo, mobizo-postgres, mobizo-redis)
#   compose.sh up         the images, then db, redis, server and worker up; waits for the server's /healthz
#   compose.sh demo       one job through the stack, each step timed: a tiny model registered, a user, the
#                         containerized agent enrolled, a job compiled by a worker, trained by the agent, verified,
#                         its adapter downloaded; then 3 workers and a second job compiled on another one; then
#                         down and up again, the jobs, adapters and artifacts kept (volumes)
#   compose.sh key        the images' cache key (their tag), building nothing
#   compose.sh cached     exit 0 when the engine answers and the images of this key are built (the test's gate)
#   compose.sh ARGS...    docker compose with both files and the project: `compose.sh ps`, `compose.sh down -v`
#
# Cached, keyed by their inputs (MOBIZO_COMPOSE_CACHE, default /var/cache/mobizo/compose):
#   root-<key>/    the Debian root (suite, mirror, packages; Python 3.11 in a venv at /usr/local, as in
#                  python:3.11-slim), imported as the image mobizo-base:<key>
#   wheels-<key>/  the wheels of mobizo[all] (pyproject.toml and pip's configuration), served to the build on
#                  loopback: the build installs from them alone (PIP_NO_INDEX), so the index pip is configured
#                  with here (PyPI, a local mirror, find-links) is the one the image gets
#   the images mobizo:<key>, mobizo-postgres:<key>, mobizo-redis:<key> (the Dockerfiles, pyproject.toml, the base
#   root's key), also tagged :local for docker-compose.local.yml. The project's code is a layer of its own on top
#   of the dependencies: every `images` run rebuilds that layer from this checkout (under a minute).
# Settings: MOBIZO_COMPOSE_PROJECT (mobizo), MOBIZO_COMPOSE_API_PORT (18000), MOBIZO_COMPOSE_DB_PORT (15432),
# MOBIZO_COMPOSE_REDIS_PORT (16379), MOBIZO_COMPOSE_WHEELS_PORT (18081, the wheelhouse during a build),
# MOBIZO_COMPOSE_DIR (runs/compose: the demo's models and downloads), MOBIZO_ADMIN_TOKEN (when unset: made once per
# project and kept, mode 0600, in the cache as admin-token-<project>).
#
# Compose: `docker compose` (v2) when the engine has the plugin, else Debian bookworm's docker-compose 1.29 (the
# Python v1, the only compose Debian 12 packages; it reads the Compose Specification, profiles included).
# Needs root (apt-get, dockerd, debootstrap). dockerd is started without a bridge or iptables rules (everything
# here runs on the host's network), its log in $cache/dockerd.log.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
cache="${MOBIZO_COMPOSE_CACHE:-/var/cache/mobizo/compose}"
suite=bookworm
mirror="${MOBIZO_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
packages=python3,python3-venv,ca-certificates
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
export COMPOSE_PROJECT_NAME="${MOBIZO_COMPOSE_PROJECT:-mobizo}"
export MOBIZO_COMPOSE_API_PORT="${MOBIZO_COMPOSE_API_PORT:-18000}"
export MOBIZO_COMPOSE_DB_PORT="${MOBIZO_COMPOSE_DB_PORT:-15432}"
export MOBIZO_COMPOSE_REDIS_PORT="${MOBIZO_COMPOSE_REDIS_PORT:-16379}"
wheels_port="${MOBIZO_COMPOSE_WHEELS_PORT:-18081}"
say() { echo "compose: $*" >&2; }
key_of() { sha256sum | cut -c1-16; }

# ---- the engine ------------------------------------------------------------------------------------------------
engine() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
    missing+=(docker-compose)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || { say "needs root to install ${missing[*]}"; exit 1; }
    say "installing Debian's ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  fi
  start_engine || exit 1
}

start_engine() {  # dockerd in the background unless an engine answers (says why not on standard output)
  docker info >/dev/null 2>&1 && return 0
  command -v dockerd >/dev/null || { echo "no Docker engine (dockerd): scripts/compose.sh images installs it"; return 1; }
  [ "$(id -u)" = 0 ] || { echo "the Docker engine does not answer, and starting it needs root"; return 1; }
  say "starting dockerd (log: $cache/dockerd.log)"
  mkdir -p "$cache"
  setsid dockerd --iptables=false --ip-masq=false --bridge=none >"$cache/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "dockerd did not start: $(tail -3 "$cache/dockerd.log" | tr '\n' ' ')"
  return 1
}

compose() {
  local files=(-f docker-compose.yml -f docker-compose.local.yml) merged
  if docker compose version >/dev/null 2>&1; then
    docker compose "${files[@]}" "$@"  # v2 drops the published ports of a service on the host's network
  else
    # v1 refuses a published port on the host's network, and an override cannot remove docker-compose.yml's:
    # run the two files merged, less those ports (a file of this call's own, mode 0600: it holds the admin token)
    mkdir -p "$cache"
    merged=$(umask 077 && mktemp "$cache/.compose-$COMPOSE_PROJECT_NAME.XXXXXX")
    (docker-compose "${files[@]}" config | "$python" -c '
import sys, yaml
config = yaml.safe_load(sys.stdin)
for service in config["services"].values():
    if service.get("network_mode") == "host":
        service.pop("ports", None)
yaml.safe_dump(config, sys.stdout, sort_keys=False)' > "$merged") || { rm -f "$merged"; return 1; }
    local status=0
    docker-compose -f "$merged" --project-directory "$repo" "$@" || status=$?
    rm -f "$merged"
    return "$status"
  fi
}

# ---- the images ----------------------------------------------------------------------------------------------
base_key() { printf '%s\n' "$suite" "$mirror" "$packages" "minbase amd64 venv:/usr/local v1" | key_of; }
wheels_key() { { cat pyproject.toml; "$python" -m pip config list 2>/dev/null; "$python" -V; } | key_of; }
images_key() {
  { base_key; cat Dockerfile docker/postgres.Dockerfile docker/postgres-entrypoint.sh docker/redis.Dockerfile \
      pyproject.toml; } | key_of
}

base_image() {  # the Debian root, imported (printed: the image's tag)
  local key root tmp tag
  key=$(base_key)
  tag="mobizo-base:$key"
  if ! docker image inspect "$tag" >/dev/null 2>&1; then
    root="$cache/root-$key"
    if [ ! -x "$root/usr/local/bin/python" ]; then
      say "building the Debian $suite root ($packages) into $root (minutes, once)"
      mkdir -p "$cache"
      tmp="$(mktemp -d "$cache/.root.XXXXXX")"
      debootstrap --variant=minbase --include="$packages" "$suite" "$tmp" "$mirror" >"$tmp.log" 2>&1 \
        || { tail -20 "$tmp.log" >&2; rm -rf "$tmp"; exit 1; }
      chroot "$tmp" /usr/bin/python3 -m venv /usr/local >>"$tmp.log" 2>&1 \
        || { tail -20 "$tmp.log" >&2; rm -rf "$tmp"; exit 1; }
      rm -rf "$tmp.log" "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*
      mv "$tmp" "$root"
    fi
    say "importing $root as $tag"
    tar -C "$root" -c . | docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
  fi
  echo "$tag"
}

pip_setting() {  # pip_setting NAME: its value in pip's configuration here (environment first, then the files)
  "$python" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | head -1
}

wheelhouse() {  # the wheels of mobizo[all] for the image's Python (printed: the folder)
  local key dir part index=()
  key=$(wheels_key)
  dir="$cache/wheels-$key"
  part="$dir.partial"
  if [ ! -f "$dir/.complete" ]; then
    "$python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null \
      || { say "the wheels are built with $python, which must be Python 3.11 (the image's); set PYTHON"; exit 1; }
    if [ ! -f "$part/.host" ]; then
      say "downloading and building the wheels of mobizo[all] into $dir (minutes, once)"
      rm -rf "$part" && mkdir -p "$part"
      "$python" -m pip wheel --quiet -w "$part" ".[all]" "setuptools>=68" wheel >&2  # the project's wheel too
      rm -rf build ./*.egg-info
      touch "$part/.host"
    fi
    # What the image's Python needs beyond this one's (Debian's 3.11.2: redis wants async-timeout below 3.11.3),
    # from pip's index as configured here where it is a URL (else PyPI), trusting the certificates pip trusts here
    local url cert
    url=$(pip_setting index-url)
    case "$url" in http*) index+=(-e "PIP_INDEX_URL=$url") ;; esac
    cert=$(pip_setting cert)
    [ -f "$cert" ] && index+=(-v "$cert:/etc/ssl/certs/pip-cert.pem:ro" -e PIP_CERT=/etc/ssl/certs/pip-cert.pem)
    local project
    project=$(cd "$part" && ls mobizo-*.whl)
    docker run --rm --network host -v "$part:/wheels" ${index[@]+"${index[@]}"} "$1" \
      pip wheel --quiet --disable-pip-version-check --find-links /wheels -w /wheels \
      "mobizo[all] @ file:///wheels/$project" >&2
    rm -f "$part"/mobizo-*.whl "$part/.host"
    touch "$part/.complete"
    rm -rf "$dir" && mv "$part" "$dir"
  fi
  echo "$dir"
}

build() {  # build TAG KEY DOCKERFILE [ARGS...]: one image from this checkout, tagged :KEY and :local
  local name="$1" key="$2" file="$3"
  shift 3
  docker build --network host --force-rm -q -f "$file" -t "$name:$key" "$@" . >/dev/null
  docker tag "$name:$key" "$name:local"
}

images() {
  local base key wheels server status=0
  mkdir -p "$cache"
  base=$(base_image)
  key=$(images_key)
  say "building mobizo-postgres:$key and mobizo-redis:$key (Debian's postgresql-15 and redis-server)"
  build mobizo-postgres "$key" docker/postgres.Dockerfile --build-arg "BASE=$base"
  build mobizo-redis "$key" docker/redis.Dockerfile --build-arg "BASE=$base"
  wheels=$(wheelhouse "$base")
  say "building mobizo:$key (mobizo[all] from $wheels, this checkout's code)"
  "$python" -m http.server --bind 127.0.0.1 --directory "$wheels" "$wheels_port" >/dev/null 2>&1 &
  server=$!
  build mobizo "$key" Dockerfile --build-arg "BASE=$base" --build-arg "PIP_NO_INDEX=1" \
    --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$wheels_port/" || status=$?
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  [ "$status" = 0 ] || exit "$status"
  docker image prune -f >/dev/null  # the dangling images an earlier build of the code layer left
  echo "$key"
}

cached() {
  local key
  start_engine || return 1
  key=$(images_key)
  for image in mobizo mobizo-postgres mobizo-redis; do
    docker image inspect "$image:$key" >/dev/null 2>&1 \
      || { echo "$image:$key is not built (scripts/compose.sh images)"; return 1; }
  done
}

# ---- the stack -------------------------------------------------------------------------------------------------
api="http://127.0.0.1:$MOBIZO_COMPOSE_API_PORT"

healthy() {  # waits for the server's /healthz (up to 3 minutes: migrations on a fresh database)
  for _ in $(seq 1 360); do
    curl -sf "$api/healthz" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  say "the server did not answer on $api/healthz:"
  compose logs --tail 30 server >&2
  return 1
}

admin_token() {
  if [ -z "${MOBIZO_ADMIN_TOKEN:-}" ]; then
    local file="$cache/admin-token-$COMPOSE_PROJECT_NAME"
    [ -s "$file" ] || (umask 077 && "$python" -c 'import secrets; print(secrets.token_hex(32))' > "$file")
    MOBIZO_ADMIN_TOKEN=$(cat "$file")
  fi
  export MOBIZO_ADMIN_TOKEN
}

up() {
  admin_token
  compose up -d --no-build "$@" db redis server worker >&2
  healthy
}

case "${1:-up}" in
  images) engine; images ;;
  up) shift || true; engine; images >/dev/null; up "$@"; say "serving on $api" ;;
  demo) engine; admin_token; source scripts/compose_demo.sh ;;  # its first step builds the images
  key) images_key ;;
  cached) cached ;;
  *) admin_token; compose "$@" ;;
esac
