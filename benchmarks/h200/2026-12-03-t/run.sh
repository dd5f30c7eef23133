#!/usr/bin/env bash
# Final-code run: wgpu tests, the example on 2 and 4 ranks, the step table, 1 MiB rounds.
set -uo pipefail
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__); [print(a.info) for a in wgpu.gpu.enumerate_adapters_sync()]"; } > $R/env.txt 2>&1
timeout 240 python3 -m pytest tests/test_wgpu_bridge.py tests/test_protocol.py tests/test_liveness.py -q -p no:cacheprovider -o addopts="" > $R/tests.txt 2>&1
tail -3 $R/tests.txt
for n in 2 4; do
  timeout 60 python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py > $R/example-$n.txt 2>&1; tail -2 $R/example-$n.txt
done
timeout 150 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 64 256 --steps 15 --profile \
  --json $R/step.json > $R/step.txt 2>&1; cat $R/step.txt
timeout 60 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 --steps 9 --params 100 --profile \
  --json $R/step-params-100.json > $R/step-params-100.txt 2>&1; cat $R/step-params-100.txt
timeout 150 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 --steps 200 --rounds 3 --profile \
  --json $R/rounds.json > $R/rounds.txt 2>&1; tail -12 $R/rounds.txt
tar -C $R -cf "$OUT/run.tar" .
cp $R/step.txt $R/rounds.txt $R/tests.txt "$OUT/"
