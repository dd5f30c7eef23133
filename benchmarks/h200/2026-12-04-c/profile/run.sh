#!/bin/bash
# CPU-only profile of the 1 MiB W=2 exchange on the H200 host (no GPU involved).
export PYTHONPATH=$PWD/src
{ nproc; lscpu | grep -E "Model name|L2|L3|NUMA node0|Socket"; } > $OUT/host.txt
for s in 524288 1048576; do python3 benchmarks/h200/2026-12-04-c/profile/xcore.py $s; done | tee -a $OUT/host.txt
for mode in buf copy; do
  for nb in 1048576; do
    d=/dev/shm/prof-$mode; rm -rf $d; mkdir -p $d
    python3 benchmarks/h200/2026-12-04-c/profile/loop3.py 0 2 $nb ${STEPS:-3000} $mode $d > $OUT/p0-$mode.txt 2>&1 &
    python3 benchmarks/h200/2026-12-04-c/profile/loop3.py 1 2 $nb ${STEPS:-3000} $mode $d > $OUT/p1-$mode.txt 2>&1
    wait
    head -30 $OUT/p0-$mode.txt
  done
done
