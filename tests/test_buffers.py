"""``GradSync.buffers_like``: gradients that are published without a copy."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradsync
import workers
from ranks import run_ranks


def _expected(world: int, step: int, big: bool) -> list[bytes]:
    shapes = workers.SHAPES_BIG if big else workers.SHAPES
    per_rank = [workers.grads_for(q, step, shapes) for q in range(world)]
    return [m.tobytes() for m in gradsync.average_host_grads(per_rank)]


@pytest.mark.parametrize(
    ("world", "big", "kw", "in_place"),
    [
        (3, True, {}, True),
        (2, True, {"checksums": True}, True),
        (2, True, {"use_mmap": False}, False),  # as on a filesystem shared between hosts
        (2, False, {}, False),  # every rank reduces all: two input files alternate
        (2, True, {"strategy": "root"}, False),  # likewise
    ],
    ids=["sharded-3", "checksums", "unmapped", "small", "root"],
)
def test_buffers_average_like_any_arrays(
    tmp_path: Path, world: int, big: bool, kw: dict[str, object], in_place: bool
) -> None:
    results = run_ranks(workers.shared_buffer_steps, world, (world, str(tmp_path), big, kw))
    for r in range(world):
        out = results[r]
        assert out.ok, out.value
        for step in range(5):
            assert out.value["results"][step] == _expected(world, step, big), (r, step)
        # Published in place (the input file's name links to the buffers' file) only
        # where no reader of a call can still read when the next begins, and never
        # for step 2's other arrays, which leave the buffers as they were.
        assert out.value["linked"] == [in_place, in_place, False, in_place, in_place]
        assert out.value["untouched"]
        assert out.value["first_kept"]


def test_failed_step_leaves_buffers_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 exits once its inputs of call 2 are published: rank 0 reduces its shard,
    # then finds rank 1 gone while waiting for rank 1's shard of the mean.
    monkeypatch.setenv("GRADSYNC_TEST_FAULT", "after_publish@1@2=exit")
    results = run_ranks(
        workers.shared_buffers_then_fail, 2, (2, str(tmp_path)), expect=[0], timeout_s=60
    )
    assert results[0].ok, results[0].value
    assert results[0].value == {"step": 1, "error": "PeerLostError", "kept": True}


def test_one_rank_gets_plain_zeros(tmp_path: Path) -> None:
    with gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path)) as gs:
        bufs = gs.buffers_like([np.ones((2, 3), np.float16), np.ones(4)])
        assert [(b.shape, b.dtype) for b in bufs] == [((2, 3), np.float16), ((4,), np.float64)]
        assert not any(b.any() for b in bufs)
        gs.average(bufs)


class _RequiresGrad:
    def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
        raise RuntimeError("Can't call numpy() on Tensor that requires grad")


@pytest.mark.parametrize(
    ("like", "message"),
    [
        ([], "like is empty: pass at least one array"),
        (np.zeros(3), "like must be a sequence (list or tuple) of arrays, got ndarray"),
        (5, "like must be a sequence (list or tuple) of arrays, got int"),
        (
            [np.zeros(2), np.zeros(2, np.int32)],
            "param 1 has dtype int32; gradsync averages only float16, float32, float64",
        ),
        (
            # As torch's tensors that require grad: a raw RuntimeError, and peers never told.
            [np.zeros(2), _RequiresGrad()],
            "param 1 (_RequiresGrad) cannot be read as a numpy array: RuntimeError: Can't "
            "call numpy() on Tensor that requires grad (for torch: p.detach().numpy() of a "
            "float16/32/64 tensor)",
        ),
    ],
)
def test_bad_like_is_refused(tmp_path: Path, like: object, message: str) -> None:
    # A first call: the rank tries to meet its peer to tell it (for max_wait_s here),
    # then raises its own error, not the rendezvous's.
    cfg = gradsync.FileGradSyncConfig(2, 0, tmp_path, max_wait_s=0.5)
    with gradsync.GradSync(cfg) as gs:
        with pytest.raises(gradsync.InvalidGradsError, match=f"^{re.escape(message)}$"):
            gs.buffers_like(like)  # type: ignore[arg-type]
        assert gs.generation_dir is None  # the peer never came


def test_closed_instance_refuses(tmp_path: Path) -> None:
    gs = gradsync.GradSync(gradsync.FileGradSyncConfig(2, 0, tmp_path))
    gs.close()
    with pytest.raises(gradsync.GradSyncError, match=r"^this GradSync \(rank 0\) is closed$"):
        gs.buffers_like([np.zeros(2)])


# hidden 1200: 0.32 MiB of gradients, in mapped buffers; 16: plain arrays (under 256 KiB).
MAPPED, PLAIN = 1200, 16
# Runs of workers.torch_buffers_recipes: those documented ("keep"), then torch's default
# zero_grad() on every rank ("top", "end") or on rank 1 only ("top:1").
KEPT = [("keep", MAPPED, None), ("keep", MAPPED, 2), ("keep", PLAIN, None), ("keep", PLAIN, 2)]
DROPPED = [("top", MAPPED, None), ("end", MAPPED, None), ("top", PLAIN, None)]
DROPPED += [("end", PLAIN, None), ("top:1", MAPPED, None)]


@pytest.fixture(scope="module")
def torch_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """What each of 2 ranks returned from workers.torch_buffers_all: the torch tests
    below share its rank processes, each of which imports torch once."""
    pytest.importorskip("torch")
    sync_dir = str(tmp_path_factory.mktemp("torch"))
    results = run_ranks(workers.torch_buffers_all, 2, (2, sync_dir, KEPT + DROPPED), timeout_s=180)
    for r in range(2):
        assert results[r].ok, results[r].value
    return [results[r].value for r in range(2)]


def test_torch_grads_can_live_in_buffers(torch_ranks: list[Any]) -> None:
    # README: p.grad = torch.from_numpy(buffer) and zero_grad(set_to_none=False) keep
    # backward() accumulating into the buffers, so every step publishes without a copy.
    outs = [torch_ranks[r]["in_buffers"] for r in range(2)]
    for r in range(2):
        assert outs[r]["in_buffers"] == [True, True, True]
        assert outs[r]["linked"] == [True, True, True]
    dtypes = [np.float32] * 4
    for step in range(3):
        per_rank = [
            [np.frombuffer(b, dt) for b, dt in zip(outs[r]["before"][step], dtypes, strict=True)]
            for r in range(2)
        ]
        want = [m.tobytes() for m in gradsync.average_host_grads(per_rank)]
        assert outs[0]["after"][step] == want
        assert outs[1]["after"][step] == want


def test_buffers_averaged_again_unwritten_fail(tmp_path: Path) -> None:
    # Step 1 averages step 0's mean again (no rank wrote the buffers): it looks stale,
    # and step 2, the same in full, fails on every rank; mapped and plain alike.
    results = run_ranks(workers.buffers_left_unwritten, 2, (2, str(tmp_path)))
    for r in range(2):
        assert results[r].ok, results[r].message
        for out in results[r].value:
            assert out is not None, "the ranks averaged unwritten buffers and went on"
            assert out[:2] == ("InvalidGradsError", 2), out
            assert out[2].startswith("step 2: the buffers_like arrays hold exactly the mean")


def test_torch_zero_grad_that_drops_the_buffers_fails(torch_ranks: list[Any]) -> None:
    # torch's zero_grad() sets p.grad = None: backward() then makes new tensors, the
    # buffers keep the last mean, and each rank stepped with its own gradients (exit 0,
    # different weights on every rank). Every rank now fails, at its third call; where
    # only one rank does it, at its second, and its peer hears why from it.
    outs = [torch_ranks[r]["recipes"][len(KEPT) :] for r in range(2)]
    for r in range(2):
        kinds = [out[0] for out in outs[r]]
        assert kinds[:4] == ["InvalidGradsError"] * 4, "ranks averaged stale buffers and went on"
        for _, step, message in outs[r][:4]:
            assert step == 2, message
            assert message.startswith("step 2: the buffers_like arrays "), message
            assert "(torch: zero_grad() with set_to_none=True, its default, replaced" in message
            assert "Call optimizer.zero_grad(set_to_none=False), or average" in message
    assert outs[1][4][:2] == ("InvalidGradsError", 1), outs[1][4]
    assert outs[0][4][:2] == ("PeerAbortedError", 1), outs[0][4]
    assert "rank 1 (" in outs[0][4][2]
    assert "the buffers_like arrays hold exactly the mean the last call" in outs[0][4][2]


def test_torch_buffers_kept_train_on(torch_ranks: list[Any]) -> None:
    # The recipe as documented, with a frozen layer and an unused param in the buffers
    # (never written), and with gradients exactly zero from step 2 on: never taken for
    # buffers that nothing wrote into, and one model on both ranks.
    kept = [torch_ranks[r]["recipes"][: len(KEPT)] for r in range(2)]
    for r in range(2):
        assert [kind for kind, _ in kept[r]] == ["ok"] * 4, kept[r]
    assert kept[0] == kept[1]
