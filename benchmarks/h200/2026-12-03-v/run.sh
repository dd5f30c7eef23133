#!/usr/bin/env bash
set -uo pipefail
source benchmarks/h200_env.sh
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi -L; nproc; python3 --version; uname -a; } > $R/env.txt 2>&1
timeout 200 python3 benchmarks/h200/2026-12-03-v/oldnew_h200.py $PWD/.exp/old_src/src $PWD/src 1024,262144 5 2000 2>&1 | tee $R/numpy.txt
for round in 1 2 3; do
  for v in old new; do
    echo "=== round $round $v"
    if [ $v = old ]; then P=$PWD/.exp/old_src/src; else P=$PWD/src; fi
    PYTHONPATH=/tmp/site:$P timeout 100 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 --steps 200 --profile 2>&1 | grep -v "^$" | grep -E "^ +1 |profile|^W="
  done
done 2>&1 | tee $R/wgpu.txt
tar -C $R -cf "$OUT/run.tar" .
