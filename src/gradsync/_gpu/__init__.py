"""GPU buffers through wgpu: the bridge between device and host memory."""
