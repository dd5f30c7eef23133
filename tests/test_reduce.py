"""The averaging maths: exact rounding of the mean, dtype rules, chunk/shard independence."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import gradsync._step.reduce as reduce_mod
from gradsync import (
    ConfigError,
    InvalidGradsError,
    MismatchError,
    average_host_grads,
    shard_indices,
)
from gradsync._step.reduce import (
    ACCUMULATOR,
    SUPPORTED_DTYPES,
    check_dtype,
    mean_into,
    shard_range,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal
F32_SUB = float(np.finfo(np.float32).smallest_subnormal)
SUPPORTED = "float16, float32, float64"


def exact(message: str) -> str:
    return f"^{re.escape(message)}$"


# --- ported from the Rust reference ---------------------------------------------------------


def test_host_grad_average_is_mean() -> None:
    ranks = [
        [np.array([1.0, 3.0], np.float32), np.array([10.0], np.float32)],
        [np.array([5.0, 7.0], np.float32), np.array([30.0], np.float32)],
    ]
    avg = average_host_grads(ranks)
    assert len(avg) == 2
    np.testing.assert_array_equal(avg[0], np.array([3.0, 5.0], np.float32))
    np.testing.assert_array_equal(avg[1], np.array([20.0], np.float32))
    assert avg[0].dtype == avg[1].dtype == np.float32
    # Python lists become float64 arrays and are averaged the same way.
    lists = average_host_grads([[[1.0, 3.0], [10.0]], [[5.0, 7.0], [30.0]]])
    assert [a.tolist() for a in lists] == [[3.0, 5.0], [20.0]]
    assert lists[0].dtype == np.float64


def test_shard_indices_partition_samples() -> None:
    r0 = shard_indices(8, 0, 2)
    r1 = shard_indices(8, 1, 2)
    assert r0.tolist() == [0, 2, 4, 6]
    assert r1.tolist() == [1, 3, 5, 7]
    merged = sorted([*r0.tolist(), *r1.tolist()])
    assert merged == list(range(8))
    assert r0.dtype == np.int64


# --- the float32 mean is the float64 rank-order mean, rounded once ---------------------------


def float_elements(dtype: Any, limit: float | None = None) -> st.SearchStrategy[float]:
    """Finite values of ``dtype`` with weight on the awkward ones: subnormals, signed zeros,
    and magnitudes near the top of the range (where a sum in ``dtype`` would overflow)."""
    info = np.finfo(dtype)
    width = info.bits
    top = float(info.max) if limit is None else limit
    tiny, sub = float(info.tiny), float(info.smallest_subnormal)
    return st.one_of(
        st.floats(min_value=-top, max_value=top, width=width),
        st.floats(min_value=-tiny, max_value=tiny, width=width),  # subnormals and zeros
        st.floats(min_value=top / 4, max_value=top, width=width),
        st.floats(min_value=-top, max_value=-top / 4, width=width),
        st.sampled_from([0.0, -0.0, 1.0, -1.0, sub, -sub, top, -top]),
    )


@st.composite
def rank_arrays(
    draw: st.DrawFn, dtype: Any, elements: st.SearchStrategy[float]
) -> list[np.ndarray]:
    """1..6 ranks of same-shaped arrays; sometimes a rank cancels another one."""
    world = draw(st.integers(1, 6))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=12))
    arrays = [draw(hnp.arrays(dtype, shape, elements=elements)) for _ in range(world)]
    nudges = [float(np.finfo(dtype).smallest_subnormal), 1.0, 2.0**-10]
    if world >= 2 and draw(st.booleans()):
        src, dst = draw(st.permutations(range(world)))[:2]
        arrays[dst] = -arrays[src]  # exact cancellation, at either end of the order
        if draw(st.booleans()):
            arrays[dst] = arrays[dst] + draw(
                hnp.arrays(dtype, shape, elements=st.sampled_from(nudges))
            )
    return arrays


def rank_order_mean(arrays: Sequence[np.ndarray], acc_type: type) -> np.ndarray:
    """Element by element: add in rank order in ``acc_type`` scalars, divide by W once."""
    world = len(arrays)
    flat = [a.reshape(-1) for a in arrays]
    out = []
    for i in range(flat[0].size):
        s = acc_type(flat[0][i])
        for f in flat[1:]:
            s = acc_type(s + acc_type(f[i]))
        out.append(acc_type(s / acc_type(world)))
    return np.array(out, dtype=acc_type).reshape(arrays[0].shape)


@SETTINGS
@given(rank_arrays(np.float32, float_elements(np.float32)))
def test_float32_wide_mean_is_rank_order_float64_mean_rounded(arrays: list[np.ndarray]) -> None:
    [got] = average_host_grads([[a] for a in arrays], wide_sum=True)
    assert got.dtype == np.float32
    assert got.shape == arrays[0].shape
    # Python floats are IEEE doubles: an independent float64 reference.
    mean64 = rank_order_mean(arrays, float)
    expected = mean64.astype(np.float32)
    assert got.tobytes() == expected.tobytes()  # bit for bit (signed zeros included)
    assert np.all(np.isfinite(got))  # float32 overflow in the sum must not leak
    err = np.abs(got.astype(np.float64) - mean64)
    assert np.all(err <= 2e-6 * np.abs(mean64) + F32_SUB)


@SETTINGS
@given(rank_arrays(np.float16, float_elements(np.float16)))
def test_float16_accumulates_in_float32(arrays: list[np.ndarray]) -> None:
    [got] = average_host_grads([[a] for a in arrays])
    assert got.dtype == np.float16
    expected = rank_order_mean(arrays, np.float32).astype(np.float16)
    assert got.tobytes() == expected.tobytes()
    assert np.all(np.isfinite(got))  # the float32 sum cannot overflow


def test_float16_cancellation_follows_float32_accumulation() -> None:
    # 5e-5 - 1025 rounds in float32 before + 1025 cancels: the mean is 0, not 5e-5 / 3.
    # Pinned because every rank and strategy must produce these same bits.
    ranks = [np.array([x], np.float16) for x in (5e-5, -1025.0, 1025.0)]
    [got] = average_host_grads([[r] for r in ranks])
    expected = rank_order_mean(ranks, np.float32).astype(np.float16)
    assert got.tobytes() == expected.tobytes()
    assert got[0] == 0.0


def float64_mean(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The rank-order float64 mean; where its sum overflows, the same sum of the inputs
    scaled down by 2^-k (k bits hold W), divided by W and scaled back up."""
    with np.errstate(over="ignore", invalid="ignore"):
        plain = rank_order_mean(arrays, float)
    down = 2.0 ** -len(arrays).bit_length()
    scaled = rank_order_mean([a * down for a in arrays], float) / down
    return np.where(np.isinf(plain) & np.isfinite(scaled), scaled, plain)


