#!/usr/bin/env bash
# After the bug-hunt fixes (device loss, empty buffers, failures told to peers, headers
# over 16 KiB, new sessions after a failure): the wgpu, protocol, buffers, fault and
# liveness tests on the H200 host (16 cores, NVIDIA Vulkan), then the example.
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__); [print(a.info) for a in wgpu.gpu.enumerate_adapters_sync()]"; } > $R/env.txt 2>&1
timeout 420 python3 -m pytest tests/test_wgpu_bridge.py tests/test_protocol.py tests/test_buffers.py \
  tests/test_faults.py tests/test_liveness.py -q -p no:cacheprovider -o addopts="" -x > $R/tests.txt 2>&1
tail -5 $R/tests.txt
for n in 2 4; do
  timeout 60 python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py > $R/example-$n.txt 2>&1; tail -2 $R/example-$n.txt
done
tar -C $R -cf "$OUT/tests.tar" .
cp $R/tests.txt $R/env.txt "$OUT/"
