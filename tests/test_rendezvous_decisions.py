"""The rendezvous's decisions, as pure functions of what a rank has seen: no files."""

from __future__ import annotations

from pathlib import Path

import pytest

import gradsync
from gradsync._job.decisions import (
    Admit,
    AdmitLook,
    Confirmation,
    Join,
    JoinLook,
    decide_admit,
    decide_confirmation,
    decide_join,
    disagreement,
    settings,
)
from gradsync._job.liveness import MemberInfo


def _member(rank: int, nonce: str) -> MemberInfo:
    return MemberInfo(rank, nonce, "host", "host/boot/ns", 1000 + rank, None)


def test_a_closed_session_ends_the_wait_before_anything_else_is_read() -> None:
    look = JoinLook(closing=True, admitted=True, abort=True, roster=True, timed_out=True)
    assert decide_join(look) == (Join.CLOSED,)


def test_a_joiner_confirms_an_offer_and_looks_again_at_once() -> None:
    look = JoinLook(closing=False, admitted=False, offer=True, check_due=True, timed_out=True)
    assert decide_join(look) == (Join.CONFIRM,)


def test_a_joiner_without_an_offer_checks_for_holders_of_its_rank_when_due() -> None:
    assert decide_join(JoinLook(closing=False, admitted=False, check_due=True)) == (
        Join.CHECK_OTHERS,
        Join.PAUSE,
    )
    assert decide_join(JoinLook(closing=False, admitted=False)) == (Join.PAUSE,)


def test_rank_0s_abort_note_wins_over_a_roster_written_with_it() -> None:
    look = JoinLook(closing=False, admitted=True, abort=True, roster=True)
    assert decide_join(look) == (Join.ABORTED,)
    assert decide_join(JoinLook(closing=False, admitted=True, roster=True)) == (Join.ACCEPT,)


def test_an_admitted_joiner_checks_rank_0_then_times_out_without_warning() -> None:
    look = JoinLook(closing=False, admitted=True, check_due=True, timed_out=True, warn_due=True)
    assert decide_join(look) == (Join.CHECK_LEADER, Join.TIME_OUT)


def test_a_joiner_warns_when_due_and_waits() -> None:
    look = JoinLook(closing=False, admitted=True, warn_due=True)
    assert decide_join(look) == (Join.WARN, Join.PAUSE)


def test_rank_0_writes_the_roster_once_every_rank_confirmed_and_no_rival_is_undecided() -> None:
    assert decide_admit(AdmitLook(False, (), rivals=False, timed_out=True)) is Admit.ROSTER
    assert decide_admit(AdmitLook(False, (), rivals=True)) is Admit.PAUSE
    assert decide_admit(AdmitLook(True, (), rivals=False)) is Admit.CLOSED


def test_rank_0_out_of_time_names_missing_ranks_before_an_undecided_rival() -> None:
    assert decide_admit(AdmitLook(False, (2,), rivals=True, timed_out=True)) is Admit.MISSING
    assert decide_admit(AdmitLook(False, (), rivals=True, timed_out=True)) is Admit.RIVAL
    assert decide_admit(AdmitLook(False, (1,), rivals=False, warn_due=True)) is Admit.WARN


@pytest.mark.parametrize(
    ("member_alive", "known", "known_alive", "agrees", "rank", "expected"),
    [
        (True, "aa", True, True, 1, Confirmation.SEEN),
        (False, None, False, True, 1, Confirmation.DEAD),
        (True, None, False, False, 5, Confirmation.MISMATCH),
        (True, None, False, True, 5, Confirmation.OUT_OF_RANGE),
        (True, "bb", True, True, 1, Confirmation.TWICE),
        (True, "bb", False, True, 1, Confirmation.ADMIT),
        (True, None, False, True, 1, Confirmation.ADMIT),
    ],
    ids=["seen", "dead", "mismatch-first", "out-of-range", "twice", "replaces-dead", "new"],
)
def test_what_rank_0_makes_of_a_confirmation(
    member_alive: bool,
    known: str | None,
    known_alive: bool,
    agrees: bool,
    rank: int,
    expected: Confirmation,
) -> None:
    step = decide_confirmation(
        _member(rank, "aa"),
        None if known is None else _member(rank, known),
        member_alive=member_alive,
        known_alive=known_alive,
        agrees=agrees,
        world_size=4,
    )
    assert step is expected


def test_a_confirmation_with_another_world_size_is_a_mismatch_naming_both_ranks(
    tmp_path: Path,
) -> None:
    cfg = gradsync.FileGradSyncConfig(2, 0, tmp_path)
    joiner = _member(1, "bb")
    error = disagreement(cfg, joiner, {"world_size": 3, "settings": settings(cfg)})
    assert isinstance(error, gradsync.MismatchError)
    assert str(error).startswith("rendezvous: rank 0 has world_size 2 but rank 1 (pid 1001 on")
    assert error.ranks == (0, 1)
    assert disagreement(cfg, joiner, {"world_size": 2, "settings": settings(cfg)}) is None
