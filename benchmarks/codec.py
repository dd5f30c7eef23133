"""The compression codecs alone: ``Codec.encode`` and ``Codec.decode`` on one thread.

Per codec and size, the median over ``--repeats`` calls of encoding a float32 gradient
(normal values, a different scale per block) into preallocated scales and codes, and
of decoding them back into float32; GB/s counts the float32 side's bytes. Two numpy
passes timed in the same run are the peers: a plain copy of the same float32 array (the
ratio column divides by it) and ``np.copyto`` into float16 (``x.astype(np.float16)``
without the allocation) of unit-scale values (float16 subnormals take a slow path).
Whole tables repeat ``--rounds`` times.

Run: ``PYTHONPATH=$PWD/src python benchmarks/codec.py [--sizes 32768,65536,1048576,4194304]
[--codecs int8,bf16,fp16] [--repeats 21] [--rounds 1]``. Which gradsync it timed is
printed first: point PYTHONPATH at another tree to time that tree's codecs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial

import numpy as np
from timing import median_ms

from gradsync._step import codec as codec_module
from gradsync._step.codec import BLOCK, CODECS


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # pages touched, caches warm
    return median_ms(fn, repeats)


def _gradient(n: int, rng: np.random.Generator) -> np.ndarray:
    """Normal values whose scale changes from block to block, as a gradient's do."""
    x = rng.standard_normal(n, dtype=np.float32)
    per_block = np.float32(10.0) ** rng.uniform(-6, 0, -(-n // BLOCK)).astype(np.float32)
    x *= np.repeat(per_block, BLOCK)[:n]
    return x


def _row(name: str, op: str, n: int, ms: float, peer_ms: float | None) -> str:
    gbs = 4 * n / ms / 1e6
    ratio = "" if peer_ms is None else f"{ms / peer_ms:7.2f}"
    return f"{name:9} {op:7} {n:>9} {ms:9.3f} {gbs:7.2f} {ratio}"


def _table(codecs: list[str], sizes: list[int], repeats: int) -> None:
    rng = np.random.default_rng(0)
    print(f"{'codec':9} {'op':7} {'elements':>9} {'ms':>9} {'GB/s':>7} {'/copy':>7}")
    for n in sizes:
        x = _gradient(n, rng)
        half = np.empty(n, np.float16)
        copy = np.empty(n, np.float32)
        unit = rng.standard_normal(n, dtype=np.float32)  # float16 subnormals are slow
        astype = _median_ms(partial(np.copyto, half, unit, casting="unsafe"), repeats)
        peer = _median_ms(partial(np.copyto, copy, x), repeats)
        print(_row("numpy", "astype16", n, astype, peer))
        print(_row("numpy", "copy", n, peer, peer))
        for name in codecs:
            codec = CODECS[name]
            scales = np.empty(codec.scale_count(n), np.float32)
            codes = np.empty(n, codec.code)
            out = np.empty(n, np.float32)
            enc = _median_ms(partial(codec.encode, x, scales, codes), repeats)
            dec = _median_ms(partial(codec.decode, scales, codes, out), repeats)
            print(_row(name, "encode", n, enc, peer))
            print(_row(name, "decode", n, dec, peer))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="32768,65536,1048576,4194304")
    parser.add_argument("--codecs", default="int8,bf16,fp16")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    codecs = args.codecs.split(",")
    print(f"gradsync codecs from {codec_module.__file__}; numpy {np.__version__}")
    for r in range(args.rounds):
        print(f"round {r + 1}, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
        _table(codecs, sizes, args.repeats)


if __name__ == "__main__":
    main()
