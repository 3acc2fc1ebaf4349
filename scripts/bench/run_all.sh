#!/usr/bin/env bash
# `make bench`: the CPU benchmarks, one after the other (each prints a table and writes
# bench-results/*.json). The GPU benchmark (scripts/bench/learner_gpu.py) runs on a CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
$PY scripts/bench/rollout.py
$PY scripts/bench/learner.py
$PY scripts/bench/async_loop.py
$PY scripts/bench/gateway.py
$PY scripts/bench/oversized_requests.py --calls 30
