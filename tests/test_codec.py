"""The codecs against a plain reference: the same scales, codes and decoded floats, byte
for byte, over random and special inputs (NaN payloads, +-Inf, -0.0, subnormals, blocks
under 2^-100, ties, partial last blocks, float16/float32/float64 inputs). The reference
is the codecs' definition written for clarity, not speed (docs/compression.md): a faster
codec must not change a byte."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gradsync._step.codec import BLOCK, CODECS

TINY = np.float32(2.0**-100)
# float16's smallest normal, 2^-14, less half a unit of float32's 11 leading bits there:
# magnitudes from here up round to a float16 normal, those below become zero.
F16_FLOOR = np.float32(2.0**-14 - 2.0**-26)


def _blocks(x: np.ndarray) -> np.ndarray:
    """``x`` as float32, padded with zeros to whole blocks, one block a row."""
    padded = np.zeros(-(-len(x) // BLOCK) * BLOCK, np.float32)
    with np.errstate(over="ignore"):
        padded[: len(x)] = x  # float64 beyond float32's range: Inf
    return padded.reshape(-1, BLOCK)


def _finite_amax(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each block's largest finite magnitude (0 for none), and whether it holds a NaN or Inf."""
    finite = np.isfinite(rows)
    amax = np.where(finite, np.abs(rows), np.float32(0)).max(axis=1)
    return amax, ~finite.all(axis=1)


def ref_encode(name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scales, codes) of ``x`` as the codec ``name`` defines them."""
    rows = _blocks(x)
    with np.errstate(all="ignore"):
        if name == "bf16":
            scales, codes = np.zeros(0, np.float32), _ref_bf16(rows)
        else:
            amax, flagged = _finite_amax(rows)
            ref = _ref_int8 if name == "int8" else _ref_fp16
            scales, codes = ref(rows, amax)
            scales[flagged] = -scales[flagged]  # a negative scale marks a block with NaN or Inf
    return scales, codes.ravel()[: len(x)]


def _ref_int8(rows: np.ndarray, amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    small = amax < TINY
    inv = np.where(small, np.float32(0), np.float32(127) / amax).astype(np.float32)
    q = np.rint(rows * inv[:, None])
    codes = np.where(np.isfinite(q), q, -128).astype(np.int8)
    scales = np.where(small, np.float32(0), amax / np.float32(127)).astype(np.float32)
    return scales, codes


def _ref_fp16(rows: np.ndarray, amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _, exp = np.frexp(np.maximum(amax, TINY))
    scales = np.ldexp(np.float32(1), exp - 15).astype(np.float32)
    scaled = rows * np.ldexp(np.float32(1), 15 - exp).astype(np.float32)[:, None]
    kept = np.where(np.abs(scaled) >= F16_FLOOR, scaled, np.float32(0))
    magnitude = np.abs(kept).astype(np.float16)
    half = np.where(np.signbit(scaled), -magnitude, magnitude)
    codes = np.where(np.isfinite(scaled), half, scaled.astype(np.float16))
    return scales, codes


def _ref_bf16(rows: np.ndarray) -> np.ndarray:
    bits = rows.view(np.uint32).astype(np.uint64)
    high, low = bits >> 16, bits & 0xFFFF
    up = (low > 0x8000) | ((low == 0x8000) & (high & 1 == 1))
    nan = np.isnan(rows)
    # A finite value past bfloat16's largest (3.3895e38) saturates to it, sign kept.
    over = np.isfinite(rows) & ((high + up) & 0x7FFF == 0x7F80)
    return np.where(nan, high | 0x7FC0, np.where(over, high | 0x7F7F, high + up)).astype(np.uint16)


def ref_decode(name: str, scales: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    """The float32 values of ``n`` elements encoded as (scales, codes)."""
    padded = np.zeros(-(-n // BLOCK) * BLOCK, codes.dtype)
    padded[:n] = codes
    rows = padded.reshape(-1, BLOCK)
    if name == "bf16":
        return (rows.astype(np.uint32) << 16).view(np.float32).ravel()[:n]
    with np.errstate(all="ignore"):
        out = rows.astype(np.float32) * np.abs(scales)[:, None]
        # A finite code whose product overflows saturates at float32's largest, sign kept.
        top = np.finfo(np.float32).max
        out = np.where(np.isfinite(rows), np.clip(out, -top, top), out)
        if name == "int8":
            out[np.signbit(scales)[:, None] & (rows == -128)] = np.nan
    return out.ravel()[:n]


def _special_blocks(rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Blocks of float32 values that stress the rounding and the non-finite paths."""
    f32 = np.float32
    nans = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFF800001, 0xFFC00000], np.uint32)
    yield np.zeros(BLOCK, f32)
    yield np.full(BLOCK, -0.0, f32)
    yield np.where(rng.random(BLOCK) < 0.5, f32(-0.0), f32(0.0))
    halves = (np.arange(BLOCK, dtype=f32) - 128) * f32(0.5)
    halves[0] = 127  # int8 ties: a scale of 1, codes of k + 0.5
    yield halves
    yield (np.arange(BLOCK, dtype=f32) - 128) + f32(0.5)
    for at in (TINY, np.nextafter(TINY, f32(0)), np.nextafter(TINY, f32(1))):
        block = rng.uniform(-1, 1, BLOCK).astype(f32) * at  # around the 2^-100 threshold
        block[5] = -at
        yield block
    yield rng.integers(1, 1 << 23, BLOCK, dtype=np.uint32).view(f32)  # float32 subnormals
    yield np.float32(3e38) * rng.uniform(-1, 1, BLOCK).astype(f32)
    top = np.full(BLOCK, np.finfo(f32).max) * np.sign(rng.uniform(-1, 1, BLOCK)).astype(f32)
    yield top
    # fp16: scaled past 32752 they round to 2^15, and 2^15 times 2^113 overflows
    yield top * (1 - rng.uniform(0, 2.0**-11, BLOCK)).astype(f32)
    for bad in (np.nan, np.inf):  # near float32's largest in a flagged block
        block = top.copy()
        block[rng.integers(0, BLOCK, 3)] = bad
        yield block
    ties = (rng.integers(0, 1 << 16, BLOCK, dtype=np.uint32) << 16) | 0x8000  # bf16 ties
    yield (ties & 0xBFFFFFFF).view(f32)
    for bad in (np.nan, np.inf, -np.inf, *nans.view(f32)):
        block = rng.standard_normal(BLOCK).astype(f32)
        block[rng.integers(0, BLOCK, 3)] = bad
        yield block
        yield np.full(BLOCK, bad, f32)
    block = np.zeros(BLOCK, f32)
    block[7], block[9] = np.inf, f32(1e-30)  # Inf beside a tiny block
    yield block
    # fp16: magnitudes around float16's smallest normal once scaled (amax 2^14.5)
    block = f32(2.0**-14) * (1 + rng.uniform(-(2.0**-10), 2.0**-10, BLOCK)).astype(f32)
    block[0] = f32(2.0**14.5)
    yield block
    bits = rng.integers(0, 1 << 32, BLOCK, dtype=np.uint64).astype(np.uint32)
    yield bits.view(f32)  # any bit pattern at all