@SETTINGS
@given(rank_arrays(np.float64, float_elements(np.float64)))
def test_float64_mean(arrays: list[np.ndarray]) -> None:
    [got] = average_host_grads([[a] for a in arrays])
    assert got.dtype == np.float64
    assert got.tobytes() == float64_mean(arrays).tobytes()
    assert np.all(np.isfinite(got))  # a sum that overflows is redone scaled down


def narrow_mean(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """What ``wide_sum=False`` promises for float32: the float32 sum in rank order divided
    by W; for two ranks (the same bits) or where that is not finite but the float64 mean
    is, the float64 mean."""
    wide = rank_order_mean(arrays, float).astype(np.float32)
    if len(arrays) <= 2:
        return wide
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = rank_order_mean(arrays, np.float32)
    return np.where(~np.isfinite(narrow) & np.isfinite(wide), wide, narrow)


@SETTINGS
@given(rank_arrays(np.float32, float_elements(np.float32)))
def test_float32_sums_in_float32_in_rank_order_by_default(arrays: list[np.ndarray]) -> None:
    [got] = average_host_grads([[a] for a in arrays])
    assert got.dtype == np.float32
    assert got.tobytes() == narrow_mean(arrays).tobytes()
    assert np.all(np.isfinite(got))  # an overflowing chunk is redone in float64
    if len(arrays) <= 2:  # two ranks: the same bits as the wide sum
        [wide] = average_host_grads([[a] for a in arrays], wide_sum=True)
        assert got.tobytes() == wide.tobytes()


@SETTINGS
@given(rank_arrays(np.float16, float_elements(np.float16)))
def test_wide_sum_leaves_float64_alone(arrays: list[np.ndarray]) -> None:
    doubles = [a.astype(np.float64) for a in arrays]
    [narrow] = average_host_grads([[a] for a in doubles])
    [wide] = average_host_grads([[a] for a in doubles], wide_sum=True)
    assert narrow.tobytes() == wide.tobytes()


@SETTINGS
@given(rank_arrays(np.float16, float_elements(np.float16)), st.randoms())
def test_float16_wide_mean_is_the_exact_mean_rounded_once(
    arrays: list[np.ndarray], rnd: Any
) -> None:
    # A float64 sum of float16 values is exact: no rank order can change a bit.
    exact = rank_order_mean(arrays, float).astype(np.float16)
    rnd.shuffle(arrays)
    [wide] = average_host_grads([[a] for a in arrays], wide_sum=True)
    assert wide.tobytes() == exact.tobytes()


def test_float16_wide_mean_is_not_the_float32_sum_order() -> None:
    # Summed in float32 in this order 2^-23 is lost to 2 + 2^-10; the exact mean keeps it.
    values = [2.0, 2.0**-10, 2.0**-23, 2.0**-23]
    ranks = [[np.array([v], np.float16)] for v in values]
    [wide] = average_host_grads(ranks, wide_sum=True)
    [narrow] = average_host_grads(ranks)
    assert wide[0] == np.float16(0.5 + 2.0**-12 + 2.0**-24)
    assert narrow[0] == np.float16(0.5)


def test_float32_sum_examples() -> None:
    # 1 + 2**-24 rounds back to 1 in float32, twice: the mean is 1/3 in float32.
    ranks = [np.array([x], np.float32) for x in (1.0, 2.0**-24, 2.0**-24)]
    [got] = average_host_grads([[r] for r in ranks])
    assert got[0] == np.float32(1.0) / np.float32(3.0)
    huge = np.full(4, F32_MAX, np.float32)
    [mean] = average_host_grads([[huge]] * 5)  # float32 sum overflows
    np.testing.assert_array_equal(mean, huge)
    # One element overflows in float32, its neighbour does not: only the first takes the
    # float64 mean, however the elements are chunked.
    cols = [
        np.array([F32_MAX, x, F32_MAX, y], np.float32)
        for x, y in ((1.0, F32_MAX), (2.0**-24, F32_MAX), (2.0**-24, -np.inf))
    ]
    want = [F32_MAX, np.float32(1.0) / np.float32(3.0), F32_MAX]
    for chunk in (1, 2, 1 << 15):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(reduce_mod, "CHUNK_ELEMS", chunk)
            [got] = average_host_grads([[c] for c in cols])
        assert got[:3].tolist() == want
        # MAX + MAX overflows before -inf: float32 gives NaN, float64 -inf; neither is
        # finite, so the float32 sum stands.
        assert np.isnan(got[3])
    with pytest.raises(ConfigError, match=exact("wide_sum must be a bool, got 'no'")):
        average_host_grads([[huge]], wide_sum="no")  # type: ignore[arg-type]


def test_float32_sums_in_float64_with_wide_sum() -> None:
    # In float32, 1 + 2**-24 + 2**-24 rounds back to 1; the float64 accumulator keeps both.
    ranks = [np.array([x], np.float32) for x in (1.0, 2.0**-24, 2.0**-24)]
    [got] = average_host_grads([[r] for r in ranks], wide_sum=True)
    assert got[0] == np.float32((1.0 + 2.0**-23) / 3)
    assert got[0] != np.float32(1.0) / np.float32(3.0)
    huge = np.full(4, F32_MAX, np.float32)
    [mean] = average_host_grads([[huge]] * 5, wide_sum=True)  # the sum exceeds float32
    np.testing.assert_array_equal(mean, huge)


def test_mixed_params_keep_their_dtypes_and_shapes() -> None:
    rng = np.random.default_rng(0)
    params = [
        rng.standard_normal((3, 4)).astype(np.float32),
        np.array(2.5, np.float64),  # a scalar param
        rng.standard_normal(5).astype(np.float16),
        np.zeros((0, 3), np.float32),  # an empty param
    ]
    per_rank = [[p * (r + 1) for p in params] for r in range(3)]
    out = average_host_grads(per_rank, wide_sum=True)
    assert [o.dtype for o in out] == [p.dtype for p in params]
    assert [o.shape for o in out] == [p.shape for p in params]
    for o, p, pr in zip(out, params, zip(*per_rank, strict=True), strict=True):
        expected = rank_order_mean(list(pr), np.float32 if p.dtype == np.float16 else float)
        np.testing.assert_array_equal(o, expected.astype(p.dtype).reshape(p.shape))
        assert not np.shares_memory(o, p)
    assert average_host_grads([[], []]) == []


def test_inputs_not_modified_and_any_layout_accepted() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    strided = base[:, ::2]  # not contiguous
    fortran = np.asfortranarray(base[:, :3] * 2)
    before = (strided.copy(), fortran.copy())
    [got] = average_host_grads([[strided], [fortran]])
    np.testing.assert_array_equal(got, (strided.astype(np.float64) + fortran) / 2)
    np.testing.assert_array_equal(strided, before[0])
    np.testing.assert_array_equal(fortran, before[1])


def test_big_endian_inputs() -> None:
    a = np.array([1.0, -2.0, 3.5], dtype=">f4")
    b = np.array([3.0, 2.0, 0.5], dtype=">f4")
    [got] = average_host_grads([[a], [b]])
    assert got.dtype == np.dtype("=f4")
    np.testing.assert_array_equal(got, np.array([2.0, 0.0, 2.0], np.float32))


# --- NaN / Inf -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nan_inf_propagate_as_ieee(dtype: type[np.floating[Any]]) -> None:
    inf, nan = np.inf, np.nan
    r0 = np.array([inf, inf, -inf, nan, 1.0, inf, 0.0], dtype)
    r1 = np.array([1.0, -inf, -inf, 2.0, nan, inf, -0.0], dtype)
    with np.errstate(all="ignore"):
        [got] = average_host_grads([[r0], [r1]])
    expected = np.array([inf, nan, -inf, nan, nan, inf, 0.0], dtype)
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == dtype


def test_float64_sum_overflow_gives_the_finite_mean() -> None:
    big = np.array([1.5e308, -1.5e308, np.finfo(np.float64).max, 1.0], np.float64)
    for world in (2, 3):
        [got] = average_host_grads([[big]] * world)
        np.testing.assert_array_equal(got, big)
    half = np.array([np.finfo(np.float16).max], np.float16)
    [got16] = average_host_grads([[half], [half], [half]])  # the float32 sum fits
    np.testing.assert_array_equal(got16, half)


@pytest.mark.parametrize(
    ("r0", "r1"), [([np.inf], [-np.inf]), ([1.5e308], [1.5e308])], ids=["inf-inf", "overflow"]
)
def test_nan_inf_propagate_without_warnings(r0: list[float], r1: list[float]) -> None:
    # pyproject turns warnings into errors, as a strict user's test suite would.
    average_host_grads([[np.array(r0)], [np.array(r1)]])


# --- dtype rules ----------------------------------------------------------------------------


def test_accumulators() -> None:
    assert (np.dtype("float16"), np.dtype("float32"), np.dtype("float64")) == SUPPORTED_DTYPES
    assert ACCUMULATOR[np.dtype("float16")] == np.float32
    assert ACCUMULATOR[np.dtype("float32")] == np.float64
    assert ACCUMULATOR[np.dtype("float64")] == np.float64


def test_check_dtype() -> None:
    assert check_dtype(np.float32, "x") == np.dtype(np.float32)
    assert check_dtype(">f8", "x") == np.dtype("=f8")
    assert check_dtype(">f8", "x").isnative
    assert check_dtype("e", "x") == np.float16
    with pytest.raises(
        InvalidGradsError, match=exact(f"grad w has dtype >i4; gradsync averages only {SUPPORTED}")
    ):
        check_dtype(">i4", "grad w")


UNSUPPORTED = [
    (np.array([1, 2], np.int32), "int32"),
    (np.array([1, 2], np.int64), "int64"),
    (np.array([1, 2], np.uint8), "uint8"),
    (np.array([True]), "bool"),
    (np.array([1 + 2j], np.complex64), "complex64"),
    (np.array([object()], dtype=object), "object"),
    (np.array(["a"]), "<U1"),
]
if hasattr(np, "float128"):
    UNSUPPORTED.append((np.array([1.0], np.float128), "float128"))
if hasattr(getattr(np, "dtypes", None), "StringDType"):  # numpy >= 2
    # A new-style dtype: it has no byte order to normalise (newbyteorder raises TypeError).
    UNSUPPORTED.append((np.array(["a"], np.dtypes.StringDType()), "StringDType()"))


@pytest.mark.parametrize(("bad", "name"), UNSUPPORTED, ids=[n for _, n in UNSUPPORTED])
def test_unsupported_dtypes(bad: np.ndarray, name: str) -> None:
    ok = np.zeros(2, np.float32)
    message = f"param 1 of rank 0 has dtype {name}; gradsync averages only {SUPPORTED}"
    with pytest.raises(InvalidGradsError, match=exact(message)) as info:
        average_host_grads([[ok, bad], [ok, bad.copy()]])
    assert isinstance(info.value, ValueError)


def test_python_ints_are_unsupported() -> None:
    with pytest.raises(
        InvalidGradsError,
        match=exact(f"param 0 of rank 0 has dtype int64; gradsync averages only {SUPPORTED}"),
    ):
        average_host_grads([[[1, 2]], [[3, 4]]])


def test_no_ranks() -> None:
    with pytest.raises(
        InvalidGradsError, match=exact("per_rank is empty: need the gradients of at least one rank")
    ):
        average_host_grads([])


# --- mismatches ------------------------------------------------------------------------------


def test_param_count_mismatch() -> None:
    a = np.zeros(2, np.float32)
    with pytest.raises(MismatchError, match=exact("rank 0 has 2 params but rank 2 has 1")) as info:
        average_host_grads([[a, a], [a, a], [a]])
    assert info.value.ranks == (0, 2)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (
            np.zeros(3, np.float32),
            "param 1: rank 0 has shape (2,) float32 but rank 1 has shape (3,) float32",
        ),
        (
            np.zeros((2, 1), np.float32),
            "param 1: rank 0 has shape (2,) float32 but rank 1 has shape (2, 1) float32",
        ),
        (
            np.zeros(2, np.float64),
            "param 1: rank 0 has shape (2,) float32 but rank 1 has shape (2,) float64",
        ),
        (
            np.zeros(2, np.int32),
            "param 1: rank 0 has shape (2,) float32 but rank 1 has shape (2,) int32",
        ),
    ],
)
def test_shape_or_dtype_mismatch(other: np.ndarray, message: str) -> None:
    first = np.zeros(5, np.float64)
    ok = np.zeros(2, np.float32)
    with pytest.raises(MismatchError, match=exact(message)) as info:
        average_host_grads([[first, ok], [first, other], [first, ok]])
    assert info.value.ranks == (0, 1)


