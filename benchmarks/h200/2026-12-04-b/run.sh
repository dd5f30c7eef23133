#!/usr/bin/env bash
# Stop 20's code on the H200 host (16 cores, NVIDIA Vulkan): the wgpu bridge's fixes (a
# per-buffer dtype None after float64 reused the float64 dtypes; an array among the
# buffers; one rank with check_finite; empty lists), readers that refuse FIFOs, failure
# notes left in the next call too. The wgpu, protocol, buffers, fault and liveness
# tests, the wgpu example on 2 and 4 ranks, one buffer of 1 MiB in three rounds of 200
# steps, and the step table at 1, 16 and 256 MiB. Eight files come back at most: each
# result is written to $OUT as soon as it exists, so a run cut short keeps them.
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__); [print(a.info) for a in wgpu.gpu.enumerate_adapters_sync()]"; } > $OUT/env.txt 2>&1
SECONDS=0
timeout 330 python3 -m pytest tests/test_wgpu_bridge.py tests/test_protocol.py tests/test_buffers.py \
  tests/test_faults.py tests/test_liveness.py -q -p no:cacheprovider -o addopts="" > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt; echo "tests: ${SECONDS} s"
for n in 2 4; do
  timeout 60 python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py > $OUT/example-$n.txt 2>&1; tail -2 $OUT/example-$n.txt
done
echo "examples: ${SECONDS} s"
timeout 130 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 --steps 200 --rounds 3 --profile \
  --json $OUT/rounds.json > $OUT/rounds.txt 2>&1; tail -12 $OUT/rounds.txt; echo "rounds: ${SECONDS} s"
timeout 70 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 256 --steps 9 \
  --json $OUT/step.json > $OUT/step.txt 2>&1; cat $OUT/step.txt; echo "step: ${SECONDS} s"
