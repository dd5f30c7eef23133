"""Gradient compression codecs: what a compressed file holds, encoded and decoded.

A run of ``n`` elements is encoded as blocks of ``BLOCK`` elements from its first
one: a float32 scale per block (none for bf16), then one code per element. Runs
start on block boundaries (shards are aligned to ``BLOCK``), so a shard of a run is
a contiguous range of its scales and codes. Everything is computed in float32:
float64 gradients are compressed from their float32 rounding. docs/compression.md
says what each codec keeps of a value, and what becomes of NaN and Inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["BLOCK", "CODECS", "Codec", "Compression", "codec_for"]

Compression = Literal["bf16", "fp16", "int8"]
BLOCK = 256
# Elements per chunk of an encode or decode: its temporaries stay in cache.
_CHUNK = 1 << 15
# Blocks whose largest finite magnitude is below this encode as zeros: their inverse
# scale would overflow float32.
_TINY = np.float32(2.0**-100)
# An int8 code meaning "not finite" (decoded as NaN); finite values use -127..127.
_INT8_NONFINITE = -128


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
        for a in range(0, len(x), _CHUNK):
            b = min(a + _CHUNK, len(x))
            part = x[a:b] if x.dtype == np.float32 else x[a:b].astype(np.float32)
            s = scales[a // BLOCK : -(-b // BLOCK)] if self.scaled else scales
            _ENCODERS[self.name](part, s, codes[a:b])

    def decode(self, scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
        """Decode ``codes`` (and their ``scales``) into the float array ``out``."""
        buf = None if out.dtype == np.float32 else np.empty(min(_CHUNK, len(out)), np.float32)
        for a in range(0, len(out), _CHUNK):
            b = min(a + _CHUNK, len(out))
            dst = out[a:b] if buf is None else buf[: b - a]
            s = scales[a // BLOCK : -(-b // BLOCK)] if self.scaled else scales
            _DECODERS[self.name](s, codes[a:b], dst)
            if buf is not None:
                np.copyto(out[a:b], dst, casting="unsafe")


def _blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``x`` as rows of ``BLOCK`` elements, and its last partial block (or None)."""
    full = len(x) // BLOCK * BLOCK
    return x[:full].reshape(-1, BLOCK), (x[full:] if full < len(x) else None)


def _amax(x: np.ndarray) -> np.ndarray:
    """The largest finite magnitude of each block of ``x`` (0 for a block of none)."""
    rows, tail = _blocks(np.abs(x))
    parts = [np.max(rows, axis=1)] if len(rows) else []
    if tail is not None:
        parts.append(np.max(tail, keepdims=True))
    amax = np.concatenate(parts) if len(parts) > 1 else parts[0]
    bad = ~np.isfinite(amax)
    if bad.any():
        for k in np.flatnonzero(bad):
            block = np.abs(x[k * BLOCK : (k + 1) * BLOCK])
            finite = block[np.isfinite(block)]
            amax[k] = finite.max() if finite.size else 0
    return amax


def _per_element(x: np.ndarray, per_block: np.ndarray) -> np.ndarray:
    """``x`` multiplied by its block's factor from ``per_block``."""
    rows, tail = _blocks(x)
    out = np.empty_like(x)
    full = rows.size
    np.multiply(rows, per_block[: len(rows), None], out=out[:full].reshape(rows.shape))
    if tail is not None:
        np.multiply(tail, per_block[-1], out=out[full:])
    return out


def _encode_int8(x: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> None:
    amax = _amax(x)
    small = amax < _TINY
    with np.errstate(divide="ignore"):
        inv = np.where(small, np.float32(0), np.float32(127) / amax).astype(np.float32)
    scaled = _per_element(x, inv)
    with np.errstate(invalid="ignore"):
        np.rint(scaled, out=scaled)
        finite = np.isfinite(scaled)
        whole = bool(finite.all())
        if not whole:
            scaled[~finite] = _INT8_NONFINITE
        codes[:] = scaled.astype(np.int8)
    np.divide(amax, np.float32(127), out=scales)
    scales[small] = 0
    if not whole:
        # A negative scale marks a block holding a non-finite element.
        rows = np.flatnonzero(~finite) // BLOCK
        scales[rows] = np.copysign(scales[rows], -1)


def _decode_int8(scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, codes, casting="unsafe")
    magnitude = np.abs(scales)
    rows, tail = _blocks(out)
    np.multiply(rows, magnitude[: len(rows), None], out=rows)
    if tail is not None:
        np.multiply(tail, magnitude[-1], out=tail)
    flagged = np.flatnonzero(np.signbit(scales))
    for k in flagged:
        block = slice(k * BLOCK, (k + 1) * BLOCK)
        out[block][codes[block] == _INT8_NONFINITE] = np.nan


def _encode_fp16(x: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> None:
    amax = _amax(x)
    # A power of two putting the block's largest value in [2^14, 2^15): exact to apply,
    # and far below float16's largest, 65504.
    _, exp = np.frexp(np.maximum(amax, _TINY))
    np.ldexp(np.float32(1), exp - 15, out=scales)
    inv = np.ldexp(np.float32(1), 15 - exp).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        codes[:] = _per_element(x, inv).astype(np.float16)


def _decode_fp16(scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, codes)
    rows, tail = _blocks(out)
    with np.errstate(invalid="ignore"):
        np.multiply(rows, scales[: len(rows), None], out=rows)
        if tail is not None:
            np.multiply(tail, scales[-1], out=tail)


def _encode_bf16(x: np.ndarray, _scales: np.ndarray, codes: np.ndarray) -> None:
    bits = x.view(np.uint32)
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, keep the top half.
    up = bits >> 16
    up &= 1
    up += 0x7FFF
    up += bits
    up >>= 16
    codes[:] = up
    nan = np.isnan(x)
    if nan.any():
        # Rounding a NaN's bits can carry into Inf or the sign: keep a quiet NaN.
        codes[nan] = (bits[nan] >> 16) | 0x7FC0


def _decode_bf16(_scales: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    bits = out.view(np.uint32)
    np.copyto(bits, codes)
    bits <<= 16


_ENCODERS = {"int8": _encode_int8, "fp16": _encode_fp16, "bf16": _encode_bf16}
_DECODERS = {"int8": _decode_int8, "fp16": _decode_fp16, "bf16": _decode_bf16}

CODECS: dict[str, Codec] = {
    "bf16": Codec("bf16", np.dtype(np.uint16), scaled=False),
    "fp16": Codec("fp16", np.dtype(np.float16), scaled=True),
    "int8": Codec("int8", np.dtype(np.int8), scaled=True),
}


def codec_for(name: str | None) -> Codec | None:
    """The codec called ``name`` (None: no compression)."""
    return None if name is None else CODECS[name]
