"""Data-parallel logistic regression whose gradients come from a WGSL compute shader.

Each rank holds its own shard of a synthetic data set on the GPU, computes the
gradient of the mean log-loss there, and gradsync averages the gradient buffers
across ranks once per step (in place, on the GPU buffers). Every rank then applies
the same SGD update, so the weights stay identical everywhere.

Run two ranks on this machine:

    gradsync launch --nproc 2 examples/train_wgpu_logreg.py --steps 20

or one rank without a launcher (with GRADSYNC_WORLD_SIZE and WORLD_SIZE unset,
a world of one rank, which needs no sync directory):

    python examples/train_wgpu_logreg.py --steps 5
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import wgpu

import gradsync

BU = wgpu.BufferUsage

SHADER = """
struct Cfg { n: u32, d: u32, lr: f32, pad: u32 }
@group(0) @binding(0) var<uniform> cfg: Cfg;
@group(0) @binding(1) var<storage, read> x: array<f32>;          // n*d, row-major
@group(0) @binding(2) var<storage, read> y: array<f32>;          // n, labels 0/1
@group(0) @binding(3) var<storage, read_write> w: array<f32>;    // d
@group(0) @binding(4) var<storage, read_write> b: array<f32>;    // 1
@group(0) @binding(5) var<storage, read_write> gw: array<f32>;   // d
@group(0) @binding(6) var<storage, read_write> gb: array<f32>;   // 1
@group(0) @binding(7) var<storage, read_write> loss: array<f32>; // 1
@group(0) @binding(8) var<storage, read_write> tmp: array<f32>;  // 2n: residual, loss

@compute @workgroup_size(64)
fn residual(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= cfg.n) { return; }
    var z = b[0];
    for (var j = 0u; j < cfg.d; j++) { z += x[i * cfg.d + j] * w[j]; }
    tmp[i] = 1.0 / (1.0 + exp(-z)) - y[i];
    // log(1 + exp(z)) - y z without overflow
    tmp[cfg.n + i] = max(z, 0.0) - z * y[i] + log(1.0 + exp(-abs(z)));
}

@compute @workgroup_size(64)
fn reduce(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    if (j > cfg.d + 1u) { return; }
    var s = 0.0;
    for (var i = 0u; i < cfg.n; i++) {
        if (j < cfg.d) { s += tmp[i] * x[i * cfg.d + j]; }
        else if (j == cfg.d) { s += tmp[i]; }
        else { s += tmp[cfg.n + i]; }
    }
    s /= f32(cfg.n);
    if (j < cfg.d) { gw[j] = s; } else if (j == cfg.d) { gb[0] = s; } else { loss[0] = s; }
}

@compute @workgroup_size(64)
fn sgd(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    if (j < cfg.d) { w[j] -= cfg.lr * gw[j]; } else if (j == cfg.d) { b[0] -= cfg.lr * gb[0]; }
}
"""


def make_shard(rank: int, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    true_w = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((n, d)).astype(np.float32)
    logits = x @ true_w + 0.5 * rng.standard_normal(n).astype(np.float32)
    return x, (logits > 0).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=1024, help="samples per rank")
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.5)
    args = ap.parse_args()

    # As gradsync launch (or torchrun) sets it; run directly, a world of one rank,
    # which needs no sync directory.
    env = dict(os.environ)
    if "GRADSYNC_WORLD_SIZE" not in env and "WORLD_SIZE" not in env:
        env.update(GRADSYNC_WORLD_SIZE="1", GRADSYNC_RANK="0")
    cfg = gradsync.FileGradSyncConfig.from_env(env)
    dev = gradsync.request_device_for_rank()  # LOCAL_RANK picks the adapter on multi-GPU hosts
    info = dev.adapter.info
    print(
        f"rank {cfg.rank} of {cfg.world_size}: adapter {info.get('device')!r} "
        f"({info.get('backend_type')}, {info.get('adapter_type')})",
        flush=True,
    )
    n, d = args.samples, args.features
    x, y = make_shard(cfg.rank, n, d)

    def buf(data: np.ndarray, usage: int, label: str) -> wgpu.GPUBuffer:
        return dev.create_buffer_with_data(data=data, usage=usage, label=label)

    rw = BU.STORAGE | BU.COPY_SRC | BU.COPY_DST
    meta = np.zeros(4, np.uint32)
    meta[0], meta[1] = n, d
    meta[2] = np.float32(args.lr).view(np.uint32)
    bufs = [
        buf(meta, BU.UNIFORM, "cfg"),
        buf(x.ravel(), BU.STORAGE, "x"),
        buf(y, BU.STORAGE, "y"),
        buf(np.zeros(d, np.float32), rw, "w"),
        buf(np.zeros(1, np.float32), rw, "b"),
        buf(np.zeros(d, np.float32), rw, "grad_w"),
        buf(np.zeros(1, np.float32), rw, "grad_b"),
        buf(np.zeros(1, np.float32), rw, "loss"),
        buf(np.zeros(2 * n, np.float32), BU.STORAGE, "tmp"),
    ]
    grad_w, grad_b, loss = bufs[5:8]

    entries = [
        {
            "binding": 0,
            "visibility": wgpu.ShaderStage.COMPUTE,
            "buffer": {"type": wgpu.BufferBindingType.uniform},
        },
        *(
            {
                "binding": i,
                "visibility": wgpu.ShaderStage.COMPUTE,
                "buffer": {
                    "type": wgpu.BufferBindingType.read_only_storage
                    if i in (1, 2)
                    else wgpu.BufferBindingType.storage
                },
            }
            for i in range(1, 9)
        ),
    ]
    bgl = dev.create_bind_group_layout(entries=entries)
    layout = dev.create_pipeline_layout(bind_group_layouts=[bgl])
    bind_group = dev.create_bind_group(
        layout=bgl,
        entries=[{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(bufs)],
    )
    module = dev.create_shader_module(code=SHADER)
    pipes = {
        name: dev.create_compute_pipeline(
            layout=layout, compute={"module": module, "entry_point": name}
        )
        for name in ("residual", "reduce", "sgd")
    }

    def run(*passes: tuple[str, int]) -> None:
        enc = dev.create_command_encoder()
        for name, threads in passes:
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipes[name])
            cp.set_bind_group(0, bind_group)
            cp.dispatch_workgroups((threads + 63) // 64)
            cp.end()
        dev.queue.submit([enc.finish()])

    for step in range(args.steps):
        run(("residual", n), ("reduce", d + 2))
        # The loss rides along with the gradients so every rank prints the global mean.
        gradsync.average_grads_file_sync([grad_w, grad_b, loss], dev, cfg, step)
        run(("sgd", d + 1))
        value = float(np.frombuffer(dev.queue.read_buffer(loss), np.float32)[0])
        print(f"rank {cfg.rank} step {step} loss {value:.6f}", flush=True)


if __name__ == "__main__":
    main()
