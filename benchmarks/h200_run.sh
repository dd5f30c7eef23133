#!/usr/bin/env bash
# The real-GPU run (issue 3), as made on the lent NVIDIA H200: wgpu tests, the wgpu
# example on 2 and 4 ranks sharing the GPU, the copy/step benchmarks (step: threads
# auto and 1), and the host-only allreduce benchmark on that 16-core host. The GPU
# machine has Python 3.12 and numpy but no network, so two git-ignored folders travel
# with the checkout, prepared on a machine with one:
#   .whl/  wgpu's wheels: python3 -m pip download --no-deps --only-binary=:all:
#          --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#          --platform manylinux2014_x86_64 -d .whl wgpu==0.32.0 cffi pycparser rendercanvas
#   .gl/   the Vulkan/GL loaders: apt-get download libvulkan1 libegl1 libglvnd0 libopengl0
#          libgl1 libglx0 libgles2 (amd64), unpacked into / below.
set -uo pipefail
OUT=${OUT:-/tmp/gradsync-h200}
mkdir -p "$OUT"
source benchmarks/h200_env.sh  # loaders, wgpu wheels, Vulkan driver
{
  date -u; nvidia-smi -L; nproc; python3 --version
  python3 -c "import wgpu, numpy; print('wgpu', wgpu.__version__, 'numpy', numpy.__version__); [print(a.info) for a in wgpu.gpu.enumerate_adapters_sync()]"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest tests/test_wgpu_bridge.py -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/tests.txt" | tail -15
for n in 2 4; do
  python3 -m gradsync launch --nproc $n examples/train_wgpu_logreg.py 2>&1 | tee "$OUT/example-$n.txt" | tail -6
done
[ -n "${SKIP_COPY:-}" ] || python3 benchmarks/wgpu_copy.py --sizes-mib 1 16 256 --repeats 7 --backend Vulkan 2>&1 | tee "$OUT/copy.txt"
# gradsync's step with its default threads (CPUs / ranks on the host) and with one.
for t in auto 1; do
  python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 64 256 --steps 9 --threads $t --profile \
    --json "$OUT/step-threads-$t.json" 2>&1 | tee "$OUT/step-threads-$t.txt"
done
# The same gradients split over 100 buffers a rank (per-buffer costs: probe, copy commands).
python3 benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 --steps 9 --params 100 --profile \
  --json "$OUT/step-params-100.json" 2>&1 | tee "$OUT/step-params-100.txt"
# The host exchange alone on this many-core host (no GPU): threads auto against 1, with
# and without buffers_like arrays.
peers=gradsync,memcpy
python3 -c "import torch" 2>/dev/null && peers=$peers,gloo
python3 benchmarks/allreduce.py --world-sizes 2,4 --dirs tmpfs --peers $peers --threads auto,1 --buffers \
  --workloads 4KiB,1MiB,16MiB,64MiB,100x16MiB --steps 20 --small-steps 100 \
  --json "$OUT/allreduce.json" 2>&1 | tee "$OUT/allreduce.txt"