def test_mismatch_names_the_later_rank() -> None:
    ok = np.zeros((2, 2), np.float16)
    with pytest.raises(
        MismatchError,
        match=exact("param 0: rank 0 has shape (2, 2) float16 but rank 3 has shape (4,) float16"),
    ) as info:
        average_host_grads([[ok], [ok], [ok], [ok.reshape(4)]])
    assert info.value.ranks == (0, 3)


# --- chunking and sharding never change a bit -------------------------------------------------


def view_fetchers(flats: Sequence[np.ndarray]) -> list[reduce_mod.Fetch]:
    def make(flat: np.ndarray) -> reduce_mod.Fetch:
        return lambda start, stop, _buf: flat[start:stop]

    return [make(f) for f in flats]


def copy_fetchers(flats: Sequence[np.ndarray], calls: list[tuple[int, int]]) -> list[Any]:
    """Fetchers that fill the scratch buffer, as the file protocol's readers do."""

    def make(flat: np.ndarray) -> reduce_mod.Fetch:
        def fetch(start: int, stop: int, buf: np.ndarray) -> np.ndarray:
            calls.append((start, stop))
            assert buf.dtype == flat.dtype
            assert buf.size >= stop - start
            buf[: stop - start] = flat[start:stop]
            return buf[: stop - start]

        return fetch

    return [make(f) for f in flats]


