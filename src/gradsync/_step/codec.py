"""Gradient compression codecs: what a compressed file holds, encoded and decoded.

A run of ``n`` elements is encoded as blocks of ``BLOCK`` elements from its first
one: a float32 scale per block (none for bf16), then one code per element. Runs
start on block boundaries (shards are aligned to ``BLOCK``), so a shard of a run is
a contiguous range of its scales and codes. Everything is computed in float32:
float64 gradients are compressed from their float32 rounding. docs/compression.md
says what each codec keeps of a value, and what becomes of NaN and Inf.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["BLOCK", "CODECS", "Codec", "Compression", "codec_for"]

Compression = Literal["bf16", "fp16", "int8"]
BLOCK = 256
# Elements per chunk of an encode or decode (a multiple of BLOCK): its temporaries
# stay in cache.
_CHUNK = 1 << 16
# Blocks whose largest finite magnitude is below this encode as zeros: their inverse
# scale would overflow float32.
_TINY = np.float32(2.0**-100)
# An int8 code meaning "not finite" (decoded as NaN); finite values use -127..127.
_INT8_NONFINITE = -128
# float32 bits at and above this (magnitude) are Inf or NaN.
_INF_BITS = 0x7F800000
# Finite float32 magnitudes from here up round to Inf as bfloat16 (bits 0x7F7F8000).
_BF16_OVER = np.uint32(0x7F7F8000).view(np.float32)
# float32's largest finite value: where a finite code times its scale saturates.
_F32_MAX = np.finfo(np.float32).max
# int8 scales from here up may carry a code past _F32_MAX (127 * 2^121 is below it).
_INT8_TOP = np.float32(2.0**121)
# fp16's scale of blocks from 2^127 up: their code 2^15 times it is 2^128, past _F32_MAX.
_FP16_TOP = np.float32(2.0**113)
# Their bits: as integers, flagged (negative) scales' bits lie above every positive one's.
_INT8_TOP_BITS = int(_INT8_TOP.view(np.uint32))
_FP16_TOP_BITS = int(_FP16_TOP.view(np.uint32))
# 1.5 * 2^23: a float32 in [2^23, 2^24) is an integer, with 1 between neighbours.
_ROUNDER = np.float32(1.5 * 2**23)
_kept = threading.local()
# Where the blocks of a chunk start.
_STARTS = np.arange(0, _CHUNK, BLOCK)
_PAGE = 4096


@dataclass(frozen=True)
class Codec:
    """One compression scheme: its code dtype and whether blocks carry a scale."""

    name: str
    code: np.dtype[Any]
    scaled: bool

    def scale_count(self, n: int) -> int:
        """Scales of a run of ``n`` elements."""
        return -(-n // BLOCK) if self.scaled else 0

    def compresses(self, dtype: np.dtype[Any]) -> bool:
        """Whether gradients of ``dtype`` are compressed (else they pass through as they
        are: float16 under bf16 or fp16, which would not shrink them)."""
        return dtype.itemsize > self.code.itemsize

    def encode(self, x: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> None:
        """Encode the float array ``x`` into ``scales`` (float32) and ``codes``."""
        full = len(x) // BLOCK * BLOCK
        encoder, count = _ENCODERS[self.name]
        cast = int(x.dtype != np.float32)
        # The float32 copy of x where it is not float32, then the encoder's scratch.
        arrays = _scratch(cast + count, min(_CHUNK, max(full, BLOCK)) // BLOCK, x)
        with np.errstate(all="ignore"):
            for a in range(0, full, _CHUNK):
                b = min(a + _CHUNK, full)
                rows = x[a:b].reshape(-1, BLOCK)
                if cast:
                    np.copyto(arrays[0][: len(rows)], rows, casting="same_kind")
                    rows = arrays[0][: len(rows)]
                s = scales[a // BLOCK : b // BLOCK] if self.scaled else scales
                work = [w[: len(rows)] for w in arrays[cast:]]
                encoder(rows, s, codes[a:b].reshape(-1, BLOCK), work)
            if full < len(x):
                # The last, partial block: padded with zeros, which change no scale.
                tail = np.zeros((1, BLOCK), np.float32)
                tail[0, : len(x) - full] = x[full:]
                out = np.empty((1, BLOCK), self.code)
                s = scales[full // BLOCK :] if self.scaled else scales
                encoder(tail, s, out, [w[:1] for w in arrays[cast:]])
                codes[full:] = out[0, : len(x) - full]

    def decode(self, scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
        """Decode ``codes`` (and their ``scales``) into the float array ``out``."""
        full = len(out) // BLOCK * BLOCK
        decoder = _DECODERS[self.name]
        cast = None if out.dtype == np.float32 else _scratch(1, _CHUNK // BLOCK, out)[0]
        with np.errstate(all="ignore"):
            for a in range(0, full, _CHUNK):
                b = min(a + _CHUNK, full)
                rows = codes[a:b].reshape(-1, BLOCK)
                dst = out[a:b].reshape(-1, BLOCK) if cast is None else cast[: len(rows)]
                decoder(scales[a // BLOCK : b // BLOCK] if self.scaled else scales, rows, dst)
                if cast is not None:
                    np.copyto(out[a:b], dst.reshape(-1), casting="unsafe")
            if full < len(out):
                padded = np.zeros((1, BLOCK), self.code)
                padded[0, : len(out) - full] = codes[full:]
                dst = np.empty((1, BLOCK), np.float32)
                decoder(scales[full // BLOCK :] if self.scaled else scales, padded, dst)
                np.copyto(out[full:], dst[0, : len(out) - full], casting="unsafe")


def _scratch(count: int, rows: int, near: np.ndarray) -> list[np.ndarray]:
    """``count`` float32 arrays of ``rows`` blocks, kept by this thread from call to
    call (fresh pages cost a fault each; a codec call holds one scratch at a time).
    Each starts 1 KiB on (mod 4 KiB) from the one before, the first from ``near``:
    streams whose addresses agree mod 4 KiB stall each other (4K aliasing)."""
    key = (count, rows, near.ctypes.data % _PAGE)
    kept: dict[tuple[int, int, int], list[np.ndarray]] = getattr(_kept, "arrays", {})
    if key in kept:
        return kept[key]
    size = rows * BLOCK * 4
    buf: np.ndarray | None = getattr(_kept, "scratch", None)
    if buf is None or len(buf) < count * (size + _PAGE):
        buf = _kept.scratch = np.empty(count * (size + _PAGE), np.uint8)
        kept = {}
    elif len(kept) >= 32:
        kept = {}
    _kept.arrays = kept
    base, at, start = buf.ctypes.data, key[2], 0
    arrays = []
    for _ in range(count):
        at = -(-(at + 1024) // 64) * 64
        start += (at - base - start) % _PAGE
        arrays.append(buf[start : start + size].view(np.float32).reshape(rows, BLOCK))
        at, start = base + start, start + size
    kept[key] = arrays
    return arrays


def _amax(rows: np.ndarray, work: np.ndarray) -> tuple[np.ndarray, bool]:
    """The largest finite magnitude of each row (0 for a row of none), and whether
    every element is finite. Overwrites ``work``."""
    # From the bits: finite magnitudes order as their integers do; Inf and NaN lie above.
    magnitude = np.bitwise_and(rows.view(np.uint32), 0x7FFFFFFF, out=work.view(np.uint32))
    # reduceat: the maximum per row, with less overhead per row than max(axis=1).
    top = np.maximum.reduceat(magnitude.reshape(-1), _STARTS[: len(rows)])
    bad = top >= _INF_BITS
    if not bad.any():
        return top.view(np.float32), True
    for k in np.flatnonzero(bad):
        finite = magnitude[k][magnitude[k] < _INF_BITS]
        top[k] = finite.max() if finite.size else 0
    return top.view(np.float32), False


def _flag(scales: np.ndarray, rows: np.ndarray) -> None:
    """Mark the rows holding a non-finite element by a negative scale."""
    marked = ~np.isfinite(rows).all(axis=1)
    scales[marked] = np.copysign(scales[marked], -1)


def _encode_int8(
    rows: np.ndarray, scales: np.ndarray, codes: np.ndarray, work: list[np.ndarray]
) -> None:
    amax, finite = _amax(rows, work[0])
    small = amax < _TINY
    inv = np.float32(127) / amax
    inv[small] = 0
    # einsum: the broadcast multiply, with less overhead per row. It turns a -0.0
    # product into 0.0, the same code.
    scaled = np.einsum("ij,i->ij", rows, inv, out=work[0])
    # rint and the cast in one pass: the sum rounds to an integer, ties to even as rint
    # does, and the low byte of its bits (all the cast keeps) is the code.
    scaled += _ROUNDER
    np.copyto(codes, scaled.view(np.int32), casting="unsafe")
    np.divide(amax, np.float32(127), out=scales)
    scales[small] = 0
    if not finite:
        codes[~np.isfinite(scaled)] = _INT8_NONFINITE
        _flag(scales, rows)


def _decode_int8(scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    # Converted, then scaled in place: the mixed-type multiply's buffering costs ~20% more.
    np.copyto(out, codes)
    # One reduction rules out both rare cases: flagged blocks and scales near overflow.
    if scales.view(np.uint32).max() < _INT8_TOP_BITS:
        out *= scales[:, None]
        return
    magnitude = np.abs(scales)
    out *= magnitude[:, None]
    _saturate(out, codes, magnitude >= _INT8_TOP)
    for k in np.flatnonzero(np.signbit(scales)):
        out[k][codes[k] == _INT8_NONFINITE] = np.nan


def _encode_fp16(
    rows: np.ndarray, scales: np.ndarray, codes: np.ndarray, work: list[np.ndarray]
) -> None:
    amax, finite = _amax(rows, work[0])
    # A power of two putting the block's largest value in [2^14, 2^15): exact to apply,
    # and far below float16's largest, 65504.
    _, exp = np.frexp(np.maximum(amax, _TINY))
    np.ldexp(np.float32(1), exp - 15, out=scales)
    inv = np.ldexp(np.float32(1), 15 - exp).astype(np.float32)
    scaled = np.multiply(rows, inv[:, None], out=work[0])  # not einsum: -0.0 stays -0.0
    if finite:
        _float16_bits(scaled, codes.view(np.uint16), work[1:])
        return
    bad = ~np.isfinite(scaled)
    nonfinite = scaled[bad].astype(np.float16)
    _float16_bits(scaled, codes.view(np.uint16), work[1:])
    codes[bad] = nonfinite
    _flag(scales, rows)


def _float16_bits(x: np.ndarray, out: np.ndarray, spare: list[np.ndarray]) -> None:
    """float32 ``x`` (finite, below 2^15 in magnitude) as float16 bits in ``out``,
    rounded to nearest even; magnitudes below float16's smallest normal become 0.
    Overwrites ``x`` and the two arrays of ``spare``."""
    bits = x.view(np.uint32)
    sign = np.right_shift(bits, 16, out=spare[0].view(np.uint32))
    sign &= 0x8000
    bits &= 0x7FFFFFFF
    up = np.right_shift(bits, 13, out=spare[1].view(np.uint32))
    up &= 1
    up += 0xFFF
    bits += up
    bits >>= 13
    # float32's exponent bias is 127, float16's 15: 112 << 10 apart.
    half = bits.view(np.int32)
    half -= 112 << 10
    half *= half >= 1 << 10  # under float16's smallest normal (2^-14): 0
    half |= sign.view(np.int32)
    np.copyto(out, half, casting="unsafe")


def _decode_fp16(scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    # Sign-extended and shifted, the bits are a float32's with the float16's sign,
    # exponent and fraction, and three stray ones under the sign to clear.
    np.copyto(out.view(np.int32), codes.view(np.int16))
    bits = out.view(np.uint32)
    bits <<= 13
    bits &= 0x8FFFFFFF
    # Those bits as a float32, times 2^112, are the float16's value (zero stays zero).
    out *= np.float32(2.0**112)
    magnitude = np.abs(scales)
    out *= magnitude[:, None]
    # One reduction rules out both rare cases: flagged blocks and the top scale.
    if scales.view(np.uint32).max() < _FP16_TOP_BITS:
        return
    for k in np.flatnonzero(np.signbit(scales)):
        out[k] = codes[k].astype(np.float32) * -scales[k]
    _saturate(out, codes, magnitude >= _FP16_TOP)


def _saturate(out: np.ndarray, codes: np.ndarray, rows: np.ndarray) -> None:
    """In the ``rows`` (a mask) of ``out``, finite codes whose product with the scale
    overflowed to Inf become float32's largest, with their sign: finite stays finite."""
    for k in np.flatnonzero(rows):
        row = out[k]
        over = np.isinf(row) & np.isfinite(codes[k])
        row[over] = np.copysign(_F32_MAX, row[over])


