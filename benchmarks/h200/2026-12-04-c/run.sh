#!/usr/bin/env bash
# Stop 21's code on the H200 host (16 cores, NVIDIA Vulkan): the wgpu bridge keyed by the
# buffers' identity (not GPUBuffer.uid, wgpu-py >= 0.30 only) and its polled waits calling
# device._poll() with no argument (wgpu-py 0.27-0.28 take none); a rank's own bad-buffer
# error names its step. The wgpu, protocol, buffers, fault and liveness tests with wgpu-py
# 0.32; the wgpu tests again with wgpu-py 0.27.0 (the new floor, never run on a real GPU);
# the wgpu example on 2 and 4 ranks; one 1 MiB buffer in three rounds of 200 steps; the
# step table at 1, 16 and 256 MiB. Each result is written to $OUT as soon as it exists.
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu 0.32 wheels into /tmp/site, Vulkan driver
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__); [print(a.info) for a in wgpu.gpu.enumerate_adapters_sync()]"; } > $OUT/env.txt 2>&1
SECONDS=0
timeout 330 python3 -m pytest tests/test_wgpu_bridge.py tests/test_protocol.py tests/test_buffers.py \
  tests/test_faults.py tests/test_liveness.py -q -p no:cacheprovider -o addopts="" > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt; echo "tests: ${SECONDS} s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site27 \
  .whl27/*.whl .whl/cffi-*.whl .whl/pycparser-*.whl
PYTHONPATH=/tmp/site27:$PWD/src timeout 120 python3 -c "import wgpu; print('wgpu', wgpu.__version__)" > $OUT/wgpu027.txt 2>&1
PYTHONPATH=/tmp/site27:$PWD/src timeout 120 python3 -m pytest tests/test_wgpu_bridge.py -q -p no:cacheprovider \
  -o addopts="" >> $OUT/wgpu027.txt 2>&1
tail -2 $OUT/wgpu027.txt; echo "wgpu 0.27 tests: ${SECONDS} s"
for n in 2 4; do
  timeout 60 python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py > $OUT/example-$n.txt 2>&1; tail -2 $OUT/example-$n.txt
done
echo "examples: ${SECONDS} s"
timeout 130 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 --steps 200 --rounds 3 --profile \
  --json $OUT/rounds.json > $OUT/rounds.txt 2>&1; tail -12 $OUT/rounds.txt; echo "rounds: ${SECONDS} s"
timeout 70 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 256 --steps 9 \
  > $OUT/step.txt 2>&1; cat $OUT/step.txt; echo "step: ${SECONDS} s"
