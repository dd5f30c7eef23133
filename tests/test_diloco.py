"""``gradsync.DiLoCo``: the outer step, identical on every rank, and its saved state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import diloco_workers
import gradsync
from ranks import run_ranks


@pytest.fixture
def solo(tmp_path: Path) -> Any:
    with gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, str(tmp_path))) as gs:
        yield gs


def test_outer_step_is_nesterov_on_the_pseudo_gradient(solo: gradsync.GradSync) -> None:
    p = np.array([1.0, -2.0])
    dl = gradsync.DiLoCo([p], solo, every=2, outer_lr=0.7, outer_momentum=0.9)
    p -= 0.1
    assert dl.step() is False
    p -= 0.1
    assert dl.step() is True
    # delta 0.2, v = 0.2, theta = start - 0.7 * (0.2 + 0.9 * 0.2)
    np.testing.assert_allclose(p, [0.734, -2.266], rtol=1e-12)
    p -= 0.2
    dl.step()
    dl.step()
    # delta 0.2, v = 0.9 * 0.2 + 0.2 = 0.38, theta = 0.734 - 0.7 * (0.2 + 0.9 * 0.38)
    np.testing.assert_allclose(p, [0.3546, -2.6454], rtol=1e-12)
    assert (dl.calls, dl.syncs) == (4, 2)


def test_a_0d_param_takes_the_outer_step_like_the_others(solo: gradsync.GradSync) -> None:
    # A 0-d param (a scalar torch Parameter's view) failed the sync halfway through.
    w, t = np.array([1.0, -2.0]), np.array(1.0)
    dl = gradsync.DiLoCo([w, t], solo, every=1, outer_lr=0.7, outer_momentum=0.9)
    w -= 0.2
    t -= 0.2
    assert dl.step()
    np.testing.assert_allclose(w, [0.734, -2.266], rtol=1e-12)
    np.testing.assert_allclose(t, 0.734, rtol=1e-12)
    assert t.shape == ()


def test_without_momentum_and_unit_lr_a_sync_keeps_the_params(solo: gradsync.GradSync) -> None:
    p = np.arange(4, dtype=np.float64)
    dl = gradsync.DiLoCo([p], solo, every=1, outer_lr=1.0, outer_momentum=0.0)
    p += 0.5
    assert dl.step()
    np.testing.assert_array_equal(p, np.arange(4) + 0.5)


def _expected_syncs(world: int, every: int, before: dict[int, list[list[bytes]]]) -> list[bytes]:
    """The outer steps computed here from every rank's params before each sync."""
    start = diloco_workers.start_params()
    last = [p.copy() for p in start]
    v = [np.zeros(p.shape, np.float32 if p.dtype == np.float16 else p.dtype) for p in start]
    out = []
    for k in range(len(before[0])):
        now = [
            [
                np.frombuffer(b, p.dtype).reshape(p.shape)
                for b, p in zip(before[r][k], start, strict=True)
            ]
            for r in range(world)
        ]
        deltas = [[a - b for a, b in zip(last, now[r], strict=True)] for r in range(world)]
        mean = gradsync.average_host_grads(deltas)
        for i, d in enumerate(mean):
            v[i] = (0.9 * v[i] + d).astype(v[i].dtype)
            last[i] = (last[i] - 0.7 * (d + 0.9 * v[i])).astype(last[i].dtype)
        out.append(b"".join(p.tobytes() for p in last))
    return out


def test_every_rank_ends_each_sync_with_the_same_bits(tmp_path: Path) -> None:
    world, every, steps = 3, 4, 13
    results = run_ranks(diloco_workers.train, world, (world, str(tmp_path), every, steps))
    for r in range(world):
        assert results[r].ok, results[r].value
    before = {r: results[r].value["before"] for r in range(world)}
    after = [[b"".join(s) for s in results[r].value["after"]] for r in range(world)]
    assert len(after[0]) == steps // every
    assert before[0] != before[1]  # the ranks did drift apart between syncs
    assert after[1] == after[0]
    assert after[2] == after[0]
    assert after[0] == _expected_syncs(world, every, before)
    assert {results[r].value["calls"] for r in range(world)} == {steps}


def test_restoring_the_saved_state_continues_exactly(tmp_path: Path) -> None:
    world, every, steps = 2, 3, 11
    straight = run_ranks(diloco_workers.train, world, (world, str(tmp_path / "a"), every, steps))
    resumed = run_ranks(diloco_workers.train, world, (world, str(tmp_path / "b"), every, steps, 7))
    for r in range(world):
        assert straight[r].ok, straight[r].value
        assert resumed[r].ok, resumed[r].value
        assert resumed[r].value == straight[r].value


def test_ranks_that_start_apart_all_get_a_mismatch_error(tmp_path: Path) -> None:
    results = run_ranks(diloco_workers.start_differently, 2, (2, str(tmp_path)))
    for r in range(2):
        assert results[r].ok, results[r].value
        assert "parameters differ at the start" in results[r].value


