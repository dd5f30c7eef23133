#!/usr/bin/env bash
# Same-run A/B of the GPU step (issue 26: staging in parts), W=2, on one host:
#   base  the tree in .base/base/src (main before the change)
#   new   this tree (src), staging large gradients in parts (its default on a GPU)
#   one   this tree staging in one piece (--max-parts 1): the pipelining alone
#   p16   this tree with up to 16 parts (--max-parts 16)
# in two rounds, the second in reverse order; each run's output goes to $OUT/step-<variant>.txt
# and $OUT/summary.txt gathers the tables. About 4 minutes; runs that would start after
# 400 s are skipped, so the whole stays under 8 minutes.
# On the GPU host: GPU_HOST=1 OUT=<dir> bash benchmarks/gpu_ab.sh (loaders and wgpu wheels
# as for h200_run.sh). Elsewhere (lavapipe) without GPU_HOST, e.g.
# OUT=/tmp/x SIZES="1 4" STEPS=3 bash benchmarks/gpu_ab.sh.
set -uo pipefail
OUT=${OUT:-/tmp/gradsync-gpu-ab}
SIZES=${SIZES:-1 16 64 256}
STEPS=${STEPS:-9}
mkdir -p "$OUT"
site=""
if [ -n "${GPU_HOST:-}" ]; then
  source benchmarks/h200_env.sh # loaders, wgpu wheels into /tmp/site, Vulkan driver
  site=/tmp/site:
fi
base=$PWD/.base/base/src
[ -d "$base/gradsync" ] || { echo "no base tree at $base" >&2; exit 1; }
{
  date -u; nvidia-smi -L 2>/dev/null; nproc; uptime; python3 --version
  echo "base: $base"; echo "new: $PWD/src ($(git rev-parse --short HEAD 2>/dev/null))"
} 2>&1 | tee "$OUT/env.txt"
SECONDS=0
run() { # variant, round
  local src=$PWD/src parts=()
  case $1 in
    base) src=$base ;;
    one) parts=(--max-parts 1) ;;
    p16) parts=(--max-parts 16) ;;
  esac
  if [ "$SECONDS" -gt 400 ]; then
    echo "### $1 round $2: skipped at ${SECONDS} s" | tee -a "$OUT/step-$1.txt"
    return
  fi
  echo "### $1 round $2 (${SECONDS} s; $(uptime))" | tee -a "$OUT/step-$1.txt"
  # shellcheck disable=SC2086  # SIZES is a list
  PYTHONPATH=$site$src timeout 75 python3 benchmarks/wgpu_step.py --world-sizes 2 \
    --sizes-mib $SIZES --steps "$STEPS" --profile "${parts[@]}" \
    --json "$OUT/step-$1-r$2.json" 2>&1 | tee -a "$OUT/step-$1.txt" | grep -v '^\s*$'
}
for v in base new one p16; do run $v 1; done
for v in p16 one new base; do run $v 2; done
# Per variant and round: the step table (fenced/staged is the measure).
for v in base new one p16; do
  echo "=== $v"
  grep -E '^###|^ +[0-9.]+ +[0-9]' "$OUT/step-$v.txt"
done 2>&1 | tee "$OUT/summary.txt"
echo "done in ${SECONDS} s" | tee -a "$OUT/summary.txt"
