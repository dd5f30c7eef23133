"""The averaging maths: dtype rules, shard boundaries and the deterministic mean.

Every rank, strategy and helper computes the mean with :func:`mean_into`, which
adds ranks in fixed order 0, 1, ..., W-1 and divides once by W: float32 in float32
(as gloo and NCCL do), or, with ``wide=True``, in a wider accumulator. The operation
is element-wise, so how elements are split into shards or chunks never changes a bit
of the result, NaNs aside: which NaN an element gets (sign, payload) follows the
operand order of numpy's loops, which differs between their vector body and tail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gradsync._errors import ConfigError, InvalidGradsError, MismatchError

__all__ = [
    "ACCUMULATOR",
    "SUPPORTED_DTYPES",
    "average_host_grads",
    "check_dtype",
    "mean_into",
    "shard_indices",
    "shard_range",
]

# Each dtype's sum without ``wide_sum``: float16 in float32 (a float16 sum overflows
# past 65504), float32 redone in float64 where its own sum overflows. With
# ``wide_sum=True`` every dtype is summed in float64, exactly for float16: the mean is
# then within one rounding of the exact one and independent of which rank has what.
ACCUMULATOR: dict[np.dtype[Any], np.dtype[Any]] = {
    np.dtype(np.float16): np.dtype(np.float32),
    np.dtype(np.float32): np.dtype(np.float64),
    np.dtype(np.float64): np.dtype(np.float64),
}
SUPPORTED_DTYPES: tuple[np.dtype[Any], ...] = tuple(ACCUMULATOR)


# Elements per chunk of the reduction: the accumulator and one input chunk stay in
# L2 cache while W inputs are added into it.
CHUNK_ELEMS = 1 << 15

# Shard boundaries fall on multiples of this many elements (64 bytes of float32),
# so ranks never write to the same cache line of a shared mapping.
_SHARD_ALIGN = 16

Fetch = Callable[[int, int, np.ndarray], np.ndarray]


def check_dtype(dtype: npt.DTypeLike, where: str) -> np.dtype[Any]:
    """Return ``dtype`` normalised to native byte order, or raise if unsupported."""
    dt = np.dtype(dtype)
    # Only a non-native dtype is converted: numpy 2's new-style dtypes (StringDType)
    # are native, and newbyteorder raises TypeError for them, not an InvalidGradsError.
    native: np.dtype[Any] = dt if dt.isnative else dt.newbyteorder("=")
    if native not in ACCUMULATOR:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise InvalidGradsError(f"{where} has dtype {dt}; gradsync averages only {names}")
    return native


def shard_range(n: int, rank: int, world_size: int, align: int = _SHARD_ALIGN) -> tuple[int, int]:
    """The contiguous element range ``[lo, hi)`` of ``n`` elements that ``rank`` reduces.

    Ranges of ranks 0..world_size-1 tile ``[0, n)`` in order and start on multiples
    of ``align`` (16) elements: whole blocks of ``align`` are dealt out evenly (the
    first ranks take one more when they do not divide), and the last rank also takes
    the tail.
    """
    blocks, extra = divmod(n // align, world_size)

    def boundary(q: int) -> int:
        if q >= world_size:
            return n
        return align * (q * blocks + min(q, extra))

    return boundary(rank), boundary(rank + 1)


def shard_indices(n: int, rank: int, world_size: int) -> npt.NDArray[np.int64]:
    """Indices of the ``n`` samples that ``rank`` trains on: ``rank, rank + W, rank + 2W...``.

    With ``world_size <= 1`` every index is returned. The shards of all ranks
    partition ``range(n)``.

    Raises:
        ConfigError: (a ``ValueError``) if ``n < 0`` or ``rank`` is outside ``[0, world_size)``.
    """
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n!r}")
    if world_size <= 1:
        return np.arange(n, dtype=np.int64)
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank must satisfy 0 <= rank < world_size, got rank={rank!r} "
            f"with world_size={world_size!r}"
        )
    return np.arange(rank, n, world_size, dtype=np.int64)


def mean_into(
    fetch: Sequence[Fetch],
    n: int,
    out: np.ndarray,
    scratch: np.ndarray | None = None,
    chunk_elems: int | None = None,
    *,
    wide: bool,
) -> None:
    """Write the element-wise mean of ``len(fetch)`` inputs of ``n`` elements into ``out``.

    ``fetch[q](start, stop, buf)`` returns rank q's elements ``[start, stop)``: a
    view, or ``buf[: stop - start]`` after filling it. ``buf`` has ``out``'s dtype.
    ``out`` must not overlap the inputs. Work goes ``chunk_elems`` elements at a
    time (default ``CHUNK_ELEMS``); the result does not depend on it.
    Ranks are added in index order, in float64 if ``wide``, else float32 in float32,
    float16 in float32 (a float16 sum overflows past 65504), float64 in float64 (an
    element whose sum overflows is summed again scaled down by a power of two); then
    divided by W and rounded once to ``out.dtype``.
    """
    world = len(fetch)
    chunk = min(CHUNK_ELEMS if chunk_elems is None else chunk_elems, max(n, 1))
    in_buf = scratch if scratch is not None and scratch.size >= chunk else None
    if in_buf is None:
        in_buf = np.empty(chunk, dtype=out.dtype)
    # float32 in float32 (two ranks always, more with wide=False): added straight into
    # ``out``, with no accumulator and no casts (much less CPU than float64). For two
    # ranks this is the float64 mean rounded to float32, bit for bit: a + b rounds once
    # (a sum that lands in the subnormal range is exact), halving is exact, and
    # float64's own rounding of a + b can never sit on a float32 tie.
    # The FPU's overflow flag (which numpy turns into FloatingPointError here, at no
    # extra pass) marks the rare chunks whose sum overflowed; Inf or NaN inputs raise
    # no flag. Two ranks redo such a chunk in float64 (the same bits elsewhere in it);
    # more ranks take the float64 mean just where the float32 one is not finite and
    # the float64 one is, element by element, so chunking never changes a bit. Either
    # way a mean of finite inputs is finite.
    redo: Sequence[int] = range(0, n, chunk)
    if out.dtype == np.float32 and world >= 2 and (world == 2 or not wide):
        redo = _float32_mean(fetch, n, out, in_buf, chunk)
        if world > 2:
            for start in redo:
                _patch_overflow(fetch, start, min(start + chunk, n), out, in_buf)
            return
    if not redo:
        return
    acc_buf = np.empty(chunk, dtype=np.float64 if wide else ACCUMULATOR[out.dtype])
    for start in redo:
        stop = min(start + chunk, n)
        try:
            acc = _wide_mean(fetch, start, stop, acc_buf[: stop - start], in_buf)
        except FloatingPointError:  # only float64 inputs can overflow a float64 sum
            acc = _float64_mean_scaled(fetch, start, stop, acc_buf[: stop - start], in_buf)
        np.copyto(out[start:stop], acc, casting="same_kind")


def _wide_mean(
    fetch: Sequence[Fetch], start: int, stop: int, acc: np.ndarray, in_buf: np.ndarray
) -> np.ndarray:
    """The mean of elements ``[start, stop)`` in ``acc``'s (wider) dtype, in ``acc``."""
    # NaN and Inf propagate as IEEE says; a warning (an error under -W error) would
    # fail this rank alone, which reduces this shard, and so the whole step. The
    # overflow flag (no extra pass) marks a sum of finite values that overflowed.
    with np.errstate(all="ignore", over="raise"):
        np.copyto(acc, fetch[0](start, stop, in_buf))
        for q in range(1, len(fetch)):
            np.add(acc, fetch[q](start, stop, in_buf), out=acc)
    with np.errstate(all="ignore"):
        np.divide(acc, len(fetch), out=acc)
    return acc


