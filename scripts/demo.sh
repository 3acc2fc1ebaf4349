#!/usr/bin/env bash
# The main job: bring up the local cluster, run SFT warm start + async GRPO on
# the generated tiny model, and report the held-out reward before and after.
# KEEP_CLUSTER=1 leaves the services running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-}  # empty: the embedded default cluster
SPEC=${SPEC:-examples/grpo_addition.yaml}
LOG=$(mktemp)

deploy/serve up $CLUSTER
status=0
.venv/bin/rlserve submit "$SPEC" --watch | tee "$LOG" || status=$?
if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then
  deploy/serve down $CLUSTER >/dev/null
fi
if [[ $status -ne 0 ]]; then
  echo "demo: the run did not succeed (exit $status); see the events above" >&2
  exit "$status"
fi
grep -E "^  (run directory|final model|reward plot):" "$LOG" | sed 's/^  /demo: /'
grep -E "^held-out reward: before" "$LOG" | tail -1
rm -f "$LOG"
