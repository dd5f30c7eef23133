"""A ``torch.distributed`` backend named "gradsync" (experimental in torch, as every
third-party backend is): ``import gradsync.torch`` registers it.

Every collective is one gradsync step, run on the GradSync's background thread in the
order it was called (the same on every rank, as torch requires of every backend): it
reads its inputs there, when it runs, and its work's future completes from that thread.
Float allreduce (SUM, AVG) is gradsync's mean (times the world size for SUM; 16-bit
floats summed in float32, rounded once); everything else (broadcast, allgather, integer
or MIN/MAX/PRODUCT/bitwise allreduce, barrier) travels as bytes encoded exactly in
float64 steps, or (broadcast) as a gradsync broadcast of bytes, so it is bit-exact for
any dtype. See docs/pytorch-backend.md.
"""

from __future__ import annotations

import datetime
import hashlib
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ._api import GradSync
from ._async import Background, StepHandle
from ._config import FileGradSyncConfig
from ._errors import ConfigError, MismatchError
from ._stats import StepStats
from ._torch.args import check_gather_outputs, check_inputs
from ._torch.refused import RefusedCollectives

__all__ = ["BACKEND", "GradSyncProcessGroup"]

BACKEND = "gradsync"

# Torch dtypes averaged in place, as numpy sees them; bfloat16 (and a float16 SUM) in float32.
_NATIVE = {torch.float16, torch.float32, torch.float64}
_FLOATS = {*_NATIVE, torch.bfloat16}

_R = dist.ReduceOp
_BITWISE = {_R.BAND, _R.BOR, _R.BXOR}
_LOCAL_OPS: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    _R.SUM: torch.add,
    _R.PRODUCT: torch.mul,
    _R.MIN: torch.minimum,
    _R.MAX: torch.maximum,
    _R.BAND: torch.bitwise_and,
    _R.BOR: torch.bitwise_or,
    _R.BXOR: torch.bitwise_xor,
}


# The groups torch made (through _create) and has not shut down: a process runs one job.
_OPEN: weakref.WeakSet[GradSyncProcessGroup] = weakref.WeakSet()