def _float64_mean_scaled(
    fetch: Sequence[Fetch], start: int, stop: int, acc: np.ndarray, in_buf: np.ndarray
) -> np.ndarray:
    """:func:`_wide_mean` of float64 inputs whose sum overflowed: where the plain mean is
    Inf and the inputs' sum scaled by 2^-k (k bits hold W) is finite, that one."""
    down = 2.0 ** -len(fetch).bit_length()
    scaled = np.empty_like(acc)
    with np.errstate(all="ignore"):
        np.copyto(acc, fetch[0](start, stop, in_buf))
        np.multiply(acc, down, out=scaled)
        for q in range(1, len(fetch)):
            x = fetch[q](start, stop, in_buf)
            np.add(acc, x, out=acc)
            scaled += x * down
        np.divide(acc, len(fetch), out=acc)
        # Scaling by a power of two is exact at these magnitudes: the same roundings.
        scaled /= len(fetch) * down
    np.copyto(acc, scaled, where=np.isinf(acc) & np.isfinite(scaled))
    return acc


def _float32_mean(
    fetch: Sequence[Fetch], n: int, out: np.ndarray, in_buf: np.ndarray, chunk: int
) -> list[int]:
    """The float32 sum of ranks 0..W-1 in order, divided by W, into ``out``; returns
    the first elements of the chunks whose sum overflowed (left unfinished)."""
    other_buf = np.empty(chunk, dtype=out.dtype)
    overflowed: list[int] = []
    with np.errstate(all="ignore", over="raise"):
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            try:
                _float32_chunk(fetch, start, stop, out[start:stop], in_buf, other_buf)
            except FloatingPointError:
                overflowed.append(start)
    return overflowed


