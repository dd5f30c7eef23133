"""The "gradsync" torch.distributed backend: DDP against gloo, hooks, exact collectives.

Each world size runs once (one spawned process per rank, always reaped); the tests
below check parts of what the ranks returned.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the backend needs torch (gradsync[torch])")

from ranks import run_ranks  # noqa: E402

STEPS = 50
HOOK_STEPS = 8


def _model(big: bool = False) -> Any:
    """A small CNN; ``big``: an MLP that DDP cuts into two buckets of its own (1.28 and
    0.79 MB, both past gradsync's one-file size): calls of two sizes in turn."""
    torch.manual_seed(0)  # the same initial weights on every rank, for both backends
    nn = torch.nn
    if big:
        return nn.Sequential(
            nn.Flatten(), nn.Linear(256, 300), nn.ReLU(), nn.Linear(300, 400), nn.ReLU(),
            nn.Linear(400, 800),
        )  # fmt: skip
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10))


def _train(
    rank: int, group: Any, steps: int, hook: str | None = None, big: bool = False
) -> list[bytes]:
    """``steps`` SGD steps of DDP over ``group``; the final parameters' bytes (``big``:
    then the number of buckets DDP reduced, as bytes)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # noqa: PLC0415

    model = torch.nn.parallel.DistributedDataParallel(_model(big), process_group=group)
    if hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        # DDP refuses the hook by its name without CUDA and NCCL; under another it runs.
        def bf16_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            return default_hooks.bf16_compress_hook(state, bucket)

        model.register_comm_hook(group, bf16_hook)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(8, 1, 16 if big else 8, 16 if big else 8, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    params = [p.detach().numpy().tobytes() for p in model.module.parameters()]
    if big:  # torch's own (private) record of the buckets it made
        params.append(str(model._get_ddp_logging_data()["num_buckets_reduced"]).encode())
    return params


def _collectives(rank: int, world: int, dist: Any) -> dict[str, Any]:
    """Broadcast, allgather and non-float allreduces of awkward bits; what came back."""
    rng = np.random.default_rng(rank)
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], np.float32)
    mine = {
        "f32": torch.from_numpy(np.concatenate([special, rng.standard_normal(7, np.float32)])),
        "bf16": torch.from_numpy(rng.standard_normal(5).astype(np.float32)).bfloat16(),
        "i64": torch.from_numpy(rng.integers(-(2**62), 2**62, 9)),
        "u8": torch.from_numpy(rng.integers(0, 256, 11, dtype=np.uint8)),
        "bool": torch.from_numpy(rng.integers(0, 2, 3).astype(bool)),
    }
    out: dict[str, Any] = {"mine": {k: _bits(v) for k, v in mine.items()}}
    for name, t in mine.items():
        b = t.clone()
        dist.broadcast(b, src=world - 1)
        out[f"broadcast {name}"] = _bits(b)
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)
        out[f"allgather {name}"] = [_bits(g) for g in gathered]
    ints = torch.tensor([rank + 1, -(2**40) * rank, 7], dtype=torch.int64)
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"):
        r = ints.clone()
        dist.all_reduce(r, op=getattr(dist.ReduceOp, op))
        out[f"allreduce {op}"] = r.tolist()
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    except ValueError as exc:  # at the call, on every rank, before any step
        out["float BAND"] = str(exc)
    avg = torch.from_numpy(rng.standard_normal(6, np.float32))
    out["avg in"] = avg.numpy().tobytes()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    out["avg"] = avg.numpy().tobytes()
    for name, dtype in (("f32", np.float32), ("f16", np.float16)):
        summed = torch.from_numpy(rng.standard_normal(9).astype(dtype))
        out[f"sum {name} in"] = summed.numpy().tobytes()
        strided = summed.clone()[::2]  # not contiguous: averaged through a copy
        dist.all_reduce(summed)  # SUM, as DDP's default hook calls it
        dist.all_reduce(strided)
        out[f"sum {name}"] = (summed.numpy().tobytes(), strided.contiguous().numpy().tobytes())
    works = [dist.all_reduce(torch.ones(3), async_op=True) for _ in range(4)]
    out["async sums"] = [w.wait() and True for w in works]
    dist.barrier()
    return out


def _bits(t: Any) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def _rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist  # noqa: PLC0415

    import gradsync.torch  # noqa: F401, PLC0415

    os.environ["GRADSYNC_SYNC_DIR"] = os.path.join(tmp, "sync")
    os.environ["GRADSYNC_MAX_WAIT_S"] = "60"
    torch.set_num_threads(1)
    init = f"file://{os.path.join(tmp, 'store')}"
    dist.init_process_group("gradsync", init_method=init, rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    out: dict[str, Any] = {
        "backend": dist.get_backend(),
        "gradsync": _train(rank, None, STEPS),
        "gloo": _train(rank, gloo, STEPS),
        "fp16": _train(rank, None, HOOK_STEPS, "fp16"),
        "bf16": _train(rank, None, HOOK_STEPS, "bf16"),
        "powersgd": _train(rank, None, HOOK_STEPS, "powersgd"),
        "plain": _train(rank, None, HOOK_STEPS),
        "buckets": _train(rank, None, HOOK_STEPS, big=True),
        "gloo buckets": _train(rank, gloo, HOOK_STEPS, big=True),
    }
    out.update(_collectives(rank, world, dist))
    dist.destroy_process_group()
    return out


@functools.cache
def _run(world: int, tmp: str) -> dict[int, dict[str, Any]]:
    outcomes = run_ranks(_rank, world, (world, tmp), timeout_s=100)
    assert all(o.ok for o in outcomes.values()), {r: o.value for r, o in outcomes.items()}
    return {r: o.value for r, o in outcomes.items()}


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world: int = request.param
    return _run(world, str(tmp_path_factory.mktemp(f"w{world}")))


def _params(raw: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer(b, np.float32) for b in raw]


def test_the_default_group_is_gradsync(ranks: dict[int, dict[str, Any]]) -> None:
    assert {out["backend"] for out in ranks.values()} == {"gradsync"}


def test_ddp_over_gradsync_is_bit_identical_across_ranks(ranks: dict[int, dict[str, Any]]) -> None:
    for key in ("gradsync", "fp16", "bf16", "powersgd"):
        assert len({tuple(out[key]) for out in ranks.values()}) == 1, key


def test_ddp_over_gradsync_matches_ddp_over_gloo_after_50_steps(
    ranks: dict[int, dict[str, Any]],
) -> None:
    for got, want in zip(_params(ranks[0]["gradsync"]), _params(ranks[0]["gloo"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_ddp_with_its_own_two_buckets_matches_gloo_and_every_rank(
    ranks: dict[int, dict[str, Any]],
) -> None:
    # Two bucket sizes in turn: each rank's data file keeps the larger size, and readers
    # take the longer file by its header.
    *got, buckets = ranks[0]["buckets"]
    *want, gloo_buckets = ranks[0]["gloo buckets"]
    assert (buckets, gloo_buckets) == (b"2", b"2")
    assert len({tuple(out["buckets"]) for out in ranks.values()}) == 1
    for mine, theirs in zip(_params(got), _params(want), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_ddp_comm_hooks_train_close_to_the_plain_run(
    ranks: dict[int, dict[str, Any]], hook: str
) -> None:
    tol = {"fp16": 1e-3, "bf16": 1e-2, "powersgd": 5e-2}[hook]
    for got, want in zip(_params(ranks[0][hook]), _params(ranks[0]["plain"]), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_broadcast_and_allgather_are_bit_exact_for_any_dtype(
    ranks: dict[int, dict[str, Any]],
) -> None:
    world = len(ranks)
    for name in ("f32", "bf16", "i64", "u8", "bool"):
        every = [ranks[r]["mine"][name] for r in range(world)]
        for r in range(world):
            assert ranks[r][f"broadcast {name}"] == every[world - 1], (name, r)
            assert ranks[r][f"allgather {name}"] == every, (name, r)


def test_integer_allreduces_are_exact(ranks: dict[int, dict[str, Any]]) -> None:
    world = len(ranks)
    rows = [[r + 1, -(2**40) * r, 7] for r in range(world)]
    want = {
        "SUM": [sum(c) for c in zip(*rows, strict=True)],
        "MAX": [max(c) for c in zip(*rows, strict=True)],
        "MIN": [min(c) for c in zip(*rows, strict=True)],
        "PRODUCT": [int(np.prod(c)) for c in zip(*rows, strict=True)],
        "BAND": [functools.reduce(operator.and_, c) for c in zip(*rows, strict=True)],
        "BOR": [functools.reduce(operator.or_, c) for c in zip(*rows, strict=True)],
        "BXOR": [functools.reduce(operator.xor, c) for c in zip(*rows, strict=True)],
    }
    for out in ranks.values():
        for op, values in want.items():
            assert out[f"allreduce {op}"] == values, op
        assert out["float BAND"] == "gradsync: allreduce BAND needs integer or bool tensors"


def test_avg_is_gradsyncs_mean_and_async_works_complete(
    ranks: dict[int, dict[str, Any]],
) -> None:
    import gradsync  # noqa: PLC0415

    world = len(ranks)
    inputs = [[np.frombuffer(ranks[r]["avg in"], np.float32)] for r in range(world)]
    want = gradsync.average_host_grads(inputs)[0].tobytes()
    for out in ranks.values():
        assert out["avg"] == want
        assert out["async sums"] == [True] * 4


def test_float_sum_is_the_mean_times_the_world_size_on_every_rank(
    ranks: dict[int, dict[str, Any]],
) -> None:
    import gradsync  # noqa: PLC0415

    world = len(ranks)
    for name, dtype in (("f32", np.float32), ("f16", np.float16)):
        inputs = [np.frombuffer(ranks[r][f"sum {name} in"], dtype) for r in range(world)]
        # float16: the mean and its product in float32, rounded once to float16.
        wide = [a.astype(np.float32) for a in inputs]
        whole = gradsync.average_host_grads([[a.copy()] for a in wide])[0] * np.float32(world)
        every_other = gradsync.average_host_grads([[a[::2].copy()] for a in wide])[0]
        every_other *= np.float32(world)
        want = (whole.astype(dtype).tobytes(), every_other.astype(dtype).tobytes())
        for out in ranks.values():
            assert out[f"sum {name}"] == want, name


def _join(rank: int, world: int, tmp: str, **env: str) -> Any:
    """torch.distributed with this rank in a "gradsync" default group (its sync dir
    under ``tmp``, ``env`` set first)."""
    import torch.distributed as dist  # noqa: PLC0415

    import gradsync.torch  # noqa: F401, PLC0415

    os.environ.update(GRADSYNC_SYNC_DIR=os.path.join(tmp, "sync"), **env)
    dist.init_process_group("gradsync", store=dist.HashStore(), rank=rank, world_size=world)
    return dist


def _on_two_ranks(
    body: Callable[[int, int, str], Any], tmp_path: Path, timeout_s: float = 60
) -> list[tuple[int, Any]]:
    """``body(rank, 2, tmp)`` on 2 spawned ranks, each checked to have returned: (rank,
    value) of each."""
    out = run_ranks(body, 2, (2, str(tmp_path)), timeout_s=timeout_s)
    for r in range(2):
        assert out[r].ok, out[r].value
    return [(r, out[r].value) for r in range(2)]


def _one_rank_dies(rank: int, world: int, tmp: str) -> str:
    """Rank 1 dies after one allreduce; rank 0's next one fails (its work's wait raises)."""
    dist = _join(rank, world, tmp)
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(3)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    try:
        work.wait()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_dead_peer_fails_the_collective_instead_of_hanging(tmp_path: Path) -> None:
    out = run_ranks(_one_rank_dies, 2, (2, str(tmp_path)), timeout_s=60, expect=[0])
    assert out[0].ok, out[0].value
    assert "rank 1" in out[0].value, out[0].value


def _compressed_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """:func:`_collectives` with every float step int8-compressed, and empty tensors."""
    torch.set_num_threads(1)
    dist = _join(
        rank,
        world,
        tmp,
        GRADSYNC_COMPRESSION="int8",
        GRADSYNC_COMPRESS_LOCAL="1",
        GRADSYNC_ERROR_FEEDBACK="1",
    )
    out = _collectives(rank, world, dist)
    empty = torch.empty(0, dtype=torch.int64)
    dist.all_reduce(empty, op=dist.ReduceOp.MAX)
    gathered = [torch.ones(0, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(gathered, torch.empty(0, dtype=torch.int32))
    out["empty"] = [tuple(t.shape) for t in (empty, *gathered)]
    dist.destroy_process_group()
    return out


def test_exact_collectives_stay_exact_when_compression_is_on(tmp_path: Path) -> None:
    # They travel as float64 steps: compressed, their words came back rounded or zeroed.
    world = 2
    outcomes = run_ranks(_compressed_rank, world, (world, str(tmp_path)), timeout_s=100)
    assert all(o.ok for o in outcomes.values()), {r: o.value for r, o in outcomes.items()}
    ranks = {r: o.value for r, o in outcomes.items()}
    test_broadcast_and_allgather_are_bit_exact_for_any_dtype(ranks)
    test_integer_allreduces_are_exact(ranks)
    assert all(out["empty"] == [(0,)] * (1 + world) for out in ranks.values())


def _then_added_after_a_later_collective(rank: int, world: int, tmp: str) -> list[float]:
    """Allreduces a, b started; then a's future gets a callback that allreduces c. Rank 0
    adds it while a waits for rank 1, rank 1 once a is over: c must follow b on both."""
    import time  # noqa: PLC0415

    dist = _join(rank, world, tmp)
    a, b, c = (torch.full((4,), k * (rank + 1)) for k in (1.0, 10.0, 100.0))
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)  # rank 0's a waits for this rank meanwhile
    first = dist.all_reduce(a, op=dist.ReduceOp.AVG, async_op=True)
    second = dist.all_reduce(b, op=dist.ReduceOp.AVG, async_op=True)
    if rank == 1:
        first.wait()
    started: list[Any] = []
    first.get_future().then(
        lambda f: started.append(dist.all_reduce(c, op=dist.ReduceOp.AVG, async_op=True))
    )
    second.wait()
    deadline = time.monotonic() + 30
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
    started[0].wait()
    dist.destroy_process_group()
    return [t[0].item() for t in (a, b, c)]


def test_a_collective_a_late_then_callback_starts_follows_the_ones_called_before(
    tmp_path: Path,
) -> None:
    # Rank 0 ran c before b and rank 1 after it: each averaged its c with the other's b.
    for r, got in _on_two_ranks(_then_added_after_a_later_collective, tmp_path):
        assert got == [1.5, 15.0, 150.0], (r, got)


def _into_tensors_that_require_grad(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Collectives writing into parameters (tensors that require grad), as over gloo."""
    dist = _join(rank, world, tmp)
    param = torch.nn.Parameter
    out: dict[str, Any] = {}
    p = param(torch.full((3,), rank + 1.0))
    with torch.no_grad():  # no_grad holds on this thread only, not on gradsync's
        dist.all_reduce(p)
    out["in place"] = p.tolist()
    p = param(torch.full((3, 2), rank + 1.0).t())  # not contiguous: through a copy
    dist.all_reduce(p)
    out["strided"] = p.tolist()
    p = param(torch.full((3,), rank + 1.0, dtype=torch.bfloat16))
    dist.all_reduce(p, op=dist.ReduceOp.AVG)
    out["bf16"] = p.float().tolist()
    p = param(torch.full((2, 2), rank + 1.0).t())
    dist.broadcast(p, src=1)
    out["broadcast"] = p.tolist()
    outs = [param(torch.zeros(2)) for _ in range(world)]
    with torch.no_grad():
        dist.all_gather(outs, torch.full((2,), float(rank)))
    out["allgather"] = [o.tolist() for o in outs]
    out["require grad"] = all(o.requires_grad for o in outs)
    dist.destroy_process_group()
    return out


