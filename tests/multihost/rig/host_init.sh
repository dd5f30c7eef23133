#!/usr/bin/env bash
# host_init.sh: PID 1 of one simulated host, started by up.sh inside the host's own
# network, PID, UTS, IPC and mount namespaces (environment MH_H_* and MH_* from up.sh).
# It names the host, gives it its own /etc/hosts, /tmp and /dev/shm, mounts the
# volume with a JuiceFS client of its own, then idles. On SIGTERM it stops the
# host's processes, unmounts and exits.
set -u

hostname "$MH_H_NAME"

if [ "$MH_PRIVATE_TMP" = 1 ]; then
    mount -t tmpfs -o mode=1777,size=2g "tmpfs-$MH_H_NAME" /tmp
    mount -t tmpfs -o mode=1777 "shm-$MH_H_NAME" /dev/shm
fi
[ -r "$MH_HOSTS_FILE" ] && mount --bind "$MH_HOSTS_FILE" /etc/hosts

mkdir -p "$MH_MOUNT" "$MH_H_DIR/cache"

# The client gets a nested mount namespace with its own /tmp: it names sockets
# there by pid, and pids repeat across hosts. Its mount reaches the host through
# a shared bind mount of the mount point.
mount --bind "$MH_MOUNT" "$MH_MOUNT"
mount --make-shared "$MH_MOUNT"

# A cache directory of its own: hosts share nothing locally.
# shellcheck disable=SC2086
unshare --mount --propagation unchanged -- \
    sh -c 'mount -t tmpfs -o mode=1777,size=64m jfs-tmp /tmp && exec "$@"' sh \
    "$MH_JFS" mount --no-usage-report --backup-meta 0 --hide-internal \
    --cache-dir "$MH_H_DIR/cache" $MH_JFS_OPTS \
    "$MH_META_URL" "$MH_MOUNT" >>"$MH_H_LOG" 2>&1 &
jfs_pid=$!
jfs_exe=$(readlink -f "$MH_JFS")

# Stop the host's processes first so nothing keeps the mount busy; a clean
# unmount also closes this client's session in Redis.
others() {
    local p exe
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = 1 ] || [ "$p" = "$BASHPID" ] && continue   # not us, nor this subshell
        exe=$(readlink "/proc/$p/exe" 2>/dev/null) || continue
        [ "$exe" = "$jfs_exe" ] || echo "$p"
    done
}
shutdown() {
    local p i
    trap '' TERM INT HUP
    kill -TERM $(others) 2>/dev/null
    for i in $(seq 30); do
        [ -z "$(others)" ] && break
        sleep 0.1
    done
    kill -KILL $(others) 2>/dev/null
    timeout 10 "$MH_JFS" umount "$MH_MOUNT" >>"$MH_H_LOG" 2>&1 ||
        umount -l "$MH_MOUNT" >>"$MH_H_LOG" 2>&1
    for i in $(seq 50); do
        [ -n "$jfs_pid" ] && kill -0 "$jfs_pid" 2>/dev/null || break
        sleep 0.1
    done
    [ -n "$jfs_pid" ] && kill -TERM "$jfs_pid" 2>/dev/null
    exit 0
}
trap shutdown TERM INT HUP

# Idle, reaping orphans as PID 1; a client that exits on its own leaves a note for up.sh.
rm -f "$MH_H_DIR/juicefs.exited"
while :; do
    sleep 3600 &
    wait -n
    if [ -n "$jfs_pid" ] && ! kill -0 "$jfs_pid" 2>/dev/null; then
        wait "$jfs_pid"
        echo "juicefs exited with status $?" | tee -a "$MH_H_LOG" >"$MH_H_DIR/juicefs.exited"
        jfs_pid=
    fi
done