def _inputs() -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(27)
    blocks = list(_special_blocks(rng))
    special = np.concatenate(blocks)
    # A chunk holding a NaN or Inf may take another path than one without.
    yield "special finite blocks", np.concatenate([b for b in blocks if np.isfinite(b).all()])
    scales = np.float32(10.0) ** rng.uniform(-44, 38, 700).astype(np.float32)
    wide = rng.standard_normal(700 * BLOCK).astype(np.float32) * np.repeat(scales, BLOCK)
    wide[rng.integers(0, len(wide), 40)] = np.nan
    yield "special", special
    yield "special, one short of whole blocks", special[:-1]
    yield "wide scales, three chunks and more", np.concatenate([wide] * 2)[: (3 << 16) + 77]
    for n in (1, 5, BLOCK - 1, BLOCK, BLOCK + 1):
        yield f"{n} elements", rng.standard_normal(n).astype(np.float32)
    yield "float16", (rng.standard_normal(3000) * 100).astype(np.float16)
    float64 = rng.standard_normal(3000) * 10.0 ** rng.uniform(-60, 60, 3000)
    float64[[3, 500, 2000]] = [np.nan, np.inf, 1e300]
    yield "float64", float64
    yield "strided", np.repeat(special, 2)[::2]


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
def test_encode_and_decode_give_the_reference_bytes(name: str) -> None:
    codec = CODECS[name]
    for label, x in _inputs():
        scales = np.full(codec.scale_count(len(x)), 7, np.float32)
        codes = np.full(len(x), 7, codec.code)
        codec.encode(x, scales, codes)
        want_scales, want_codes = ref_encode(name, x)
        assert _bits(scales) == _bits(want_scales), f"{name} scales, {label}"
        assert _bits(codes) == _bits(want_codes), f"{name} codes, {label}"
        want = ref_decode(name, want_scales, want_codes, len(x))
        for dtype in (np.float32, np.float64, np.float16):
            out = np.full(len(x), 7, dtype)
            codec.decode(scales, codes, out)
            with np.errstate(all="ignore"):
                expected = want.astype(dtype)
            assert _bits(out) == _bits(expected), f"{name} decoded to {dtype.__name__}, {label}"


@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
def test_a_run_encoded_in_pieces_on_block_boundaries_is_the_same(name: str) -> None:
    codec = CODECS[name]
    x = np.random.default_rng(3).standard_normal(5 * BLOCK + 9).astype(np.float32)
    scales, codes = ref_encode(name, x)
    got_scales = np.empty_like(scales)
    got_codes = np.empty_like(codes)
    for a, b in ((0, 2 * BLOCK), (2 * BLOCK, 3 * BLOCK), (3 * BLOCK, len(x))):
        s = got_scales[a // BLOCK :] if codec.scaled else got_scales
        codec.encode(x[a:b], s, got_codes[a:b])
    assert _bits(got_scales) == _bits(scales)
    assert _bits(got_codes) == _bits(codes)


@pytest.mark.parametrize("name", ["int8", "fp16"])
def test_threads_encoding_at_once_get_their_own_bytes(name: str) -> None:
    codec = CODECS[name]
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(3 << 16).astype(np.float32) * 10.0**k for k in range(-4, 4)]
    wanted = [ref_encode(name, x) for x in inputs]

    def encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scales = np.empty(codec.scale_count(len(x)), np.float32)
        codes = np.empty(len(x), codec.code)
        for _ in range(5):
            codec.encode(x, scales, codes)
        return scales, codes

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(encode, inputs))
    for (scales, codes), (want_scales, want_codes) in zip(got, wanted, strict=True):
        assert _bits(scales) == _bits(want_scales)
        assert _bits(codes) == _bits(want_codes)
