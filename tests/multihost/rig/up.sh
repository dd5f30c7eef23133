#!/usr/bin/env bash
# up.sh [N]: start the simulated cluster of N hosts (default 2) sharing one JuiceFS
# volume (see common.sh). Idempotent: a healthy cluster with the same settings is
# kept; any other state (partial, killed, another N) is torn down first. A failed
# up.sh tears down what it started and shows the logs' tails.
set -euo pipefail
. "$(dirname "$(readlink -f "$0")")/common.sh"

N=${1:-2}
[[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 1 ] && [ "$N" -le 50 ] || mh_die "N must be 1..50, got '$N'"
if [ "$MH_PRIVATE_TMP" = 1 ]; then
    case "$(readlink -m "$MH_DIR")/" in /tmp/*) mh_die "MH_DIR must not be under /tmp (hosts get a private /tmp)" ;; esac
fi
mh_require_root
[ -e /dev/fuse ] || mh_die "no /dev/fuse (a container needs --device /dev/fuse)"
mh_require_deps
mh_take_lock

if mh_is_up "$N"; then
    mh_log "already up: $N hosts"
    exit 0
fi
if [ -d "$MH_RUN" ] || [ -d "$MH_DIR/hosts" ] || [ -n "$(mh_our_netns)" ]; then
    mh_log "removing a previous or partial cluster"
    mh_down || true
fi

started=$(date +%s%N)
on_exit() {
    local rc=$?
    [ $rc -eq 0 ] && return
    mh_log "up.sh failed (exit $rc); last lines of the logs in $MH_LOGS:"
    tail -n 5 "$MH_LOGS"/*.log >&2 2>/dev/null || true
    mh_down || true
}
trap on_exit EXIT

mkdir -p "$MH_RUN" "$MH_LOGS" "$MH_DIR/redis" "$MH_DIR/etc" "$MH_DIR/hosts" "$MH_DIR/objects"
rm -f "$MH_LOGS"/*.log

# Guard: outside the hosts the subnet is unreachable, so a stray connect fails at once
# instead of going to the default gateway.
ip route replace unreachable "$MH_NET.0/24"

ip netns add "$MH_SRV_NS"
ip -n "$MH_SRV_NS" link set lo up
ip -n "$MH_SRV_NS" link add br0 type bridge
ip -n "$MH_SRV_NS" addr add "$MH_SRV_IP/24" dev br0
ip -n "$MH_SRV_NS" link set br0 up
printf '127.0.0.1 localhost\n%s %s\n' "$MH_SRV_IP" "$MH_SRV_NS" >"$MH_DIR/etc/hosts"
for i in $(seq 1 "$N"); do
    h=h$i
    ns=$(mh_host_ns "$h")
    ip netns add "$ns"
    ip -n "$MH_SRV_NS" link add "veth-$h" type veth peer name eth0 netns "$ns"
    ip -n "$MH_SRV_NS" link set "veth-$h" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(mh_host_ip "$h")/24" dev eth0
    ip -n "$ns" link set eth0 up
    echo "$(mh_host_ip "$h") $h" >>"$MH_DIR/etc/hosts"
done

# Redis on the bridge and the server namespace's loopback only, without persistence.
setsid ip netns exec "$MH_SRV_NS" redis-server \
    --bind "$MH_SRV_IP" 127.0.0.1 --port "$MH_PORT" --protected-mode no \
    --dir "$MH_DIR/redis" --save '' --appendonly no --maxmemory-policy noeviction \
    --daemonize no --logfile "$MH_LOGS/redis.log" </dev/null >/dev/null 2>&1 9>&- &
mh_save_pid $! "$MH_RUN/redis.pid"
redis_ping() { [ "$(ip netns exec "$MH_SRV_NS" redis-cli -h 127.0.0.1 -p "$MH_PORT" ping 2>/dev/null)" = PONG ]; }
for _ in $(seq 100); do
    redis_ping && break
    mh_pid_from "$MH_RUN/redis.pid" >/dev/null || mh_die "redis-server exited (see $MH_LOGS/redis.log)"
    sleep 0.1
done
redis_ping || mh_die "Redis did not answer within 10 s"

# Data blocks in a directory (an object store of sorts); metadata in Redis.
ip netns exec "$MH_SRV_NS" "$MH_JFS" format --trash-days 0 --storage file \
    --bucket "$MH_DIR/objects/" "$MH_META_URL" "$MH_VOLUME" >"$MH_LOGS/format.log" 2>&1 ||
    mh_die "juicefs format failed (see $MH_LOGS/format.log)"

mkdir -p "$MH_MOUNT"
for i in $(seq 1 "$N"); do
    h=h$i
    hdir="$MH_DIR/hosts/$h"
    mkdir -p "$hdir"
    # setsid: the host outlives this shell. --kill-child: if unshare dies, so does the host.
    env MH_H_NAME="$h" MH_MOUNT="$MH_MOUNT" MH_META_URL="$MH_META_URL" MH_H_DIR="$hdir" \
        MH_H_LOG="$MH_LOGS/$h-juicefs.log" MH_JFS="$MH_JFS" MH_JFS_OPTS="$MH_JFS_OPTS" \
        MH_HOSTS_FILE="$MH_DIR/etc/hosts" MH_PRIVATE_TMP="$MH_PRIVATE_TMP" \
        setsid ip netns exec "$(mh_host_ns "$h")" \
        unshare --pid --fork --kill-child --mount-proc --uts --ipc --mount --propagation private \
        -- bash "$MH_HERE/host_init.sh" </dev/null >"$MH_LOGS/$h-init.log" 2>&1 9>&- &
    mh_save_pid $! "$hdir/unshare.pid"
done

# Each host's PID 1 (the unshare's child), then its mount.
for i in $(seq 1 "$N"); do
    h=h$i
    hdir="$MH_DIR/hosts/$h"
    upid=$(mh_pid_from "$hdir/unshare.pid") || mh_die "$h: unshare exited at once"
    pid=
    for _ in $(seq 300); do
        pid=$(awk '{print $1}' "/proc/$upid/task/$upid/children" 2>/dev/null)
        [ -n "$pid" ] && break
        mh_gone "$upid" && mh_die "$h: unshare exited (see $MH_LOGS/$h-init.log)"
        sleep 0.1
    done
    [ -n "$pid" ] || mh_die "$h: no PID 1 after 30 s"
    mh_save_pid "$pid" "$hdir/init.pid"
    for _ in $(seq 600); do
        [ "$(mh_fstype_in "$pid" "$MH_MOUNT")" = fuse.juicefs ] && break
        mh_pid_from "$hdir/init.pid" >/dev/null || mh_die "$h: PID 1 exited (see $MH_LOGS/$h-init.log)"
        [ ! -e "$hdir/juicefs.exited" ] || mh_die "$h: $(cat "$hdir/juicefs.exited") (see $MH_LOGS/$h-juicefs.log)"
        sleep 0.1
    done
    [ "$(mh_fstype_in "$pid" "$MH_MOUNT")" = fuse.juicefs ] ||
        mh_die "$h: JuiceFS not mounted after 60 s (see $MH_LOGS/$h-juicefs.log)"
    timeout 20 nsenter -t "$pid" -m stat -f "$MH_MOUNT" >/dev/null || mh_die "$h: the mount does not answer"
done

mh_state_line "$N" >"$MH_RUN/state"
trap - EXIT
mh_log "up: $N hosts in $((($(date +%s%N) - started) / 1000000)) ms; run in one: $MH_HERE/on.sh h1 CMD"
