# One job through the compose stack, each step timed (sourced by `scripts/compose.sh demo`, which has started the
# engine and defines images, compose, up, api, python). From a fresh project (its volumes removed):
# a tiny model registered, a user, the containerized agent (profile "agent") enrolled, a job compiled by a worker,
# trained by the agent, verified, its adapter downloaded; then --scale worker=3 and a second job, compiled by another
# worker than the first; then down and up again: the jobs, the adapters and their files are still there.
# Ends with the stack up; `scripts/compose.sh down -v` removes it with its volumes.
work=$(realpath -m "${MOBIZO_COMPOSE_DIR:-runs/compose}")
export MOBIZO_MODELS_DIR="$work/models"
started=$(date +%s.%N)
last=$started
step() {  # step NAME: the previous step's duration, the time so far, and the next step's name
  local now
  now=$(date +%s.%N)
  awk -v now="$now" -v s="$started" -v l="$last" -v name="$*" \
    'BEGIN { printf "== [%7.1f s | previous step %6.1f s] %s\n", now - s, now - l, name }'
  last=$now
}
json() { "$python" -c "import json, sys; print(json.load(sys.stdin)$1)"; }
# the image's CLI, a client on the host's network (a user's or the admin's token from the environment)
cli() {
  docker run --rm --network host --user "$(id -u):$(id -g)" -e MOBIZO_SERVER="$api" -e MOBIZO_TOKEN="${MOBIZO_TOKEN:-}" \
    -e MOBIZO_ADMIN_TOKEN -v "$work:/work" mobizo:local mobizo "$@"
}
compiled_by() {  # compiled_by JOB: the worker container whose log has the job's compile task succeeding
  local container
  for container in $(compose ps -q worker); do
    # (grep -c reads the whole log: grep -q would end the pipe early, and pipefail would count that as a failure)
    if [ "$(docker logs "$container" 2>&1 | grep -c "compile-$1\] succeeded")" -gt 0 ]; then
      docker inspect -f '{{.Name}}' "$container" | tr -d /
      return 0
    fi
  done
  return 1
}
wait_job() {  # wait_job JOB: until it ends (prints each status it passes through); fails unless it succeeded
  local status seen=""
  for _ in $(seq 1 900); do
    status=$(cli jobs show "$1" | json '["status"]')
    [ "$status" = "$seen" ] || { echo "   job $1: $status"; seen=$status; }
    case "$status" in succeeded) return 0 ;; failed | cancelled) cli jobs show "$1" >&2; return 1 ;; esac
    sleep 2
  done
  echo "job $1 did not end" >&2
  return 1
}

step "the images (the dependencies cached; the code layer from this checkout)"
images >/dev/null

step "a fresh project $COMPOSE_PROJECT_NAME (its containers and volumes removed)"
compose --profile agent down -v --remove-orphans >/dev/null 2>&1 || true
rm -rf "$work" && mkdir -p "$work/models" "$work/out"

step "up: db, redis, server (2 API processes), worker on $api"
up

step "the admin: a tiny seeded Llama into $MOBIZO_MODELS_DIR (mounted at /models), registered as tiny"
chown 1000 "$MOBIZO_MODELS_DIR"  # the image's user (uid 1000) reads the models
docker run --rm -v "$MOBIZO_MODELS_DIR:/models" -v "$repo/data:/task-data:ro" \
  -e MOBIZO_TASK_DATA_DIR=/task-data mobizo:local mobizo make-tiny-model --out /models/tiny >/dev/null
cli models register tiny --path /models/tiny >/dev/null

step "the admin: a user"
MOBIZO_TOKEN=$(cli users create compose-user | json '["api_key"]')
export MOBIZO_TOKEN
cli models list

step "the user's device: the agent container enrolled with a one-time code, its data in the agent volume"
head -n 2000 data/sst2/train.jsonl | compose run --rm -T agent sh -c 'mkdir -p /agent/sst2 && cat > /agent/sst2/train.jsonl'
code=$(cli enroll-code --json | json '["code"]')
compose run --rm -T -e MOBIZO_ENROLLMENT_CODE="$code" agent mobizo agent enroll --server "$api" --name box1
compose --profile agent up -d --no-build agent

step "the user: a job (SST-2, 30 steps); a worker compiles it, the agent trains, the server verifies"
job=$(cli jobs submit --model tiny --task sst2 --steps 30 --lr 1e-2 --eps 1e-2 --seq-len 64 | json '["id"]')
wait_job "$job"
first=$(compiled_by "$job") || { echo "no worker's log has compile-$job" >&2; exit 1; }
echo "   compiled by $first"

step "the user: the adapter downloaded"
adapter=$(cli adapters list --json | json '["data"][0]["id"]')
cli adapters download "$adapter" --out /work/out/adapter-1 >/dev/null
ls "$work/out/adapter-1"
sha_before=$(sha256sum "$work"/out/adapter-1/*.safetensors | cut -c1-64)

step "--scale worker=3; the first job's worker stopped, so another compiles the second job"
compose up -d --no-build --no-recreate --scale worker=3 worker >&2
docker stop "$first" >/dev/null
job2=$(cli jobs submit --model tiny --task sst2 --steps 20 --q 2 --lr 1e-2 --eps 1e-2 --seq-len 32 | json '["id"]')
wait_job "$job2"
docker start "$first" >/dev/null
second=$(compiled_by "$job2") || { echo "no worker's log has compile-$job2" >&2; exit 1; }
echo "   compiled by $second (the first job's: $first)"
[ "$second" != "$first" ]

step "down (volumes kept), then up again"
compose --profile agent down >/dev/null 2>&1
up
compose --profile agent up -d --no-build agent >&2

step "after the restart: both jobs, both adapters, the first adapter's files byte for byte"
cli jobs list
[ "$(cli jobs list --json | json '["count"]')" = 2 ]
[ "$(cli adapters list --json | json '["count"]')" = 2 ]
cli adapters download "$adapter" --out /work/out/adapter-1-again >/dev/null
sha_after=$(sha256sum "$work"/out/adapter-1-again/*.safetensors | cut -c1-64)
[ "$sha_before" = "$sha_after" ]
echo "   adapter $adapter: sha256 $sha_after before and after"

step "done (the stack is up: scripts/compose.sh down -v removes it and its volumes)"