@settings(max_examples=40, deadline=None)
@given(
    arrays=st.one_of(
        rank_arrays(np.float32, float_elements(np.float32)),
        rank_arrays(np.float16, float_elements(np.float16)),
    ),
    chunk=st.integers(1, 40),
    shard_world=st.integers(1, 7),
    wide=st.booleans(),
)
def test_chunking_and_sharding_do_not_change_bits(
    arrays: list[np.ndarray], chunk: int, shard_world: int, wide: bool
) -> None:
    [whole] = average_host_grads([[a] for a in arrays], wide_sum=wide)
    flats = [a.reshape(-1) for a in arrays]
    n = flats[0].size
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reduce_mod, "CHUNK_ELEMS", chunk)
        [chunked] = average_host_grads([[a] for a in arrays], wide_sum=wide)
        calls: list[tuple[int, int]] = []
        copied = np.empty(n, whole.dtype)
        mean_into(copy_fetchers(flats, calls), n, copied, wide=wide)
        if n:
            assert max(stop - start for start, stop in calls) <= chunk
    assert chunked.tobytes() == whole.tobytes()
    assert copied.tobytes() == whole.reshape(-1).tobytes()
    # The chunk size the threaded reduce passes explicitly.
    calls = []
    explicit = np.empty(n, whole.dtype)
    mean_into(copy_fetchers(flats, calls), n, explicit, chunk_elems=chunk + 3, wide=wide)
    assert explicit.tobytes() == whole.reshape(-1).tobytes()
    if n:
        assert max(stop - start for start, stop in calls) <= chunk + 3
    # Reduce shard by shard, as the ranks do, and reassemble.
    pieces = np.full(n, np.nan, whole.dtype)
    for q in range(shard_world):
        lo, hi = shard_range(n, q, shard_world)
        mean_into(view_fetchers([f[lo:hi] for f in flats]), hi - lo, pieces[lo:hi], wide=wide)
    assert pieces.tobytes() == whole.reshape(-1).tobytes()