def test_collectives_write_into_tensors_that_require_grad(tmp_path: Path) -> None:
    for r, got in _on_two_ranks(_into_tensors_that_require_grad, tmp_path):
        assert got == {
            "in place": [3.0] * 3,
            "strided": [[3.0] * 3] * 2,
            "bf16": [1.5] * 3,
            "broadcast": [[2.0] * 2] * 2,
            "allgather": [[0.0] * 2, [1.0] * 2],
            "require grad": True,
        }, (r, got)


def _allgather_into_wrong_outputs(rank: int, world: int, tmp: str) -> dict[str, str]:
    """Outputs that cannot hold the inputs as they are, then a right allgather."""
    dist = _join(rank, world, tmp)
    x = torch.arange(6.0) + rank
    wrong = {
        "shape": [torch.empty(2, 3) for _ in range(world)],
        "size": [torch.empty(5) for _ in range(world)],
        "count": [torch.empty(6) for _ in range(world + 1)],
        "leaf": [torch.zeros(6, requires_grad=True) for _ in range(world)],
    }
    out: dict[str, str] = {}
    for name, outs in wrong.items():
        try:
            dist.all_gather(outs, x)
            out[name] = f"filled {[o.tolist() for o in outs]}"
        except ValueError as exc:
            out[name] = str(exc)
    outs = [torch.empty(6) for _ in range(world)]
    dist.all_gather(outs, x)
    out["after"] = str([o.tolist() for o in outs])
    dist.destroy_process_group()
    return out


