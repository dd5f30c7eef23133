#!/usr/bin/env bash
# Install what the whole test suite needs on Debian, as root: Mesa's software GPU for
# the wgpu tests, and the multi-host rig's redis-server, fuse3 and juicefs.
# Idempotent: does nothing (and needs no network) when everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install-wgpu-deps.sh
bash tests/multihost/rig/deps.sh --install