def test_mean_into_chunks_and_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reduce_mod, "CHUNK_ELEMS", 16)
    rng = np.random.default_rng(3)
    flats = [rng.standard_normal(50).astype(np.float32) for _ in range(3)]
    calls: list[tuple[int, int]] = []
    out = np.empty(50, np.float32)
    scratch = np.empty(100, np.float32)
    mean_into(copy_fetchers(flats, calls), 50, out, scratch, wide=True)
    assert calls[:3] == [(0, 16)] * 3
    assert sorted(set(calls)) == [(0, 16), (16, 32), (32, 48), (48, 50)]
    expected = ((flats[0].astype(np.float64) + flats[1] + flats[2]) / 3).astype(np.float32)
    assert out.tobytes() == expected.tobytes()
    small = np.empty(4, np.float32)  # too small: mean_into makes its own buffer
    again = np.empty(50, np.float32)
    mean_into(copy_fetchers(flats, []), 50, again, small, wide=True)
    assert again.tobytes() == out.tobytes()
    untouched = np.full(3, 7.0, np.float32)
    mean_into(copy_fetchers(flats, []), 0, untouched, wide=True)  # nothing to do
    np.testing.assert_array_equal(untouched, 7.0)


def test_large_param_crosses_default_chunks() -> None:
    n = reduce_mod.CHUNK_ELEMS * 2 + 123
    rng = np.random.default_rng(5)
    ranks = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    [got] = average_host_grads([[r] for r in ranks], wide_sum=True)
    acc = ranks[0].astype(np.float64)
    for r in ranks[1:]:
        acc += r
    assert got.tobytes() == (acc / 3).astype(np.float32).tobytes()


