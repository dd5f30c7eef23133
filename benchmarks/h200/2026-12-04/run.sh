#!/usr/bin/env bash
# After stop 18's fixes (device loss, empty buffers, failures told to peers, headers
# over 16 KiB, new sessions after a failure): on the H200 host (16 cores, NVIDIA
# Vulkan), the wgpu, protocol, buffers, fault and liveness tests, the wgpu example on 2
# and 4 ranks, then the step table, 100 buffers, and one buffer of 1 MiB in rounds.
# Each result is written to $OUT as soon as it exists, so a run cut short keeps them.
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__); [print(a.info) for a in wgpu.gpu.enumerate_adapters_sync()]"; } > $OUT/env.txt 2>&1
SECONDS=0
timeout 240 python3 -m pytest tests/test_wgpu_bridge.py tests/test_protocol.py tests/test_buffers.py \
  tests/test_faults.py tests/test_liveness.py -q -p no:cacheprovider -o addopts="" > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt; echo "tests: ${SECONDS} s"
for n in 2 4; do
  timeout 60 python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py > $OUT/example-$n.txt 2>&1; tail -2 $OUT/example-$n.txt
done
echo "examples: ${SECONDS} s"
timeout 120 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 64 256 --steps 15 --profile \
  --json $OUT/step.json > $OUT/step.txt 2>&1; cat $OUT/step.txt; echo "step: ${SECONDS} s"
timeout 50 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 --steps 9 --params 100 --profile \
  --json $OUT/step-params-100.json > $OUT/step-params-100.txt 2>&1; tail -8 $OUT/step-params-100.txt; echo "params: ${SECONDS} s"
timeout 130 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 --steps 200 --rounds 3 --profile \
  --json $OUT/rounds.json > $OUT/rounds.txt 2>&1; tail -12 $OUT/rounds.txt; echo "rounds: ${SECONDS} s"
