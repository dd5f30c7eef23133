# Sourced by the H200 run scripts (bash, from the repository root): unpacks the Vulkan
# and GL loaders of .gl/, installs wgpu's wheels of .whl/ into /tmp/site (see
# h200_run.sh for how both folders are made), and points Vulkan at the NVIDIA driver
# where the loader does not find it by itself.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 BACKEND=Vulkan
if ! python3 -c "import wgpu,sys; sys.exit(not any(a.info['backend_type']=='Vulkan' for a in wgpu.gpu.enumerate_adapters_sync()))"; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