def _encode_bf16(
    rows: np.ndarray, _scales: np.ndarray, codes: np.ndarray, work: list[np.ndarray]
) -> None:
    bits = rows.view(np.uint32)
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, keep the top half.
    up = np.right_shift(bits, 16, out=work[0].view(np.uint32))
    up &= 1
    up += 0x7FFF
    up += bits
    up >>= 16
    np.copyto(codes, up, casting="unsafe")
    # Reductions read without writing; the least element is NaN where any is.
    lo = np.minimum.reduce(rows, axis=None)
    if math.isnan(lo) or lo <= -_BF16_OVER or np.maximum.reduce(rows, axis=None) >= _BF16_OVER:
        nan = np.isnan(rows)
        # Rounding a NaN's bits can carry into Inf or the sign: keep a quiet NaN.
        codes[nan] = (bits[nan] >> 16) | 0x7FC0
        # Finite values that would round to Inf keep bfloat16's largest, with their sign.
        over = np.isfinite(rows) & (np.abs(rows) >= _BF16_OVER)
        codes[over] = (bits[over] >> 16) & 0x8000 | 0x7F7F


def _decode_bf16(_scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    bits = out.view(np.uint32)
    np.copyto(bits, codes)
    bits <<= 16


# Each encoder, and how many float32 scratch arrays the size of its rows it takes
# (``work``, whose contents it may overwrite).
_ENCODERS = {"int8": (_encode_int8, 1), "fp16": (_encode_fp16, 3), "bf16": (_encode_bf16, 1)}
_DECODERS = {"int8": _decode_int8, "fp16": _decode_fp16, "bf16": _decode_bf16}

CODECS: dict[str, Codec] = {
    "bf16": Codec("bf16", np.dtype(np.uint16), scaled=False),
    "fp16": Codec("fp16", np.dtype(np.float16), scaled=True),
    "int8": Codec("int8", np.dtype(np.int8), scaled=True),
}


def codec_for(name: str | None) -> Codec | None:
    """The codec called ``name`` (None: no compression)."""
    return None if name is None else CODECS[name]
