#!/usr/bin/env bash
# down.sh: remove the simulated cluster (hosts, their mounts, Redis, the namespaces,
# the route guard, the volume's data) from any state, whole, partial or killed.
# Logs stay in $MH_DIR/logs. Fails only if something is left over.
set -uo pipefail
. "$(dirname "$(readlink -f "$0")")/common.sh"

mh_require_root
mh_take_lock
mh_down || mh_die "down: something was left over (see above)"
