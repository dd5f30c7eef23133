"""Compressed averaging (``compression``, ``error_feedback``): every rank gets the bits
of a numpy reference, the files shrink, and error feedback keeps losses from adding up."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import compression_workers as cw
import gradsync
import workers
from gradsync import ConfigError, FileGradSyncConfig
from gradsync._step.codec import CODECS
from ranks import run_ranks

BLOCK = 256  # elements per scale (docs/compression.md)
TINY = np.float32(2.0**-100)


# -- the reference: each dtype group compressed in blocks from its first element -------


def _blocks_amax(x: np.ndarray) -> np.ndarray:
    pad = np.zeros(-len(x) % BLOCK, np.float32)
    return np.abs(np.concatenate([x, pad])).reshape(-1, BLOCK).max(axis=1)


def _per_element(per_block: np.ndarray, n: int) -> np.ndarray:
    return np.repeat(per_block, BLOCK)[:n]


def roundtrip(x: np.ndarray, codec: str) -> np.ndarray:
    """``x`` (float32) encoded and decoded as docs/compression.md says."""
    if codec == "bf16":
        bits = x.view(np.uint32).astype(np.uint64)
        kept = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        back = kept.astype(np.uint32).view(np.float32)
        # Finite values past bfloat16's largest saturate to it (docs/compression.md).
        top = np.float32(3.3895314e38)
        return np.where(np.isfinite(x) & np.isinf(back), np.copysign(top, x), back)
    amax = _blocks_amax(x)
    if codec == "fp16":
        _, exp = np.frexp(np.maximum(amax, TINY))
        inv = np.ldexp(np.float32(1), 15 - exp).astype(np.float32)
        codes = (x * _per_element(inv, len(x))).astype(np.float16)
        tiny = np.abs(codes) < 2.0**-14
        codes[tiny] = np.copysign(0, codes[tiny])  # no subnormals: signed zeros
        scale = np.ldexp(np.float32(1), exp - 15).astype(np.float32)
        return _saturated(codes, _per_element(scale, len(x)))
    small = amax < TINY
    with np.errstate(divide="ignore"):
        inv = np.where(small, 0, np.float32(127) / amax).astype(np.float32)
    codes = np.rint(x * _per_element(inv, len(x))).astype(np.int8)
    scale = np.where(small, 0, amax / np.float32(127)).astype(np.float32)
    return _saturated(codes, _per_element(scale, len(x)))


def _saturated(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Each code times its scale in float32; a finite code's product past float32's
    largest saturates to it, sign kept (docs/compression.md)."""
    top = np.finfo(np.float32).max
    with np.errstate(over="ignore", invalid="ignore"):
        product = codes.astype(np.float32) * scales
    return np.where(np.isfinite(codes), np.clip(product, -top, top), product)


def compressed(grads: list[np.ndarray], codec: str) -> list[np.ndarray]:
    """What a rank's file carries of ``grads``: each dtype group (params in order)
    round-tripped whole; float16 passes as it is under bf16 and fp16."""
    out = [g.copy() for g in grads]
    for dtype in dict.fromkeys(g.dtype for g in grads):
        members = [i for i, g in enumerate(grads) if g.dtype == dtype]
        if dtype == np.float16 and codec != "int8":
            continue
        flat = np.concatenate([grads[i].reshape(-1) for i in members]).astype(np.float32)
        back = roundtrip(flat, codec)
        at = 0
        for i in members:
            out[i] = back[at : at + grads[i].size].astype(dtype).reshape(grads[i].shape)
            at += grads[i].size
    return out


def reference(per_rank: list[list[np.ndarray]], codec: str) -> list[np.ndarray]:
    """The mean of the decoded inputs in rank order, compressed once more."""
    mean = gradsync.average_host_grads([compressed(g, codec) for g in per_rank])
    return compressed(mean, codec)


F16_MAX = np.float32(65504)  # float16's largest finite value


