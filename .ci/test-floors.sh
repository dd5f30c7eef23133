#!/usr/bin/env bash
# CI: the test suite against the lowest numpy, wgpu and filelock that pyproject.toml allows.
# A fresh machine, as root, after .ci/install-wgpu-deps.sh. Extra arguments go to pytest.
#
# The pins below must equal the floors in pyproject.toml's dependencies. numpy 1.24 has
# wheels for CPython 3.8-3.11 only: where python3 is newer, set PYTHON=python3.11 (or 3.10).
# torch is not installed (no dependency of gradsync, and a large wheel): its two tests
# (tests/test_buffers.py, tests/test_examples.py) skip, as pytest's summary says.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# Mesa's EGL prints an error for every adapter enumeration without it.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"

NUMPY_FLOOR=1.24.0
WGPU_FLOOR=0.27.0
FILELOCK_FLOOR=3.30.0
python="${PYTHON:-python3}"
venv="${FLOOR_VENV:-/tmp/gradsync-floor-venv}"

if ! "$python" -m venv --clear "$venv" 2>/dev/null; then
    # Debian's python3 makes venvs only with python3-venv (ensurepip) installed.
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    "$python" -m venv --clear "$venv"
fi
"$venv/bin/python" -m pip install -q "numpy==$NUMPY_FLOOR" "wgpu==$WGPU_FLOOR" \
    "filelock==$FILELOCK_FLOOR" -e '.[test]'
"$venv/bin/python" -c 'import sys, numpy, wgpu, filelock
print(f"floors: Python {sys.version.split()[0]}, numpy {numpy.__version__}, wgpu {wgpu.__version__}, filelock {filelock.__version__}")'
"$venv/bin/python" -m pytest "$@"
