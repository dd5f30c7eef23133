"""benchmarks/allreduce.py's rounds: ratios are taken within a round, then the median."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def allreduce(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import allreduce  # noqa: PLC0415

    return allreduce


def _round(ar: Any, gradsync_ms: tuple[float, float], mpi_ms: float, rss: int) -> list[Any]:
    row = ar.Row
    mib = 1 << 20
    rows = [
        row("tmpfs", 2, "16MiB", "gradsync", 16 * mib, median_ms=gradsync_ms[0], extra_rss=rss),
        row("tmpfs", 2, "100x16MiB", "gradsync", 16 * mib, median_ms=gradsync_ms[1]),
        row("-", 2, "16MiB", "mpi", 16 * mib, median_ms=mpi_ms),
    ]
    for r in rows:
        r.p90_ms, r.steps, r.identical, r.max_rel_err = r.median_ms, 10, True, 1e-7
    ar.add_ratios(rows)
    return rows


def test_rounds_combine_to_medians_of_same_round_ratios(allreduce: Any) -> None:
    # MPI's speed drifts between rounds as much as gradsync's: the ratio of the medians
    # (4.0 / 3.0 = 1.33x) would judge the drift; the median of the ratios is 1.0x.
    rounds = [
        _round(allreduce, (2.0, 2.4), 2.0, 100),
        _round(allreduce, (4.0, 4.4), 4.0, 300),
        _round(allreduce, (6.0, 9.0), 3.0, 200),
    ]
    combined = {(r.workload, r.peer): r for r in allreduce.combine_rounds(rounds)}
    one = combined[("16MiB", "gradsync")]
    assert one.median_ms == 4.0
    assert one.vs_mpi == 1.0  # ratios 1.0, 1.0, 2.0
    assert one.extra_rss == 300  # the worst round
    assert one.steps == 30
    many = combined[("100x16MiB", "gradsync")]
    assert many.vs_one_tensor == pytest.approx(1.2)  # ratios 1.2, 1.1, 1.5
    assert combined[("16MiB", "mpi")].median_ms == 3.0


def test_one_round_is_left_as_measured(allreduce: Any) -> None:
    rows = _round(allreduce, (2.0, 3.0), 4.0, 100)
    assert allreduce.combine_rounds([rows]) is rows
    assert rows[0].vs_mpi == 0.5
    assert rows[1].vs_one_tensor == 1.5


def test_a_failed_round_fails_the_row(allreduce: Any) -> None:
    good = _round(allreduce, (2.0, 2.4), 2.0, 100)
    bad = _round(allreduce, (2.0, 2.4), 2.0, 100)
    bad[0].ok, bad[0].error = False, "rank 1 died"
    combined = allreduce.combine_rounds([good, bad])
    row = next(r for r in combined if r.workload == "16MiB" and r.peer == "gradsync")
    assert (row.ok, row.error) == (False, "rank 1 died")
