#!/usr/bin/env bash
# The simulated cluster of tests/multihost/rig on a lent 16-core machine (the device
# tool): issue 27's compressed step ratios and issue 26's numpy overlap across hosts,
# without the CPU starvation of the 2-core development machine. That machine has
# Python 3.12, numpy and filelock but no network, no redis, iproute2 or fuse3, so the
# git-ignored folder .mh/ travels with the checkout (`carry: [".mh"]`), made here by
#   bash benchmarks/multihost_lent.sh prepare      (Debian 12: juicefs on PATH, redis, ip)
# and run there, as root, by
#   bash benchmarks/multihost_lent.sh run          (results in $OUT/mh.txt, overlap.txt)
# or, with each host's object traffic capped (Mbit/s a direction) and no overlap run, by
#   bash benchmarks/multihost_lent.sh run 1000
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
MH=.mh
case "${1:-}" in
prepare)
    grep -qx "/$MH/" .git/info/exclude 2>/dev/null || echo "/$MH/" >>.git/info/exclude
    mkdir -p $MH/bin $MH/lib $MH/real
    for b in ip redis-cli; do cp -L "$(command -v $b)" $MH/real/$b; done
    cp -L "$(command -v redis-server)" $MH/real/redis-server  # a multi-call binary: keep argv0
    cp -L "$(command -v fusermount3)" $MH/bin/
    for f in $MH/real/*; do
        ldd "$f" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm)\.so|ld-linux' | xargs -r cp -Lt $MH/lib
    done
    # Each program gets the copied libraries alone, through the loader (not the environment,
    # which the processes it starts would inherit).
    for b in ip redis-server redis-cli; do
        printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/..\nexec /lib64/ld-linux-x86-64.so.2 --library-path "$d/lib" --argv0 %s "$d/real/%s" "$@"\n' \
            "$b" "$b" >$MH/bin/$b
        chmod +x $MH/bin/$b
    done
    xz -T0 -6 -c "$(python3 -c 'import shutil; print(shutil.which("juicefs"))')" >$MH/juicefs.xz
    du -sh $MH
    ;;
run)
    OUT=${OUT:-/var/tmp/gradsync-lent}
    mkdir -p "$OUT"
    xz -T4 -dc $MH/juicefs.xz >/usr/local/bin/juicefs && chmod +x /usr/local/bin/juicefs
    export PATH=$PWD/$MH/bin:$PATH MH_JUICEFS=/usr/local/bin/juicefs PYTHONPATH=$PWD/src
    export MH_DIR=/var/tmp/gsmh PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2
    MBPS=${2:-}
    # The rig's mounts take it from here (up.sh, and multihost.py's own up).
    [ -z "$MBPS" ] || export MH_JFS_OPTS="--upload-limit $MBPS --download-limit $MBPS"
    nproc --all; python3 --version  # nproc alone counts OMP_NUM_THREADS
    bash tests/multihost/rig/up.sh 2 || { tail -n 30 $MH_DIR/logs/*.log; exit 1; }
    for order in none,bf16,int8 int8,bf16,none; do
        uptime
        timeout 140 python3 benchmarks/multihost.py --keep-up --sizes 16777216 --steps 20 \
            --warmup 3 --compression $order 2>&1 | grep -v "done:" | tee -a "$OUT/mh.txt"
    done
    [ -n "$MBPS" ] || timeout 100 python3 benchmarks/overlap.py --hosts 2 --keep-up --mib 4 --layers 8 --steps 5 \
        --rounds 3 --compute numpy --matmuls 60 2>&1 | tee -a "$OUT/overlap.txt"
    bash tests/multihost/rig/down.sh
    ;;
*) echo "usage: $0 prepare|run [MBPS]" >&2; exit 2 ;;
esac
