#!/usr/bin/env bash
# The offline bundle as one pre-installed, xz-packed site folder, for a device call's 64 MiB carry
# (the bundle's wheels are 69 MiB; packed like this, without what no service imports, 32 MB):
#   scripts/gpu/pack_site.sh BUNDLE OUT.tar.xz
# On the device: mkdir -p /tmp/site && tar xJf OUT.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
# (scripts/gpu/h200_run.sh puts /tmp/site on PYTHONPATH when it exists). Left out: megatron-core (the
# megatron stages need it), cryptography, pyqwest, cffi and pycparser (no service imports them), zstandard's
# cffi backend, tests and bytecode.
set -euo pipefail
bundle=$1 out=$2
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
py=${PYTHON:-.venv/bin/python}
"$py" -m pip install -q --no-deps --no-compile --target "$site" --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    $(ls "$bundle"/wheels/*.whl | grep -v -E '/(megatron_core|cryptography|pyqwest|cffi|pycparser)-')
rm -f "$site"/zstandard/_cffi*.so
find "$site" -name __pycache__ -prune -exec rm -rf {} +
find "$site" -type d -name tests -prune -exec rm -rf {} +
tar cf - -C "$site" . | xz -9 -T0 > "$out"
ls -la "$out"
