# The demo's personal variant (MOBIZO_DEMO_TASK=personal bash scripts/demo.sh), sourced by scripts/demo.sh once
# its server runs, its user exists and the model is registered: one person's device learns that person's own text.
#
# Three users, each a speaking role of the shipped Shakespeare sample (benchmarks/personal_data.py; the demo's user
# is CORIOLANUS), each with a device holding their speeches as `text` records; a cohort of the three learns a
# population adapter in federated rounds (only logs leave the devices); then the user's own job starts from it and
# trains on the user's earlier speeches. The device prints the perplexity of base, population and personal on the
# user's later speeches (held out, never trained on), and one line generated before and after, on the device
# (`mobizo agent eval`, `mobizo agent generate`: the inference program).
#
# MOBIZO_DEMO_STEPS (the personal job's; tiny 60, SmolLM2 100), MOBIZO_DEMO_ROUNDS (3) and MOBIZO_DEMO_LOCAL_STEPS
# (a device's steps a round; tiny 10, SmolLM2 20) shorten it.

STEPS=${MOBIZO_DEMO_STEPS:-$([ "$MODEL" = smollm2 ] && echo 100 || echo 60)}
ROUNDS=${MOBIZO_DEMO_ROUNDS:-3}
LOCAL=${MOBIZO_DEMO_LOCAL_STEPS:-$([ "$MODEL" = smollm2 ] && echo 20 || echo 10)}
# A row is a line given what comes before it: the answer length covers the longest line of the sample (SmolLM2's
# tokenizer 22 tokens, the tiny model's 34), the rest of the row is context.
if [ "$MODEL" = smollm2 ]; then SHAPE=(--seq-len 96 --answer-len 24); else SHAPE=(--seq-len 64 --answer-len 36); fi
SHAPE+=(--q 4 --batch-size 16)
ME=coriolanus
PEOPLE=(coriolanus marcius menenius)
AGENT_PIDS=()
trap 'status=$?; kill ${AGENT_PIDS[@]+"${AGENT_PIDS[@]}"} $SERVER_PID 2>/dev/null; wait 2>/dev/null || true; exit $status' EXIT

say "the users' own text: a speaking role each, their speeches in order (the last fifth: their later text)"
python -m benchmarks.personal_data --input "$DATA/shakespeare/input.txt" --out "$WORK/people"

say "admin: a cohort for the model and the text task; each user joins it and enrolls a device holding their speeches"
COHORT=$(mobizo cohorts create people --model demo-model --task text | json '["id"]')
declare -A KEY=([$ME]=$MOBIZO_TOKEN)
for person in "${PEOPLE[@]}"; do
  [ "$person" = "$ME" ] || KEY[$person]=$(mobizo users create "$person" | json '["api_key"]')
  MOBIZO_TOKEN=${KEY[$person]} mobizo cohorts join "$COHORT" > /dev/null
  CODE=$(MOBIZO_TOKEN=${KEY[$person]} mobizo enroll-code --json | json '["code"]')
  printf '%s\n' "$CODE" | mobizo agent enroll --server "$MOBIZO_SERVER" --name "$person-phone" \
    --config "$WORK/$person.json" > /dev/null
done
mobizo cohorts list

say "admin: $ROUNDS federated rounds over the three devices ($LOCAL steps each a round); only logs leave them"
FED=$(MOBIZO_TOKEN=$MOBIZO_ADMIN_TOKEN mobizo jobs submit --cohort "$COHORT" --rounds "$ROUNDS" \
      --clients-per-round 3 --local-steps "$LOCAL" ${RATE[@]+"${RATE[@]}"} "${SHAPE[@]}" | json '["id"]')
for person in "${PEOPLE[@]}"; do
  mobizo agent run --data-dir "$WORK/people/$person" --config "$WORK/$person.json" --work-dir "$WORK/work-$person" \
    --poll-s 1 > "$WORK/agent-$person.log" 2>&1 &
  AGENT_PIDS+=($!)
done
for _ in $(seq 1 900); do
  STATUS=$(MOBIZO_TOKEN=$MOBIZO_ADMIN_TOKEN mobizo jobs show "$FED" | json '["status"]')
  case "$STATUS" in succeeded) break ;; failed | cancelled) echo "demo: the federated job $STATUS" >&2; exit 1 ;; esac
  sleep 1
done
[ "$STATUS" = succeeded ] || { echo "demo: the federated job is still $STATUS" >&2; exit 1; }
kill "${AGENT_PIDS[@]}" && wait "${AGENT_PIDS[@]}" 2>/dev/null || true
AGENT_PIDS=()
POPULATION=$(mobizo adapters list --json | python -c "import json, sys
print(max((a for a in json.load(sys.stdin)['data'] if a['cohort_id']), key=lambda a: a['version'])['id'])")
echo "the population's adapter: $POPULATION (the cohort's version $ROUNDS)"

say "the user: a personal job from the population's adapter ($STEPS steps on the device's earlier speeches)"
JOB=$(mobizo jobs submit --model demo-model --task text --init-adapter "$POPULATION" --steps "$STEPS" \
      ${RATE[@]+"${RATE[@]}"} "${SHAPE[@]}" | json '["id"]')
mobizo agent run --once --data-dir "$WORK/people/$ME" --config "$WORK/$ME.json" --work-dir "$WORK/work-$ME"
mobizo jobs show "$JOB" | python -c "import json, sys; h = json.load(sys.stdin)['held_out']
print(f\"the job's held-out figures ({h['n']} lines of the user's later speeches, never uploaded): perplexity \"
      f\"{h['before']['perplexity']:.1f} (the population's) -> {h['after']['perplexity']:.1f}\")"
PERSONAL=$(mobizo jobs show "$JOB" | json '["adapter_id"]')

say "on the device (the inference program): base, population and personal on the user's later speeches"
ON_DEVICE=(--config "$WORK/$ME.json" --work-dir "$WORK/work-$ME")
HELD="$WORK/people/$ME/held_out.jsonl"
perplexity() { mobizo agent eval "$@" --task text --data "$HELD" "${SHAPE[0]}" "${SHAPE[1]}" "${ON_DEVICE[@]}" --json \
  | json '["perplexity"]'; }
BASE=$(perplexity --model demo-model)
POP=$(perplexity --adapter-id "$POPULATION")
OWN=$(perplexity --adapter-id "$PERSONAL")
CUE=$(python -c "import json, sys; print(json.loads(open(sys.argv[1]).readline())['context'])" "$HELD")
line() { mobizo agent generate "$@" --prompt "$CUE"$'\n\n' --max-new-tokens 24 "${ON_DEVICE[@]}" --json 2>/dev/null \
  | tail -n 1 | python -c "import json, sys; print(repr(json.load(sys.stdin)['text'].split(chr(10))[0]))"; }
BEFORE=$(line --model demo-model)
AFTER=$(line --adapter-id "$PERSONAL")
python -c "import sys; base, pop, own = map(float, sys.argv[1:4])
print(f'\nCORIOLANUS, perplexity on his later speeches (held out on his device): base {base:.1f} -> population '
      f'{pop:.1f} -> personal {own:.1f}')
print(f'the cue: {sys.argv[4]!r}')
print(f'his next line, base model:       {sys.argv[5]}')
print(f'his next line, personal adapter: {sys.argv[6]}')" "$BASE" "$POP" "$OWN" "$CUE" "$BEFORE" "$AFTER"
