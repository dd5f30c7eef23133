#!/usr/bin/env bash
# on.sh HOST CMD [ARGS...]: run a command in all of host HOST's namespaces, in the
# caller's working directory when the host sees it (else /); exits with its status.
# Killing on.sh sends the command SIGTERM.
set -euo pipefail
. "$(dirname "$(readlink -f "$0")")/common.sh"

[ $# -ge 2 ] || mh_die "usage: on.sh HOST CMD [ARGS...]"
host=$1
shift
mh_require_root
pid=$(mh_pid_from "$MH_DIR/hosts/$host/init.pid") || mh_die "host '$host' is not up (run up.sh)"

# nsenter forks once inside the PID namespace; it does not pass signals on, hence
# --pdeathsig. The sh wrapper restores the working directory.
exec nsenter --target "$pid" --mount --uts --ipc --net --pid -- \
    setpriv --pdeathsig TERM -- env HOSTNAME="$host" \
    sh -c 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"' on.sh "$PWD" "$@"