# --- shard_range ----------------------------------------------------------------------------


def check_tiling(n: int, world: int) -> list[tuple[int, int]]:
    ranges = [shard_range(n, q, world) for q in range(world)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == n
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert hi == lo
    for lo, hi in ranges:
        assert 0 <= lo <= hi <= n
        assert lo % 16 == 0
        assert hi % 16 == 0 or hi == n
    return ranges


def test_shard_range_tiles_small_cases_exhaustively() -> None:
    for n in range(300):
        for world in range(1, 10):
            check_tiling(n, world)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 10**12), world=st.integers(1, 300))
def test_shard_range_tiles(n: int, world: int) -> None:
    ranges = check_tiling(n, world)
    assert ranges == [shard_range(n, q, world) for q in range(world)]  # deterministic


def test_shard_range_examples() -> None:
    assert [shard_range(100, q, 3) for q in range(3)] == [(0, 32), (32, 64), (64, 100)]
    assert [shard_range(1000, q, 4) for q in range(4)] == [
        (0, 256),
        (256, 512),
        (512, 752),
        (752, 1000),
    ]
    assert shard_range(10, 0, 1) == (0, 10)
    assert [shard_range(0, q, 3) for q in range(3)] == [(0, 0)] * 3
    assert [shard_range(20, q, 3) for q in range(3)] == [(0, 16), (16, 16), (16, 20)]


