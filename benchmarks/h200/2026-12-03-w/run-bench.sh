#!/usr/bin/env bash
# The step table and the 1 MiB rounds, as in 2026-12-03-t (same host as run-tests.sh
# when the machine stayed warm).
set -uo pipefail
source benchmarks/h200_env.sh
R=/tmp/rb; mkdir -p $R
{ date -u; nvidia-smi -L; } > $R/env.txt 2>&1
timeout 170 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 64 256 --steps 15 --profile \
  --json $R/step.json > $R/step.txt 2>&1; cat $R/step.txt
timeout 60 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 --steps 9 --params 100 --profile \
  --json $R/step-params-100.json > $R/step-params-100.txt 2>&1; cat $R/step-params-100.txt
timeout 170 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 --steps 200 --rounds 3 --profile \
  --json $R/rounds.json > $R/rounds.txt 2>&1; tail -12 $R/rounds.txt
tar -C $R -cf "$OUT/bench.tar" .
cp $R/step.txt $R/rounds.txt "$OUT/"