def test_allgather_refuses_outputs_unlike_its_input_at_the_call_as_gloo_does(
    tmp_path: Path,
) -> None:
    # Before, a (2, 3) output of a 6-element input was filled reshaped, without a word.
    for _, got in _on_two_ranks(_allgather_into_wrong_outputs, tmp_path):
        assert "is torch.float32[2, 3] on cpu, expected torch.float32[6]" in got["shape"]
        assert "output 0[0] is torch.float32[5]" in got["size"], got["size"]
        assert "output list 0 holds 3 tensors, expected the world size 2" in got["count"]
        assert "leaf tensor that requires grad" in got["leaf"], got["leaf"]
        assert got["after"] == str([[float(i + q) for i in range(6)] for q in range(2)])


def _shape_of(value: Any) -> Any:
    """A future's value or a work's result: its nesting, with each tensor's values."""
    if isinstance(value, list):
        return [_shape_of(v) for v in value]
    return value.tolist() if isinstance(value, torch.Tensor) else repr(value)


def _futures_and_results(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Each async collective's future value and work result, over gradsync and gloo."""
    import torch.distributed as dist  # noqa: PLC0415

    import gradsync.torch  # noqa: F401, PLC0415

    os.environ["GRADSYNC_SYNC_DIR"] = os.path.join(tmp, "sync")
    init = f"file://{os.path.join(tmp, 'store')}"
    dist.init_process_group("gradsync", init_method=init, rank=rank, world_size=world)
    groups = {"gradsync": None, "gloo": dist.new_group(backend="gloo")}
    out: dict[str, Any] = {}
    for name, group in groups.items():
        x = torch.full((2,), rank + 1.0)
        works = {
            "allreduce": dist.all_reduce(x.clone(), async_op=True, group=group),
            "allreduce int": dist.all_reduce(x.long(), async_op=True, group=group),
            "broadcast": dist.broadcast(x.clone(), src=1, async_op=True, group=group),
            "allgather": dist.all_gather(
                [torch.zeros(2) for _ in range(world)], x, async_op=True, group=group
            ),
            "barrier": dist.barrier(async_op=True, group=group),
        }
        for op, work in works.items():
            value = work.get_future().wait()
            work.wait()  # gloo marks its work complete after its future
            out[f"{name} {op}"] = (_shape_of(value), _shape_of(work.result()))
    dist.barrier()  # no rank tears gloo down while the other still reads from it
    dist.destroy_process_group()
    return out


def test_async_futures_and_results_hold_what_gloos_hold(tmp_path: Path) -> None:
    for r, got in _on_two_ranks(_futures_and_results, tmp_path):
        for op in ("allreduce", "allreduce int", "broadcast", "allgather", "barrier"):
            assert got[f"gradsync {op}"] == got[f"gloo {op}"], (r, op, got)


def _wait_with_a_timeout(rank: int, world: int, tmp: str) -> Any:
    """Rank 0 waits 0.5 s for an allreduce that rank 1 starts only once told (a file)."""
    import datetime  # noqa: PLC0415
    import time  # noqa: PLC0415

    dist = _join(rank, world, tmp)
    go = Path(tmp, "go")
    x = torch.full((2,), rank + 1.0)
    if rank == 1:
        deadline = time.monotonic() + 30
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.all_reduce(x)
        dist.destroy_process_group()
        return x.tolist()
    work = dist.all_reduce(x, async_op=True)
    start = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=0.5))
    except RuntimeError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "returned"
    elapsed = time.monotonic() - start
    go.touch()
    waited = work.wait(timeout=datetime.timedelta(0))  # torch's default: no timeout
    dist.destroy_process_group()
    return outcome, elapsed, waited, x.tolist()