@pytest.mark.parametrize("which", ["every", "outer_lr", "outer_momentum"])
def test_ranks_with_other_settings_all_get_a_mismatch_error(tmp_path: Path, which: str) -> None:
    results = run_ranks(diloco_workers.settings_apart, 2, (2, str(tmp_path), which))
    for r in range(2):
        assert results[r].ok, results[r].value
        assert "settings differ" in results[r].value, results[r].value
        assert "rank 1 differs from rank 0" in results[r].value, results[r].value


def test_a_state_loaded_unchecked_on_one_rank_takes_no_collective_call(tmp_path: Path) -> None:
    results = run_ranks(diloco_workers.load_on_one_rank, 2, (2, str(tmp_path)))
    for r in range(2):
        assert results[r].ok, results[r].value
    assert results[0].value == results[1].value


@pytest.mark.parametrize("which", ["last", "calls"])
def test_ranks_that_restore_other_states_all_get_a_mismatch_error(
    tmp_path: Path, which: str
) -> None:
    results = run_ranks(diloco_workers.restore_apart, 2, (2, str(tmp_path), which))
    for r in range(2):
        assert results[r].ok, results[r].value
        assert "restored states differ" in results[r].value, results[r].value
        assert "rank 1 differs from rank 0" in results[r].value, results[r].value


@pytest.mark.parametrize(
    ("compression", "error_feedback"),
    [("bf16", False), ("fp16", False), ("int8", False), ("int8", True)],
)
def test_the_start_check_is_exact_under_compression(
    tmp_path: Path, compression: str, error_feedback: bool
) -> None:
    world = 3
    for apart in (False, True):
        args = (world, str(tmp_path / str(apart)), compression, error_feedback, apart)
        results = run_ranks(diloco_workers.start_compressed, world, args)
        for r in range(world):
            assert results[r].ok, results[r].value
            if apart:
                assert "parameters differ at the start" in results[r].value
                assert "rank 2 " in results[r].value, results[r].value
            else:
                assert results[r].value == "no error"


def test_syncs_of_unmoved_params_keep_them(tmp_path: Path) -> None:
    # Zero deltas are DiLoCo's own, not stale buffers: no InvalidGradsError after 3.
    world = 2
    results = run_ranks(diloco_workers.frozen, world, (world, str(tmp_path), 5))
    start = [p.tobytes() for p in diloco_workers.start_params()]
    for r in range(world):
        assert results[r].ok, results[r].message
        assert results[r].value == start


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"every": 0}, gradsync.ConfigError, "every must be an int >= 1"),
        ({"every": 2.0}, gradsync.ConfigError, "every must be an int"),
        ({"every": 2, "outer_lr": 0.0}, gradsync.ConfigError, "outer_lr"),
        ({"every": 2, "outer_lr": float("nan")}, gradsync.ConfigError, "outer_lr"),
        ({"every": 2, "outer_momentum": 1.0}, gradsync.ConfigError, "outer_momentum"),
    ],
)
def test_bad_settings_are_config_errors(
    solo: gradsync.GradSync, kw: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        gradsync.DiLoCo([np.zeros(2)], solo, **kw)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ([], "non-empty sequence"),
        ([np.zeros(2), [1.0]], "param 1 is a list"),
        ([np.zeros(2, np.int32)], "param 0 has dtype int32"),
        ([np.zeros((3, 4))[:, 1]], "param 0 must be C-contiguous"),
    ],
)
def test_bad_params_are_invalid_grads_errors(
    solo: gradsync.GradSync, params: list[Any], match: str
) -> None:
    with pytest.raises(gradsync.InvalidGradsError, match=match):
        gradsync.DiLoCo(params, solo, every=2)


def test_gs_must_be_a_gradsync() -> None:
    with pytest.raises(gradsync.ConfigError, match="gs must be a GradSync"):
        gradsync.DiLoCo([np.zeros(2)], object(), every=2)  # type: ignore[arg-type]


def test_a_state_of_other_shapes_is_refused(solo: gradsync.GradSync) -> None:
    state = gradsync.DiLoCo([np.zeros(3)], solo, every=2).state_dict()
    other = gradsync.DiLoCo([np.zeros(4)], solo, every=2)
    with pytest.raises(gradsync.ConfigError, match=r"state 'last'\[0\]"):
        other.load_state_dict(state)
    with pytest.raises(gradsync.ConfigError, match="every=2"):
        gradsync.DiLoCo([np.zeros(3)], solo, every=5).load_state_dict(state)


def test_a_state_of_fractional_counts_is_refused(solo: gradsync.GradSync) -> None:
    dl = gradsync.DiLoCo([np.zeros(3)], solo, every=2)
    state = {**dl.state_dict(), "calls": 3.7}
    with pytest.raises(gradsync.ConfigError, match="not a DiLoCo state_dict"):
        dl.load_state_dict(state)
    dl.load_state_dict({**state, "calls": np.int64(3)})  # as a numpy archive gives it back
    assert dl.calls == 3
