#!/usr/bin/env bash
# Install this offline bundle with no package index.
#   ./install.sh [PYTHON]               into PYTHON's environment (default python3): pip resolves
#                                       requirements.txt against what is installed and these wheels
#   ./install.sh --target DIR [PYTHON]  every wheel here into DIR, without resolving (then
#                                       PYTHONPATH=DIR); for an environment you may not write to
# pip keeps the exec bits of Ray's raylet and gcs_server (unpacking a wheel by hand may not).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
target=""
if [[ "${1:-}" == "--target" ]]; then target="$2"; shift 2; fi
py="${1:-python3}"
pip=("$py" -m pip install --disable-pip-version-check --no-index --no-cache-dir --find-links "$here/wheels")
if [[ -n "$target" ]]; then
  "${pip[@]}" -q --no-deps --no-compile --upgrade --target "$target" "$here"/wheels/*.whl
  echo "bundle: installed into $target; use it with: export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
else
  "${pip[@]}" -q -r "$here/requirements.txt"
  echo "bundle: installed into $("$py" -c 'import sys; print(sys.prefix)')"
fi