def _float32_chunk(
    fetch: Sequence[Fetch],
    start: int,
    stop: int,
    dst: np.ndarray,
    in_buf: np.ndarray,
    other_buf: np.ndarray,
) -> None:
    world = len(fetch)
    np.add(fetch[0](start, stop, in_buf), fetch[1](start, stop, other_buf), out=dst)
    for q in range(2, world):
        np.add(dst, fetch[q](start, stop, in_buf), out=dst)
    if world == 2:
        np.multiply(dst, 0.5, out=dst)
    else:
        np.divide(dst, world, out=dst)


def _patch_overflow(
    fetch: Sequence[Fetch], start: int, stop: int, out: np.ndarray, in_buf: np.ndarray
) -> None:
    """Finish an overflowed float32 chunk; its elements whose float32 mean is not finite
    but whose float64 mean is take the float64 mean."""
    dst = out[start:stop]
    with np.errstate(all="ignore"):
        _float32_chunk(fetch, start, stop, dst, in_buf, np.empty_like(dst))
    wide = _wide_mean(fetch, start, stop, np.empty(stop - start, np.float64), in_buf)
    with np.errstate(all="ignore"):
        wide32 = wide.astype(np.float32)
    np.copyto(dst, wide32, where=~np.isfinite(dst) & np.isfinite(wide32))


def average_host_grads(
    per_rank: Sequence[Sequence[npt.ArrayLike]],
    *,
    wide_sum: bool = False,
) -> list[np.ndarray]:
    """The mean over ranks of each param, computed exactly as the file protocol does.

    ``per_rank[r][i]`` is rank r's gradient of param i (float16, float32 or
    float64). Returns new arrays, one per param, of each param's shape and dtype,
    bit-identical to what :func:`average_grads_file_sync` gives every rank with the
    same ``wide_sum`` (see :class:`FileGradSyncConfig`), except that a NaN mean may be
    another NaN (sign, payload: numpy's loops propagate NaNs by operand order).

    Raises:
        InvalidGradsError: no ranks, or an unsupported dtype.
        ConfigError: ``wide_sum`` is not a bool.
        MismatchError: ranks disagree on param count, shape or dtype; the message
            names the param index and the ranks.
    """
    if not isinstance(wide_sum, bool):
        raise ConfigError(f"wide_sum must be a bool, got {wide_sum!r}")
    if len(per_rank) == 0:
        raise InvalidGradsError("per_rank is empty: need the gradients of at least one rank")
    arrays = [[np.asarray(g) for g in grads] for grads in per_rank]
    count = len(arrays[0])
    for r, grads in enumerate(arrays):
        if len(grads) != count:
            raise MismatchError(
                f"rank 0 has {count} params but rank {r} has {len(grads)}", ranks=[0, r]
            )
    result: list[np.ndarray] = []
    for i in range(count):
        ref = arrays[0][i]
        dtype = check_dtype(ref.dtype, f"param {i} of rank 0")
        for r in range(1, len(arrays)):
            other = arrays[r][i]
            if other.shape != ref.shape or other.dtype != ref.dtype:
                raise MismatchError(
                    f"param {i}: rank 0 has shape {ref.shape} {ref.dtype} but rank {r} has "
                    f"shape {other.shape} {other.dtype}",
                    ranks=[0, r],
                )
        flat = [
            np.ascontiguousarray(arrays[r][i], dtype=dtype).reshape(-1) for r in range(len(arrays))
        ]
        out = np.empty(ref.shape, dtype=dtype)
        fetchers: list[Fetch] = [_view_fetch(f) for f in flat]
        mean_into(fetchers, out.size, out.reshape(-1), wide=wide_sum)
        result.append(out)
    return result


def _view_fetch(flat: np.ndarray) -> Fetch:
    def fetch(start: int, stop: int, _buf: np.ndarray) -> np.ndarray:
        return flat[start:stop]

    return fetch
