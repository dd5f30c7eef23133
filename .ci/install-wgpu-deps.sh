#!/usr/bin/env bash
# Install what wgpu-py needs for a software adapter on Debian 12, as root.
# Vulkan: lavapipe (mesa-vulkan-drivers) through the Vulkan loader (libvulkan1).
# OpenGL fallback: llvmpipe through EGL (libegl1, libegl-mesa0, libgl1-mesa-dri).
# Idempotent: does nothing (and needs no network) when all packages are present.
set -euo pipefail

packages=(libvulkan1 mesa-vulkan-drivers libegl1 libegl-mesa0 libgl1-mesa-dri)

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$p")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
