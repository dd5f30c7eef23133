#!/usr/bin/env bash
# The session's final code (lifecycle changes in _api.py: a session holder with a
# finalizer, close() from signal handlers and other threads) on the H200: the wgpu,
# protocol, buffers, fault and liveness tests, and the wgpu example on 2 and 4 ranks.
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
{ date -u; nvidia-smi -L; nproc; python3 --version; } > $OUT/env-final.txt 2>&1
SECONDS=0
timeout 300 python3 -m pytest tests/test_wgpu_bridge.py tests/test_protocol.py tests/test_buffers.py \
  tests/test_faults.py tests/test_liveness.py -q -p no:cacheprovider -o addopts="" > $OUT/tests-final.txt 2>&1
tail -3 $OUT/tests-final.txt; echo "tests: ${SECONDS} s"
for n in 2 4; do
  timeout 60 python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py > $OUT/example-final-$n.txt 2>&1; tail -2 $OUT/example-final-$n.txt
done