def test_wait_raises_once_its_timeout_passes_and_the_work_goes_on(tmp_path: Path) -> None:
    out = run_ranks(_wait_with_a_timeout, 2, (2, str(tmp_path)), timeout_s=60)
    assert out[1].ok, out[1].value
    assert out[1].value == [3.0, 3.0]
    assert out[0].ok, out[0].value
    outcome, elapsed, waited, value = out[0].value
    assert outcome.startswith("RuntimeError: Operation timed out!"), outcome
    assert "0.5 s" in outcome, outcome
    assert elapsed < 30, elapsed
    assert (waited, value) == (True, [3.0, 3.0])


def _sixteen_bit_sums(rank: int, world: int, tmp: str) -> dict[str, list[float]]:
    """SUMs of 16-bit floats whose mean rounds away in the 16-bit type (subnormals)."""
    dist = _join(rank, world, tmp)
    out = {}
    for name, dtype, unit in (("f16", torch.float16, 2**-24), ("bf16", torch.bfloat16, 2**-133)):
        x = torch.tensor([1.0, 3.0, 5.0]).mul(unit).to(dtype) * (rank == 0)
        strided = torch.stack([x, x], 1)[:, 0]  # not contiguous
        dist.all_reduce(x)
        dist.all_reduce(strided)
        out[name] = [v / unit for v in x.tolist()]
        out[f"{name} strided"] = [v / unit for v in strided.tolist()]
    dist.destroy_process_group()
    return out