def _fed_back(x: np.ndarray, residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``x`` of a float16 group plus its residual, finite values clipped to
    +-65504, through int8 (docs/compression.md, error feedback): the decoded values and
    the next residual (what the clip removed included)."""
    wanted = x + residual
    with np.errstate(invalid="ignore"):
        sent = np.where(np.isfinite(wanted), np.clip(wanted, -F16_MAX, F16_MAX), wanted)
        decoded = roundtrip(sent, "int8")
        lost = wanted - decoded
    lost[~np.isfinite(lost)] = 0
    return decoded, lost


def fed_back_reference(steps: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The result of each step of int8 with error feedback, ``steps[s][r]`` rank r's
    one float16 param at step s: each rank's input and the mean fed back alike."""
    residuals = [np.zeros(x.size, np.float32) for x in steps[0]]
    out_residual = np.zeros(steps[0][0].size, np.float32)
    results = []
    for inputs in steps:
        decoded = []
        for r, x in enumerate(inputs):
            back, residuals[r] = _fed_back(x.astype(np.float32), residuals[r])
            decoded.append([back.astype(np.float16)])
        (mean,) = gradsync.average_host_grads(decoded)
        back, out_residual = _fed_back(mean.astype(np.float32), out_residual)
        results.append(back.astype(np.float16))
    return results


def _bits(arrays: list[np.ndarray]) -> list[bytes]:
    return [a.tobytes() for a in arrays]


# -- through real ranks ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("codec", "world", "small", "kw"),
    [
        ("bf16", 2, False, {}),
        ("fp16", 3, False, {}),
        ("int8", 2, False, {}),
        ("int8", 3, True, {"use_mmap": False}),
        ("bf16", 3, False, {"use_mmap": False}),
        ("fp16", 2, False, {"strategy": "root", "checksums": True}),
        ("int8", 3, False, {"across_hosts": True, "checksums": True, "large": True}),
        ("bf16", 2, False, {"across_hosts": True, "large": True}),
        ("int8", 3, False, {"across_hosts": True, "large": True, "local_ranks": [1]}),
        ("int8", 2, False, {"across_hosts": True}),
    ],
)
def test_every_rank_gets_the_bits_of_the_numpy_reference(
    tmp_path: Path, codec: str, world: int, small: bool, kw: dict[str, Any]
) -> None:
    args = (world, str(tmp_path), 2, small, {"compression": codec, **kw})
    results = run_ranks(cw.steps, world, args)
    assert all(results[r].ok for r in range(world)), [results[r].message for r in range(world)]
    for step in range(2):
        inputs = [results[r].value[step][0] for r in range(world)]
        want = _bits(reference(inputs, codec))
        for r in range(world):
            assert _bits(results[r].value[step][1]) == want, (step, r)


