#!/usr/bin/env bash
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 BACKEND=Vulkan
if ! python3 -c "import wgpu,sys; sys.exit(not any(a.info['backend_type']=='Vulkan' for a in wgpu.gpu.enumerate_adapters_sync()))"; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
{ date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$OUT/env.txt"
# Same-host A/B first (the host changes with every lease): map_sync vs _map_now.
for round in 1 2 3; do
  for mode in map_sync map_now; do
    echo "=== round $round: $mode"
    if [ $mode = map_sync ]; then export GS_MAP_SYNC=1; else unset GS_MAP_SYNC; fi
    timeout 60 python3 .exp/ab_map.py --world-sizes 2 4 --sizes-mib 1 --steps 40 --profile 2>&1 | grep -v "^$" | grep -v "MiB  naive"
  done
done 2>&1 | tee "$OUT/ab.txt"
unset GS_MAP_SYNC
timeout 150 python3 -m pytest tests/test_wgpu_bridge.py -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/tests.txt" | tail -3
for n in 2 4; do
  timeout 90 python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py 2>&1 | tee "$OUT/example-$n.txt" | tail -2
done
timeout 200 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 64 256 --steps 15 --profile \
  --json "$OUT/step.json" 2>&1 | tee "$OUT/step.txt"
timeout 100 python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 --steps 9 --params 100 --profile \
  --json "$OUT/step-params-100.json" 2>&1 | tee "$OUT/step-params-100.txt"