def test_a_16_bit_float_sum_rounds_once_as_gloos_does(tmp_path: Path) -> None:
    # Rank 0's values and rank 1's zeros: gloo's sum is rank 0's values exactly.
    for r, got in _on_two_ranks(_sixteen_bit_sums, tmp_path):
        for name in ("f16", "f16 strided", "bf16", "bf16 strided"):
            assert got[name] == [1.0, 3.0, 5.0], (r, name, got)


def _back_to_back(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Two async allreduces of one tensor, then one more op on it: each reads what the one
    before wrote, for every dtype and layout."""
    dist = _join(rank, world, tmp)
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = torch.tensor([rank + 1], dtype=dtype)
        strided = torch.tensor([[rank + 1] * 2] * 2, dtype=dtype).t()  # not contiguous
        works = [dist.all_reduce(x, async_op=True) for x in (t, t, strided, strided)]
        works.append(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
        gathered = [torch.zeros(1, dtype=dtype) for _ in range(world)]
        works.append(dist.all_gather(gathered, t, async_op=True))
        works.append(dist.all_reduce(strided, op=dist.ReduceOp.MIN, async_op=True))
        works.append(dist.broadcast(strided, src=0, async_op=True))
        for w in works:
            w.wait()
        out[str(dtype)] = {
            "t": t.tolist(),
            "strided": strided.tolist(),
            "gathered": [g.tolist() for g in gathered],
        }
    dist.destroy_process_group()
    return out


def test_async_collectives_on_one_tensor_read_it_in_the_order_called(tmp_path: Path) -> None:
    # 1 and 2 summed twice: 3, then 6; every later collective reads 6 on both ranks.
    for r, got in _on_two_ranks(_back_to_back, tmp_path):
        for dtype in ("torch.float32", "torch.bfloat16", "torch.int64"):
            want = {"t": [6], "strided": [[6, 6]] * 2, "gathered": [[6], [6]]}
            assert got[dtype] == want, (r, dtype, got)


def _uneven_inputs(rank: int, world: int, tmp: str) -> dict[str, str]:
    """Exact collectives of inputs that differ between the ranks (but pad to as many
    32-bit words), or of different ops: what each raised."""
    dist = _join(rank, world, tmp, GRADSYNC_MAX_WAIT_S="30")
    longer = torch.arange(5 + rank, dtype=torch.uint8)  # 5 and 6 bytes: 2 words each
    other = torch.ones(1, dtype=torch.int64) if rank == 0 else torch.ones(2, dtype=torch.int32)
    calls = {
        "sizes": lambda: dist.all_reduce(longer.clone()),
        "dtypes": lambda: dist.all_reduce(other.clone(), op=dist.ReduceOp.MAX),
        "allgather": lambda: dist.all_gather([longer.clone() for _ in range(world)], longer),
        "ops": lambda: dist.all_reduce(
            torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.MIN if rank else dist.ReduceOp.MAX
        ),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
    alike = torch.full((2,), rank + 1, dtype=torch.int64)
    dist.all_reduce(alike)  # then alike ones still work
    out["after"] = str(alike.tolist())
    try:  # as many words as bytes differ: the step's own check (which fails the group)
        dist.all_reduce(torch.ones(1 + 2 * rank, dtype=torch.int64))
    except Exception as exc:
        out["words"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return out


def test_exact_collectives_of_inputs_that_differ_raise_on_every_rank(tmp_path: Path) -> None:
    # Exchanged silently, each rank read its own layout into the others' bytes.
    what = {
        "sizes": "byte counts, dtypes and shapes",
        "dtypes": "(dtypes and shapes)",
        "allgather": "byte counts, dtypes and shapes",
        "ops": "(collectives)",
    }
    for r, got in _on_two_ranks(_uneven_inputs, tmp_path, timeout_s=90):
        for name, differ in what.items():
            assert got[name].startswith("MismatchError: "), (r, name, got[name])
            assert differ in got[name], (r, name, got[name])
        assert "input bytes 5 (rank 0), 6 (rank 1)" in got["sizes"], got["sizes"]
        assert got["after"] == "[3, 3]"
        assert got["words"].startswith("MismatchError: "), (r, got["words"])


def _elastic_group(rank: int, world: int, tmp: str) -> str:
    try:
        _join(rank, world, tmp, GRADSYNC_ELASTIC="1")
    except Exception as exc:  # whatever torch makes of it
        return f"{type(exc).__name__}: {exc}"
    return "formed"


def test_an_elastic_job_is_refused_rather_than_averaged_by_the_first_world_size(
    tmp_path: Path,
) -> None:
    # After a lost rank, SUM was the survivors' mean times the first world size.
    for _, got in _on_two_ranks(_elastic_group, tmp_path):
        assert got.startswith("ConfigError: gradsync: the torch backend runs no elastic")


def _outcomes(calls: dict[str, Callable[[], object]], caught: type[Exception]) -> dict[str, str]:
    """What each call did: "ran", or the type and message of the ``caught`` it raised."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ran"
        except caught as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _several_tensors_in_one_call(rank: int, world: int, tmp: str) -> dict[str, str]:
    """A process group's allreduce, broadcast and allgather given several tensors at once
    (gloo's one tensor per device), or one tensor twice; then a right allreduce."""
    dist = _join(rank, world, tmp)
    group = dist.group.WORLD
    a, b = torch.full((2,), rank + 1.0), torch.full((2,), 10.0 * (rank + 1))
    root = dist.BroadcastOptions()
    root.rootRank = 1
    gather_opts = dist.distributed_c10d.AllgatherOptions()
    calls = {
        "allreduce": lambda: group.allreduce([a, b], dist.AllreduceOptions()).wait(),
        "twice": lambda: group.allreduce([a, a], dist.AllreduceOptions()).wait(),
        "broadcast": lambda: group.broadcast([a, b], root).wait(),
        "allgather": lambda: group.allgather(
            [[torch.zeros(2) for _ in range(world)] for _ in range(2)], [a, b], gather_opts
        ).wait(),
    }
    out = _outcomes(calls, ValueError)
    dist.all_reduce(a)
    out["after"] = str(a.tolist())
    dist.destroy_process_group()
    return out


def test_several_tensors_in_one_call_are_refused_at_the_call(tmp_path: Path) -> None:
    # gloo reduces such a list together (a + b over ranks, into each) and broadcasts the
    # root's first tensor into each; gradsync reduced and broadcast each on its own, and
    # one tensor twice failed the step and with it every later collective.
    for r, got in _on_two_ranks(_several_tensors_in_one_call, tmp_path):
        for call in ("allreduce", "twice", "broadcast", "allgather"):
            assert "of 2 tensors in one call is not supported" in got[call], (r, call, got)
        assert got["after"] == "[3.0, 3.0]", (r, got)


def _expanded_tensors(rank: int, world: int, tmp: str) -> dict[str, str]:
    """allreduce and broadcast into an expand()ed tensor (its elements share memory),
    allgather from one; then a right allreduce."""
    dist = _join(rank, world, tmp)
    x = torch.full((1,), rank + 1.0).expand(4)
    outs = [torch.zeros(4) for _ in range(world)]
    calls = {
        "allreduce": lambda: dist.all_reduce(x),
        "broadcast": lambda: dist.broadcast(x, src=0),
        "allgather": lambda: dist.all_gather(outs, x),
    }
    out = _outcomes(calls, ValueError)
    out["gathered"] = str([o.tolist() for o in outs])
    y = torch.full((2,), rank + 1.0)
    dist.all_reduce(y)
    out["after"] = str(y.tolist())
    dist.destroy_process_group()
    return out


def test_a_result_into_an_expanded_tensor_is_refused_at_the_call(tmp_path: Path) -> None:
    # Before, the step ran and wait() raised torch's error copying the result back; gloo
    # 2.13 writes past the storage of such a tensor.
    for r, got in _on_two_ranks(_expanded_tensors, tmp_path):
        for name in ("allreduce", "broadcast"):
            assert "elements share memory" in got[name], (r, name, got)
        assert got["allgather"] == "ran", (r, got)
        assert got["gathered"] == str([[1.0] * 4, [2.0] * 4]), (r, got)
        assert got["after"] == "[3.0, 3.0]", (r, got)


def _unsupported_collectives(rank: int, world: int, tmp: str) -> dict[str, str]:
    """Each torch.distributed collective the backend does not run: what it raised; then a
    right allreduce."""
    dist = _join(rank, world, tmp)
    x = torch.full((2,), rank + 1.0)
    pieces = [torch.full((2,), float(i)) for i in range(world)]
    calls = {
        "reduce": lambda: dist.reduce(x, dst=0),
        "gather": lambda: dist.gather(x, pieces if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(x, pieces if rank == 0 else None, src=0),
        "reduce_scatter": lambda: dist.reduce_scatter(x, pieces),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x, torch.zeros(2 * world)),
        "all_to_all": lambda: dist.all_to_all(pieces, pieces),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(2 * world), x.repeat(2)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(4), x),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([x, x.clone()]),
        "send": lambda: dist.send(x, dst=1 - rank),
        "recv": lambda: dist.recv(x, src=1 - rank),
        "gather_object": lambda: dist.gather_object(rank, [None] * world if rank == 0 else None),
    }
    out = _outcomes(calls, RuntimeError)  # NotImplementedError is one, as torch's refusals
    dist.all_reduce(x)
    out["after"] = str(x.tolist())
    dist.destroy_process_group()
    return out


