#!/usr/bin/env bash
# Stop 21's final code on the H200 host: after the per-param speed-ups of the step
# (validation in one pass, the gather's and publish's copies from the plan's segments,
# the reduce's own fetch by np.concatenate, check_finite in batches), which the GPU path
# shares (its mean reaches the buffers through the same pieces). The wgpu, protocol,
# buffers, fault and liveness tests; the wgpu example on 2 ranks; 1 MiB rounds.
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__)"; } > $OUT/env.txt 2>&1
SECONDS=0
timeout 330 python3 -m pytest tests/test_wgpu_bridge.py tests/test_protocol.py tests/test_buffers.py \
  tests/test_faults.py tests/test_liveness.py -q -p no:cacheprovider -o addopts="" > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt; echo "tests: ${SECONDS} s"
timeout 60 python3 -m gradsync launch --nproc 2 examples/train_wgpu_logreg.py > $OUT/example-2.txt 2>&1
tail -2 $OUT/example-2.txt; echo "example: ${SECONDS} s"
timeout 100 python3 benchmarks/wgpu_step.py --world-sizes 2 --sizes-mib 1 --steps 200 --rounds 3 --profile \
  > $OUT/rounds.txt 2>&1; tail -6 $OUT/rounds.txt; echo "rounds: ${SECONDS} s"
