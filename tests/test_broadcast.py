"""GradSync.broadcast: the root's arrays, bit for bit, on every rank, as one call ordered
with averaging calls; mismatches fail every rank alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import broadcast_workers as bw
import gradsync
from ranks import run_ranks


@pytest.mark.parametrize(
    "kw",
    [{}, {"checksums": True}, {"use_mmap": False, "big": True}],
    ids=["mapped", "checksums", "unmapped-sharded"],
)
def test_broadcast_interleaved_with_averages_is_bit_exact_for_every_dtype(
    tmp_path: Path, kw: dict[str, Any]
) -> None:
    out = run_ranks(bw.interleaved, 3, [3, str(tmp_path), kw])
    for rank in range(3):
        assert out[rank].ok, out[rank].value
        got = out[rank].value
        assert got[0::2] == [2.0, 2.0, 2.0, 2.0]  # the mean of 1, 2, 3 each time
        for i, root in enumerate([0, 2, 1]):
            assert got[1 + 2 * i] == bw.raw(bw.arrays_of(root)), (rank, root)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "shape",
            "broadcast: param 2: rank 0 has shape (13,) int64 but rank 1 has shape (4,) int64",
        ),
        (
            "dtype",
            "broadcast: param 2: rank 0 has shape (13,) int64 but rank 1 has shape (13,) float64",
        ),
        ("root", "ranks disagree on the broadcast's root: rank 0 gives 0, rank 1 1"),
        ("average", "rank 0 called broadcast but rank 1 called average"),
    ],
)
def test_a_mismatched_broadcast_fails_naming_the_param_and_ranks(
    tmp_path: Path, kind: str, message: str
) -> None:
    out = run_ranks(bw.mismatched, 2, [2, str(tmp_path), kind])
    assert not out[0].ok
    assert out[0].error_type == "MismatchError", out[0].message
    assert message in out[0].message
    assert out[0].attrs["ranks"] == (0, 1)
    assert not out[1].ok, out[1].value  # and the other rank fails too
    assert "MismatchError" in out[1].attrs["mro"], out[1].message


def test_a_failed_broadcast_leaves_the_receivers_arrays_as_they_were(tmp_path: Path) -> None:
    out = run_ranks(bw.receiver_unchanged_on_a_mismatch, 2, [2, str(tmp_path)])
    assert out[1].value is True


def test_a_broadcast_from_a_dead_root_raises_peer_lost(tmp_path: Path) -> None:
    out = run_ranks(bw.from_a_dead_root, 2, [2, str(tmp_path)], expect=[1])
    assert out[1].error_type == "PeerLostError", out[1].message
    assert out[1].attrs["ranks"] == (0,)


def test_one_rank_validates_and_leaves_the_arrays(tmp_path: Path) -> None:
    arrays = bw.arrays_of(0)
    before = bw.raw(arrays)
    with gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path)) as gs:
        gs.broadcast(arrays)
        assert bw.raw(arrays) == before
        with pytest.raises(gradsync.InvalidGradsError, match="param 1 has dtype object"):
            gs.broadcast([np.zeros(2), np.array([None])])
    with (
        gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path)) as gs,
        pytest.raises(gradsync.ConfigError, match="root must be <= 0, got 1"),
    ):
        gs.broadcast(arrays, root=1)