class GradSyncProcessGroup(RefusedCollectives, dist.ProcessGroup):  # type: ignore[misc]
    """A process group whose collectives are steps of one :class:`~gradsync.GradSync`;
    those it does not run refuse, naming themselves, at the call."""

    def __init__(self, rank: int, world_size: int, cfg: FileGradSyncConfig | None = None) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        if cfg is None:
            cfg = FileGradSyncConfig.from_env(world_size=world_size, rank=rank)
        if cfg.elastic:
            # DDP divides by the group's size, fixed at its creation: after a lost rank
            # every SUM would be off by world_size / survivors.
            raise ConfigError(
                "gradsync: the torch backend runs no elastic job (GRADSYNC_ELASTIC is set): "
                "a torch process group keeps its size, so a job that lost a rank would "
                "average wrongly; use GradSync or DiLoCo for an elastic job"
            )
        self._world = world_size
        self._rank = rank
        self.sync = GradSync(cfg)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        """SUM/AVG of float tensors: gradsync's mean (times W for SUM); others exactly."""
        check_inputs(tensors, "allreduce", written=True)
        op = opts.reduceOp.op  # the RedOpType (a ReduceOp compares equal only one way)
        if all(t.dtype in _FLOATS for t in tensors) and op in {_R.SUM, _R.AVG}:
            return self._float_allreduce(tensors, scale=self._world if op == _R.SUM else None)
        if op == _R.AVG or op not in _LOCAL_OPS:
            raise ValueError(f"gradsync: allreduce {op} of {tensors[0].dtype} is not supported")
        if op in _BITWISE and any(t.is_floating_point() or t.is_complex() for t in tensors):
            raise ValueError(f"gradsync: allreduce {op.name} needs integer or bool tensors")

        def run() -> StepStats:
            stats, words = self._exchange(tensors, f"allreduce {op.name}")
            per_rank = [_split(words[r], tensors) for r in range(self._world)]
            for i, t in enumerate(tensors):
                acc = per_rank[0][i].clone()
                for r in range(1, self._world):
                    acc = _LOCAL_OPS[op](acc, per_rank[r][i])
                t.detach().copy_(acc)
            return stats

        return self._work(self.sync._submit(run), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        """The root's tensors, bit for bit, on every rank: a gradsync broadcast of their
        bytes."""
        check_inputs(tensors, "broadcast", written=True)
        root = opts.rootRank

        def run() -> StepStats:
            staged = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]
            stats = self.sync._broadcast([_byte_view(s) for s in staged], root)
            for t, s in zip(tensors, staged, strict=True):
                if s.data_ptr() != t.data_ptr():
                    t.detach().copy_(s)
            return stats

        return self._work(self.sync._submit(run), tensors)

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> Any:
        """Every rank's input tensors, bit for bit, in each rank's slot of the outputs."""
        check_inputs(input_tensors, "allgather")
        check_gather_outputs(output_tensors, input_tensors, self._world)

        def run() -> StepStats:
            stats, words = self._exchange(input_tensors, "allgather")
            for r in range(self._world):
                for outs, part in zip(output_tensors, _split(words[r], input_tensors), strict=True):
                    outs[r].detach().copy_(part)
            return stats

        # As gloo's: the one input's outputs, a list of tensors.
        return self._work(self.sync._submit(run), output_tensors[0])

    def barrier(self, opts: Any) -> Any:  # type: ignore[override]
        """A step of one float32 zero: every rank has called it when it completes."""
        return self._work(self.sync._average_exact_async([np.zeros(1, np.float32)]), [])

    def shutdown(self) -> None:
        """Leave the gradsync job (``destroy_process_group`` calls it)."""
        _OPEN.discard(self)
        self.sync.close()

    def abort(self) -> None:
        _OPEN.discard(self)
        self.sync.close()

    def _float_allreduce(self, tensors: list[torch.Tensor], scale: int | None) -> Any:
        def run() -> StepStats:
            staged = [_staging(t, summed=scale is not None) for t in tensors]
            # SUM: the mean times W, written in the pass that writes the mean back.
            stats = self.sync._average([s.numpy() for s in staged], None, None, None, scale)
            for t, s in zip(tensors, staged, strict=True):
                if s.data_ptr() != t.data_ptr():  # a copy: averaged in place otherwise
                    # Through detach(): no_grad is the caller thread's, not this one's.
                    t.detach().copy_(s)
            return stats

        return self._work(self.sync._submit(run), tensors)

    def _exchange(
        self, tensors: Sequence[torch.Tensor], call: str
    ) -> tuple[StepStats, list[np.ndarray]]:
        """Each rank's bytes of ``tensors``, carried exactly (never compressed): the step's
        stats and the bytes of each rank. Runs on gradsync's thread, so inputs are read
        when the collective runs, after those called before it.

        Raises MismatchError on every rank if the ranks' inputs differ in size, dtypes or
        shapes, or the ranks made different collectives (``call``)."""
        head = _descriptor(tensors, call)
        payload = np.concatenate([head, _bytes_of(tensors)])
        buf = _encode(payload, self._rank, self._world)
        stats = self.sync._average([buf], None, None, None, None, exact=True)
        slots = _decode(buf, self._world, payload.size)
        _check_alike([s[: head.size] for s in slots], tensors, call, stats.step)
        return stats, [s[head.size :] for s in slots]

    def _work(self, handle: StepHandle, outputs: list[Any]) -> Any:
        """A torch Work whose future completes, from gradsync's thread, with ``outputs``
        once ``handle``'s step (which wrote them) is over."""
        future: torch.futures.Future[Any] = _PlacedFuture(self.sync._background)
        finished = threading.Event()

        def complete(done: StepHandle) -> None:
            try:
                done.wait()
            except BaseException as exc:
                finished.set()
                future.set_exception(exc)
            else:
                # Before the future's callbacks run: the work is done while they do.
                finished.set()
                future.set_result(outputs)

        handle.add_done_callback(complete)
        return _Work(future, outputs, finished)


