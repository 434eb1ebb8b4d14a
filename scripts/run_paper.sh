#!/usr/bin/env bash
# The paper-scale suite (layernorm.experiments.papers), two experiments at a time with one torch
# thread each, so that a 2-core machine is fully used. Every experiment is its own resumable
# command: re-running this script after a stop continues where each left off (--resume) and skips
# the finished ones. Nothing is committed here: the script prints each experiment as it finishes,
# so that its records can be committed at once (git add docs/results/<name>).
#
#   scripts/run_paper.sh                 # everything, in the background:  nohup ... &
#   scripts/run_paper.sh mnist-ff adanorm
#
# Results go to docs/results/<name>/ (records, figures, provenance, config), checkpoints to
# results/checkpoints/ (ignored by git), logs to results/paper-logs/<name>.log. An experiment
# whose provenance.json exists is finished and skipped (FORCE=1 resumes it anyway, which reads its
# finished runs back). The report is written once both lanes are done: layernorm report docs/results.
# OUT=DIR writes elsewhere; EXTRA_ARGS="--set KEY=VALUE ..." is passed to every run. WORKERS=2
# trains the runs of one experiment in two processes (for a single experiment on 2 cores:
# WORKERS=2 scripts/run_paper.sh mnist-ff); experiments whose runs depend on each other ignore it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-docs/results}
LOGS=results/paper-logs
mkdir -p "$LOGS"

# two queues of about equal estimated CPU time (layernorm.experiments.papers.lanes)
mapfile -t queues < <("$PY" - "$@" <<'PYEOF'
import sys
from layernorm.experiments import names
from layernorm.experiments.papers import lanes
for q in lanes(sys.argv[1:] or names()):
    print(" ".join(q))
PYEOF
)

run_one() {
    local name=$1
    if [ -f "$OUT/$name/provenance.json" ] && [ -z "${FORCE:-}" ]; then
        echo "$(date -u '+%F %T') skipped  $name: $OUT/$name holds a finished run (FORCE=1 redoes it)"
        return
    fi
    echo "$(date -u '+%F %T') started  $name (log: $LOGS/$name.log)"
    if OMP_NUM_THREADS=1 "$PY" -m layernorm reproduce "$name" --paper --resume --out "$OUT" \
        --workers "${WORKERS:-1}" --no-report --no-progress ${EXTRA_ARGS:-} >"$LOGS/$name.log" 2>&1; then
        echo "$(date -u '+%F %T') finished $name: commit $OUT/$name"
    else
        echo "$(date -u '+%F %T') FAILED   $name (exit $?): see $LOGS/$name.log"
    fi
}

lane() {
    local name
    for name in $1; do run_one "$name"; done
}
echo "lane 1: ${queues[0]:-}"
echo "lane 2: ${queues[1]:-}"
lane "${queues[0]:-}" &
lane "${queues[1]:-}" &
wait
"$PY" -m layernorm report "$OUT" >/dev/null && echo "$(date -u '+%F %T') report: $OUT/report.md"