def test_unsupported_collectives_raise_naming_themselves_at_the_call(tmp_path: Path) -> None:
    # Before, each raised "No backend type associated with device type cpu".
    for r, got in _on_two_ranks(_unsupported_collectives, tmp_path):
        for name, value in got.items():
            if name == "after":
                assert value == "[3.0, 3.0]", (r, got)
                continue
            assert value.startswith("NotImplementedError: gradsync: "), (r, name, value)
            assert name in value, (r, name, value)
            assert 'is not supported by the "gradsync" backend' in value, (r, name, value)


def _second_groups(rank: int, world: int, tmp: str) -> dict[str, str]:
    """A second "gradsync" group of every rank and a subgroup of rank 0, beside the
    default one: what each raised; then the default group, and a second run's."""
    dist = _join(rank, world, tmp)
    calls = {
        "second": lambda: dist.new_group(backend="gradsync"),
        "subgroup": lambda: dist.new_group(ranks=[0]),  # the default backend: gradsync
    }
    out = {}
    for name, call in calls.items():
        try:
            group = call()
            out[name] = "made" if group != dist.GroupMember.NON_GROUP_MEMBER else "not a member"
        except RuntimeError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    for run in ("default", "second run"):
        x = torch.full((2,), rank + 1.0)
        dist.all_reduce(x)
        out[run] = str(x.tolist())
        dist.destroy_process_group()
        if run == "default":  # a second training run in this process: its own group
            _join(rank, world, tmp)
    return out


def test_a_second_group_or_a_subgroup_over_gradsync_is_refused_when_made(
    tmp_path: Path,
) -> None:
    # Before, both were made; their ranks met in the default group's sync dir as a
    # second job, whose first collective, and the default group's next, then failed.
    refused = "NotImplementedError: gradsync: a second group, or a subgroup"
    for r, got in _on_two_ranks(_second_groups, tmp_path):
        assert got["second"].startswith(refused), (r, got)
        assert got["subgroup"].startswith(refused) if r == 0 else got["subgroup"] == "not a member"
        assert (got["default"], got["second run"]) == ("[3.0, 3.0]", "[3.0, 3.0]"), (r, got)