class _PlacedFuture(torch.futures.Future):  # type: ignore[type-arg]
    """A collective's future: a collective that a callback added by :meth:`then` starts
    takes the place of that call in the order, as with ``StepHandle.add_done_callback``
    (torch runs the callback at once, on the caller's thread, if the future is done)."""

    def __init__(self, background: Background) -> None:
        super().__init__()
        self._background = background

    def then(self, callback: Callable[[Any], Any]) -> Any:
        return super().then(self._placed(callback))

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        super().add_done_callback(self._placed(callback))

    def _placed(self, callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``callback`` run in the place in the order that this call has."""
        at, bg = self._background.last_seq, self._background
        return lambda fut: bg.run_placed(at, lambda: callback(fut))


class _Work(dist.Work):  # type: ignore[misc]
    """A collective's work: waiting for it waits for its future, raising its error."""

    def __init__(
        self, future: torch.futures.Future[Any], outputs: list[Any], finished: threading.Event
    ) -> None:
        super().__init__()
        self._future = future
        self._outputs = outputs
        self._finished = finished

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the work, raising its error; a timeout other than None or zero (torch's
        default: no timeout) raises RuntimeError, as gloo's does, if it is not done by then."""
        if timeout and not self._finished.wait(timeout.total_seconds()):
            raise RuntimeError(
                f"Operation timed out! gradsync: the collective did not complete within "
                f"the wait's timeout of {timeout.total_seconds():g} s (it goes on)"
            )
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The output tensors, as gloo's: only once complete, and not a list of lists."""
        if not self.is_completed():
            raise RuntimeError(
                "Work needs to be completed before calling result(). "
                "Should call wait() before result()."
            )
        if any(isinstance(o, list) for o in self._outputs):
            raise RuntimeError(
                "work result does not support list of lists, use .getFuture() and value()"
            )
        return self._outputs


def _staging(t: torch.Tensor, summed: bool) -> torch.Tensor:
    """``t`` itself where numpy can average it in place; else a contiguous copy
    (float32 for bfloat16, and for float16 ``summed``)."""
    # A float16 mean rounded before the times W loses what rounds away in the halving.
    wide = t.dtype == torch.bfloat16 or (summed and t.dtype == torch.float16)
    if t.dtype in _NATIVE and t.is_contiguous() and not wide:
        return t.detach()
    dtype = torch.float32 if wide else t.dtype
    return t.detach().to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def _bytes_of(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """The tensors' bytes, one after another, as a uint8 array (a copy)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a writeable uint8 array sharing its memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _split(data: np.ndarray, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``data`` (bytes) cut into tensors shaped and typed as ``like``."""
    out, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        if n == 0:  # torch views no empty byte tensor as a wider dtype
            out.append(torch.empty(t.shape, dtype=t.dtype))
            continue
        chunk = torch.from_numpy(data[at : at + n].copy())
        out.append(chunk.view(t.dtype).reshape(t.shape))
        at += n
    return out


def _descriptor(tensors: Sequence[torch.Tensor], call: str) -> np.ndarray:
    """The bytes heading a rank's slot: its inputs' byte count, then digests of their
    dtypes and shapes and of the collective."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    head = struct.pack("<Q", nbytes) + _digest(_layout(tensors)) + _digest(call)
    return np.frombuffer(head, np.uint8)


def _layout(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _check_alike(
    heads: list[np.ndarray], tensors: Sequence[torch.Tensor], call: str, step: int
) -> None:
    """Raise MismatchError where the ranks' descriptors differ: every rank sees them all,
    so every rank raises."""
    others = [r for r, h in enumerate(heads) if h.tobytes() != heads[0].tobytes()]
    if not others:
        return
    parts = {
        "byte counts": slice(0, 8),
        "dtypes and shapes": slice(8, 16),
        "collectives": slice(16, 24),
    }
    differ = [name for name, at in parts.items() if len({h[at].tobytes() for h in heads}) > 1]
    counts = ", ".join(
        f"{struct.unpack('<Q', h[:8].tobytes())[0]} (rank {r})" for r, h in enumerate(heads)
    )
    raise MismatchError(
        f"step {step}: {call}: the ranks' inputs or collectives differ ({', '.join(differ)}): "
        f"input bytes {counts}; this rank's inputs: {_layout(tensors) or 'none'}",
        step=step,
        ranks=[0, *others],
    )


def _encode(payload: np.ndarray, slot: int, slots: int) -> np.ndarray:
    """A float64 step array holding ``payload`` as 32-bit words in slot ``slot`` of
    ``slots``, zeros elsewhere: its mean times W, rounded, gives every word back."""
    n = max(1, -(-payload.size // 4))
    words = np.zeros(n, np.uint32)
    words.view(np.uint8)[: payload.size] = payload
    out = np.zeros(slots * n, np.float64)
    out[slot * n : (slot + 1) * n] = words
    return out


def _decode(mean: np.ndarray, world: int, nbytes: int) -> list[np.ndarray]:
    """Each slot's bytes from the mean of :func:`_encode`'s arrays."""
    # One rank's word in a slot (< 2**32), others 0: the sum is exact, and mean * W is
    # within a few ulps of it, far closer than 0.5.
    words = np.rint(mean * world).astype(np.uint32)
    n = max(1, -(-nbytes // 4))
    return [words[s * n : (s + 1) * n].view(np.uint8)[:nbytes] for s in range(words.size // n)]


def _create(
    store: Any, rank: int, world_size: int, timeout: datetime.timedelta
) -> GradSyncProcessGroup:
    """torch's backend constructor; the store and timeout are unused (see the docs).

    Raises NotImplementedError for a second open "gradsync" group in this process, or one
    of part of the world (``new_group``, subgroups): its ranks would meet in the sync dir as
    a second job, and fail (or wait out GRADSYNC_MAX_WAIT_S) at its first collective and
    the other group's next."""
    partial = dist.is_initialized() and world_size != dist.get_world_size()
    if _OPEN or partial:
        raise NotImplementedError(
            "gradsync: a second group, or a subgroup (new_group, new_subgroups), over the "
            '"gradsync" backend is not supported: a process runs one gradsync job, of every '
            'rank; make such groups with backend="gloo"'
        )
    group = GradSyncProcessGroup(rank, world_size)
    _OPEN.add(group)
    return group


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
