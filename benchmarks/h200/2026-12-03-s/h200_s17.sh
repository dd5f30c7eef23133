#!/usr/bin/env bash
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$OUT/env.txt"
echo "=== numpy path, threshold A/B" | tee "$OUT/thr.txt"
timeout 120 python3 benchmarks/h200/2026-12-03-s/thr_ab.py 1,2 2,4 3 400 2>&1 | tee -a "$OUT/thr.txt"
timeout 60 python3 benchmarks/h200/2026-12-03-s/thr_ab.py 1 2,4 3 400 buf 2>&1 | tee -a "$OUT/thr.txt"
P=gradsync._protocol.REPLICATE_BELOW_BYTES=67108864
mkdir -p /tmp/j
for round in 1 2 3; do
  for v in plain repl; do
    echo "=== round $round $v"
    if [ $v = repl ]; then export GS_PATCH=$P; else export GS_PATCH=; fi
    timeout 100 python3 benchmarks/wgpu_ab.py --world-sizes 2 4 --sizes-mib 1 --steps 200 --profile \
      --json /tmp/j/$v-$round.json 2>&1 | grep -v "^$"
  done
done 2>&1 | tee "$OUT/ab.txt"
tar -C /tmp/j -cf "$OUT/json.tar" .