def _groups(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Each dtype group's params end to end, as float64 (what blocks run over)."""
    order = dict.fromkeys(a.dtype for a in arrays)
    return [
        np.concatenate([a.reshape(-1) for a in arrays if a.dtype == d]).astype(np.float64)
        for d in order
    ]


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_compressed_means_are_close_to_the_exact_ones(tmp_path: Path, codec: str) -> None:
    results = run_ranks(cw.function_form, 2, (2, str(tmp_path), codec))
    assert all(results[r].ok for r in range(2)), results[0].message
    assert _bits(results[0].value) == _bits(results[1].value)
    inputs = [cw.grads_for(r, 0, cw.SHAPES) for r in range(2)]
    exact = _groups(gradsync.average_host_grads(inputs, wide_sum=True))
    peers = [_groups(g) for g in inputs]
    # Relative to the largest value of the block (of the inputs or the mean).
    tolerance = {"bf16": 2**-7, "fp16": 2**-9, "int8": 2 / 127}[codec]
    for k, (got, want) in enumerate(zip(_groups(results[0].value), exact, strict=True)):
        peak = np.maximum.reduce([_blocks_amax(a) for a in [peers[0][k], peers[1][k], want]])
        assert (np.abs(got - want) <= tolerance * _per_element(peak, len(want))).all()
    # Values near 1e6, far past float16's 65504: finite and close under fp16 too.
    large = results[0].value[cw.LARGE_PARAM]
    assert np.isfinite(large).all()
    assert np.abs(large).max() > 1e6


def test_int8_error_stays_within_half_a_scale_per_quantisation(tmp_path: Path) -> None:
    results = run_ranks(cw.function_form, 2, (2, str(tmp_path), "int8"))
    inputs = [_groups(cw.grads_for(r, 0, cw.SHAPES))[0] for r in range(2)]  # float32
    got = _groups(results[0].value)[0]
    # The inputs' block scales, then the mean's: each rounding is within half of one.
    scales = [_blocks_amax(g.astype(np.float32)) / 127 for g in inputs]
    exact = (inputs[0] + inputs[1]) / 2
    mean_scale = _blocks_amax(exact.astype(np.float32)) / 127
    bound = (scales[0] + scales[1]) / 4 + mean_scale / 2
    assert (np.abs(got - exact) <= _per_element(bound * 1.001, len(exact))).all()


def test_files_shrink_to_half_or_a_quarter(tmp_path: Path) -> None:
    sizes = {}
    for codec in (None, "bf16", "fp16", "int8"):
        where = tmp_path / str(codec)
        results = run_ranks(cw.file_sizes, 2, (2, str(where), codec))
        sizes[codec] = results[0].value
    for kind in ("in", "out"):
        plain = sizes[None][kind]
        assert sizes["bf16"][kind] <= plain / 2 + 4096
        assert sizes["fp16"][kind] <= plain / 2 + plain / 256 + 4096
        assert sizes["int8"][kind] <= plain / 4 + plain / 256 + 4096


def test_on_one_host_the_step_is_not_compressed_unless_compress_local(tmp_path: Path) -> None:
    runs = {}
    for codec, local in ((None, False), ("int8", False), ("int8", True)):
        where = tmp_path / f"{codec}-{local}"
        runs[codec, local] = run_ranks(cw.file_sizes, 2, (2, str(where), codec, local))
    plain, skipped, forced = runs[None, False], runs["int8", False], runs["int8", True]
    for r in range(2):
        assert skipped[r].value["codec"] is None
        assert forced[r].value["codec"] == "int8"
        assert skipped[r].value["in"] == plain[r].value["in"]
        assert forced[r].value["in"] < plain[r].value["in"] / 3
        assert skipped[r].value["mean"].tobytes() == plain[r].value["mean"].tobytes()
        assert forced[r].value["mean"].tobytes() != plain[r].value["mean"].tobytes()


def test_ranks_of_one_host_that_see_its_filesystem_differently_agree_not_to_compress(
    tmp_path: Path,
) -> None:
    # Rank 1 sees the sync dir as local (an NFS server's host), the others as shared.
    kw = {"compression": "int8", "compress_local": False, "across_hosts": True}
    results = run_ranks(cw.steps, 3, (3, str(tmp_path), 2, False, {**kw, "local_ranks": [1]}))
    assert all(results[r].ok for r in range(3)), [results[r].message for r in range(3)]
    for step in range(2):
        inputs = [results[r].value[step][0] for r in range(3)]
        want = _bits(gradsync.average_host_grads(inputs))
        for r in range(3):
            assert _bits(results[r].value[step][1]) == want, (step, r)


def test_a_compression_mismatch_fails_at_the_rendezvous(tmp_path: Path) -> None:
    args = (2, str(tmp_path), "compression", ["int8", None])
    results = run_ranks(workers.rendezvous_settings, 2, args)
    assert results[0].error_type == "MismatchError", results[0].message
    assert re.fullmatch(
        r"rendezvous: rank 0 has compression 'int8' but rank 1 \(pid \d+ on \S+\) "
        r"has compression None in \S+; every rank must use the same compression",
        results[0].message,
    ), results[0].message
    assert results[1].message == results[0].message


def test_error_feedback_keeps_the_sum_of_results_on_the_sum_of_inputs(tmp_path: Path) -> None:
    count = 30
    errors = {}
    for feedback in (True, False):
        where = tmp_path / str(feedback)
        results = run_ranks(cw.constant_steps, 2, (2, str(where), count, feedback))
        grads = [results[r].value[0] for r in range(2)]
        exact = (grads[0].astype(np.float64) + grads[1]) / 2 * count
        assert np.array_equal(results[0].value[1], results[1].value[1])
        errors[feedback] = np.abs(results[0].value[1] - exact).max()
    scale = max(np.abs(g).max() for g in grads) / 127
    # With feedback the residuals (each under a scale) bound it, whatever the count;
    # without, the same rounding adds up every step.
    assert errors[True] <= 2 * scale
    assert errors[False] >= 4 * errors[True]


@pytest.mark.parametrize("size", [4_099, 140_001])  # every rank reduces all; sharded
def test_int8_error_feedback_keeps_float16_near_65504_finite(tmp_path: Path, size: int) -> None:
    # A residual added to a value near float16's largest used to decode to Inf, then NaN.
    count = 4
    results = run_ranks(cw.near_float16_max, 2, (2, str(tmp_path), count, size))
    assert all(results[r].ok for r in range(2)), [results[r].message for r in range(2)]
    want = fed_back_reference([[results[r].value[s][0] for r in range(2)] for s in range(count)])
    for step in range(count):
        got = [results[r].value[step][1] for r in range(2)]
        assert np.isfinite(got[0]).all(), (step, np.count_nonzero(~np.isfinite(got[0])))
        assert got[0].tobytes() == got[1].tobytes() == want[step].tobytes(), step


def test_error_feedback_of_layouts_taking_turns_is_kept_for_each(tmp_path: Path) -> None:
    # It started afresh at every change of layout: with DDP's several buckets, never used.
    count, sizes = 4, [4_099, 140_001]
    results = run_ranks(cw.taking_turns, 2, (2, str(tmp_path), count, sizes))
    assert all(results[r].ok for r in range(2)), [results[r].message for r in range(2)]
    for i in range(len(sizes)):
        rounds = [[results[r].value[i][s][0] for r in range(2)] for s in range(count)]
        want = fed_back_reference(rounds)
        for s in range(count):
            got = [results[r].value[i][s][1].tobytes() for r in range(2)]
            assert got[0] == got[1] == want[s].tobytes(), (sizes[i], s)


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("size", [4_099, 140_001])  # every rank reduces all; sharded
def test_finite_values_near_float32_max_stay_finite(tmp_path: Path, size: int, codec: str) -> None:
    # bf16 rounded float32 values from 3.3962e38 up to Inf; fp16 and int8 decoded a code
    # times its scale past float32's largest as Inf (int8 then encoded the mean as NaN).
    results = run_ranks(cw.near_float32_max, 2, (2, str(tmp_path), size, codec))
    assert all(results[r].ok for r in range(2)), [results[r].message for r in range(2)]
    (x0, got), (x1, other) = results[0].value, results[1].value
    assert np.count_nonzero(np.abs(x0) >= np.float32(3.3961775e38)) > size // 4
    assert np.count_nonzero(np.abs(x0) == np.finfo(np.float32).max) >= size // 97
    assert np.isfinite(got).all(), np.count_nonzero(~np.isfinite(got))
    assert got.tobytes() == other.tobytes() == reference([[x0], [x1]], codec)[0].tobytes()
    exact = (x0.astype(np.float64) + x1) / 2
    # Two roundings (the inputs, the mean), each within half this of the larger input.
    tolerance = {"bf16": 2**-7, "fp16": 2**-9, "int8": 2 / 127}[codec]
    assert np.all(np.abs(got - exact) <= tolerance * np.maximum(np.abs(x0), np.abs(x1)))


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_error_feedback_keeps_values_near_float32_max_finite(tmp_path: Path, codec: str) -> None:
    # A value at float32's largest plus what the last step lost overflowed to Inf.
    results = run_ranks(cw.near_float32_max_fed_back, 2, (2, str(tmp_path), codec, 4))
    assert all(results[r].ok for r in range(2)), [results[r].message for r in range(2)]
    for step, got in enumerate(results[0].value):
        assert np.isnan(got[3]), step
        finite = np.delete(got, 3)
        assert np.isfinite(finite).all(), (step, np.count_nonzero(~np.isfinite(finite)))
        assert got.tobytes() == results[1].value[step].tobytes(), step


def test_the_float16_clip_leaves_nan_and_inf_non_finite(tmp_path: Path) -> None:
    results = run_ranks(cw.near_float16_max, 2, (2, str(tmp_path), 3, 4_099, True))
    assert all(results[r].ok for r in range(2)), [results[r].message for r in range(2)]
    for step in range(3):
        got = results[0].value[step][1]
        assert np.isnan(got[[10, 20]]).all(), step  # int8 decodes NaN and Inf as NaN
        assert np.isfinite(np.delete(got, [10, 20])).all(), step
        assert got.tobytes() == results[1].value[step][1].tobytes(), step


def test_an_int8_block_up_to_65504_decodes_within_it() -> None:
    # What lets error feedback clip at 65504: no int8 code of such a block decodes past it.
    codec = CODECS["int8"]
    rng = np.random.default_rng(65504)
    rows = rng.uniform(-1, 1, (4096, BLOCK)) * rng.uniform(0, 65504, (4096, 1))
    rows[::2, 0] = 65504  # half the blocks at 65504 exactly, the rest below
    rows[1::4] = np.clip(rows[1::4] * 1e3, -65504, 65504)  # many values at or near it
    x = rows.astype(np.float32).reshape(-1)
    scales = np.empty(codec.scale_count(len(x)), np.float32)
    codes = np.empty(len(x), np.int8)
    codec.encode(x, scales, codes)
    decoded = np.empty(len(x), np.float32)
    codec.decode(scales, codes, decoded)
    assert np.abs(decoded).max() == F16_MAX
    as_float16 = np.empty(len(x), np.float16)
    codec.decode(scales, codes, as_float16)
    assert np.isfinite(as_float16).all()


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_nan_and_inf_stay_non_finite(tmp_path: Path, codec: str) -> None:
    results = run_ranks(cw.nonfinite, 2, (2, str(tmp_path), codec, False))
    for r in range(2):
        got = results[r].value[2]
        assert not np.isfinite(got[10])
        assert np.isnan(got[20])
        assert np.isfinite(np.delete(got, [10, 20])).all()
    assert _bits(results[0].value) == _bits(results[1].value)


def test_check_finite_still_names_the_rank_before_compressing(tmp_path: Path) -> None:
    results = run_ranks(cw.nonfinite, 2, (2, str(tmp_path), "int8", True))
    for r in range(2):
        assert results[r].error_type == "NonFiniteGradError", results[r].message
        assert "rank 1" in results[r].message
        assert "param 2" in results[r].message


# -- configuration ---------------------------------------------------------------------


def test_compression_and_error_feedback_default_off(tmp_path: Path) -> None:
    cfg = FileGradSyncConfig(2, 0, tmp_path)
    assert (cfg.compression, cfg.error_feedback) == (None, False)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"compression": "int4"},
            "compression must be one of (None, 'bf16', 'fp16', 'int8'), got 'int4'",
        ),
        (
            {"compression": "BF16"},
            "compression must be one of (None, 'bf16', 'fp16', 'int8'), got 'BF16'",
        ),
        ({"error_feedback": 1}, "error_feedback must be a bool, got 1"),
        (
            {"error_feedback": True},
            "error_feedback=True needs a compression, got compression=None",
        ),
    ],
)
def test_bad_compression_settings_are_refused(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        FileGradSyncConfig(2, 0, tmp_path, **kw)
    assert str(info.value) == message


def _env(**extra: str) -> dict[str, str]:
    return {"GRADSYNC_WORLD_SIZE": "2", "GRADSYNC_RANK": "1", "GRADSYNC_SYNC_DIR": "/x", **extra}


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"GRADSYNC_COMPRESSION": "int8"}, ("int8", False)),
        ({"GRADSYNC_COMPRESSION": "none"}, (None, False)),
        ({"GRADSYNC_COMPRESSION": ""}, (None, False)),
        ({"GRADSYNC_COMPRESSION": "bf16", "GRADSYNC_ERROR_FEEDBACK": "yes"}, ("bf16", True)),
        ({"GRADSYNC_COMPRESSION": "int8", "GRADSYNC_COMPRESS_LOCAL": "1"}, ("int8", False, True)),
    ],
)
def test_compression_from_the_environment(env: dict[str, str], want: tuple[Any, ...]) -> None:
    cfg = FileGradSyncConfig.from_env(env=_env(**env))
    got = (cfg.compression, cfg.error_feedback, cfg.compress_local)
    assert got[: len(want)] == want


def test_a_bad_compression_variable_is_named() -> None:
    with pytest.raises(ConfigError, match=r"GRADSYNC_COMPRESSION='zip'.*got 'zip'"):
        FileGradSyncConfig.from_env(env=_env(GRADSYNC_COMPRESSION="zip"))