def test_shard_range_sizes_differ_by_at_most_one_block() -> None:
    for n in range(400):
        for world in range(1, 9):
            sizes = [hi - lo for lo, hi in (shard_range(n, q, world) for q in range(world))]
            assert max(sizes) - min(sizes) <= 16, (n, world, sizes)


# --- shard_indices --------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 500), world=st.integers(1, 12))
def test_shard_indices_partition(n: int, world: int) -> None:
    shards = [shard_indices(n, r, world) for r in range(world)]
    merged = np.sort(np.concatenate(shards))
    np.testing.assert_array_equal(merged, np.arange(n))
    for r, shard in enumerate(shards):
        assert shard.dtype == np.int64
        assert np.all(shard % world == r)
        assert np.all(np.diff(shard) == world)


def test_shard_indices_single_process_gets_everything() -> None:
    np.testing.assert_array_equal(shard_indices(5, 0, 1), np.arange(5))
    np.testing.assert_array_equal(shard_indices(5, 0, 0), np.arange(5))
    assert shard_indices(0, 0, 1).size == 0
    assert shard_indices(2, 2, 4).tolist() == []
    # As in the Rust reference, one process trains on everything whatever its rank.
    np.testing.assert_array_equal(shard_indices(4, 3, 1), np.arange(4))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 0, 2), "n must be >= 0, got -1"),
        ((-5, 0, 1), "n must be >= 0, got -5"),
        ((8, 2, 2), "rank must satisfy 0 <= rank < world_size, got rank=2 with world_size=2"),
        ((8, -1, 3), "rank must satisfy 0 <= rank < world_size, got rank=-1 with world_size=3"),
    ],
)
def test_shard_indices_errors(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ConfigError, match=exact(message)) as info:
        shard_indices(*args)
    assert isinstance(info.value, ValueError)
