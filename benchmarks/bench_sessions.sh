#!/usr/bin/env bash
# Server-side conversations on the bundled model: growth per memory policy and fact recall.
# Usage: benchmarks/bench_sessions.sh OUT_DIR [TURNS]   (python: $PYTHON, default python)
# Two servers: one with a per-request KV quota (the memory budget of summary, segment and the
# plain window) and one without (full keeps everything within the context).
# PARTS=quota or PARTS=full runs only one of them (e.g. both at once into the same OUT_DIR).
set -euo pipefail
OUT=${1:?output folder}; TURNS=${2:-40}; PY=${PYTHON:-python}
QUOTA=${QUOTA:-768}; TURN_TOKENS=${TURN_TOKENS:-32}; OUTPUT_LEN=${OUTPUT_LEN:-24}
mkdir -p "$OUT"
serve() {  # serve PORT DB [extra options]
  local port=$1 db=$2; shift 2
  $PY -m kvledger.cli serve --port "$port" --state-db "$db" "$@" > "$OUT/serve-$port.log" 2>&1 &
  echo $! > "$OUT/serve-$port.pid"
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
}
stop() { kill "$(cat "$OUT/serve-$1.pid")"; wait "$(cat "$OUT/serve-$1.pid")" 2>/dev/null || true; }
bench() {  # bench PORT POLICIES SUBDIR [extra]
  local port=$1 policies=$2 sub=$3; shift 3
  $PY -m kvledger.cli bench --url "http://127.0.0.1:$port" --workload chat-growth \
    --api responses --memory "$policies" --turns "$TURNS" --turn-tokens "$TURN_TOKENS" \
    --output-len "$OUTPUT_LEN" --out "$OUT/$sub" "$@" | tee "$OUT/$sub.txt"
}
if [[ " ${PARTS:-quota full} " == *" quota "* ]]; then
  serve 8771 "$OUT/quota.db" --max-kv-tokens-per-request "$QUOTA"
  bench 8771 summary,segment,window growth-quota
  [ "${RECALL:-1}" = 1 ] && bench 8771 summary,segment,window recall-quota --recall
  stop 8771
fi
if [[ " ${PARTS:-quota full} " == *" full "* ]]; then
  serve 8772 "$OUT/full.db"
  bench 8772 full growth-full
  [ "${RECALL:-1}" = 1 ] && bench 8772 full recall-full --recall
  stop 8772
fi
