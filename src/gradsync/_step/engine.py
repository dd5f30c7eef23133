"""One averaging step over files: publish, wait, reduce a shard, gather the mean.

In generation directory ``gen-<id>/``, every rank owns data files reused from
step to step (rewriting a file in place keeps its tmpfs pages, where a fresh file
costs a page fault per 4 KiB); see ``StepEngine.data_path`` for when a call needs
two slots::

    d-<r>.in, d-<r>-<slot>.in      rank r's whole gradient (header + payload)
    d-<r>.out, d-<r>-<slot>.out    rank r's shard of the mean

and call number ``seq`` of every rank uses ``s-<seq>/``, whose names are never reused::

    in-<r>     empty marker: rank r's input for this call is complete and closed
    out-<r>    empty marker: rank r's shard of the mean is complete and closed
    abort-<r>  why rank r gave up on this call (peers raise it at once)

Rank q writes slot ``seq % 2`` only after finishing call seq-1, which needed every
rank's ``out`` of seq-1, written after that rank had read every input of seq-1 and
so finished call seq-2: nobody still reads what the slot held. For the same reason,
once rank q starts call seq nobody will look at ``s-<seq-2>`` again, so q publishes
by moving its marker of call seq-2 into ``s-<seq>/`` (a rename: no inode to create
and later unlink). When rank 0 has every marker of call seq, every rank has moved
its markers out of ``s-<seq-2>/``, and rank 0 removes it, empty. Disk use: one or
two slots of inputs and shards per rank, markers of three calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradsync._config import FileGradSyncConfig
from gradsync._errors import (
    GradSyncError,
    InvalidGradsError,
    SyncDirError,
    error_note,
)
from gradsync._faults import fault_point
from gradsync._job.liveness import Heartbeat
from gradsync._job.rendezvous import Generation
from gradsync._stats import StepStats
from gradsync._store.dirs import GenDir
from gradsync._store.files import (
    place_marker,
    translate_oserror,
    write_note,
)

from .buffers import SharedBuffers
from .header import (
    FLAG_CHECKSUMS,
    FLAG_NONFINITE,
    HEADER_READ_BYTES,
    KIND_INPUT,
    KIND_OUTPUT,
    MAX_META,
    MAX_PARAMS,
    Layout,
    block_crcs,
    crc_placeholder,
    decode_header,
    encode_header,
    encode_meta,
    header_length,
    longest_nonfinite,
)
from .overlap import overlap_message, overlapping
from .parallel import SMALL_COPY_BYTES, Workers, auto_threads, split_range
from .peers import Peer, PeerFiles, check_inputs, check_length, reading
from .plan import Group, Plan
from .reduce import ACCUMULATOR, CHUNK_ELEMS, Fetch, check_dtype, mean_into
from .stale import StaleWatch
from .transport import ChecksumError, Transport, local_filesystem

__all__ = ["Deliver", "Piece", "StepEngine", "data_name", "nonfinite_params", "validate_grads"]

_log = logging.getLogger("gradsync")
# Below this many bytes per rank every rank reduces all of it: reading W small inputs
# costs less than a second round of files, waiting and gathering.
REPLICATE_BELOW_BYTES = 256 * 1024
# Measured on 16 cores with 8 threads a rank: 32K-element chunks made the threaded
# reduce slower than one thread (GIL hand-overs between the many small numpy calls).
THREADED_CHUNK_ELEMS = 1 << 17
# Plans kept for layouts seen before (building one costs ~1.5 us a param).
_PLANS_KEPT = 4
_FAULTS_ON = bool(os.environ.get("GRADSYNC_TEST_FAULT"))
# nonfinite_params checks arrays under this size together, in batches of this size or
# more (under twice it: a scratch array of at most 2 MiB, float16 widened to float64).
_FINITE_BATCH_BYTES = 256 * 1024


# A run of the mean: (param index, first element, the elements as a 1-D array).
Piece = tuple[int, int, np.ndarray]
Deliver = Callable[[list[Piece]], None]


def validate_grads(grads: object) -> list[np.ndarray]:
    """Check that ``grads`` can be averaged in place; return them as a list.

    Raises:
        InvalidGradsError: naming the param index and what is wrong with it.
    """
    return _checked(grads)[0]


# The layout's name of each dtype validate_grads accepts (equal dtypes have equal
# names): ``dtype.str`` builds a new string at every call, ~0.13 us a param a step.
_DTYPE_NAMES: dict[np.dtype[Any], str] = {dt: dt.str for dt in ACCUMULATOR}


def _checked(grads: object) -> tuple[list[np.ndarray], list[np.ndarray], Layout]:
    """:func:`validate_grads`, with each array flattened (a 1-D view) and the layout.

    One pass over the params, reading each attribute once: a step needs all three,
    and three passes cost ~0.6 us a param a step (a thousand params: 0.6 ms).

    Raises:
        InvalidGradsError: naming the param index and what is wrong with it.
    """
    if isinstance(grads, np.ndarray) or not isinstance(grads, Sequence):
        raise InvalidGradsError(
            f"grads must be a sequence (list or tuple) of numpy arrays, got {type(grads).__name__}"
        )
    if len(grads) == 0:
        raise InvalidGradsError("grads is empty: pass at least one gradient array")
    arrays: list[np.ndarray] = []
    flats: list[np.ndarray] = []
    layout: list[tuple[str, tuple[int, ...]]] = []
    views = False  # whether an array may share memory with another that is not itself
    for i, g in enumerate(grads):
        if not isinstance(g, np.ndarray):
            # Told by its module: the numpy path never imports wgpu.
            if type(g).__module__.split(".")[0] == "wgpu":
                raise InvalidGradsError(
                    f"param {i} is a wgpu {type(g).__name__}, not a numpy array: GPU buffers "
                    "are averaged with device=<the GPUDevice that owns them>"
                )
            raise InvalidGradsError(
                f"param {i} is a {type(g).__name__}, not a numpy array (averaging is in place, "
                "so a converted copy would never reach you)"
            )
        # The common case (a native float dtype) is a dictionary lookup, and each message
        # is only built when it is raised.
        dtype = g.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            check_dtype(dtype, f"param {i}")
            raise InvalidGradsError(f"param {i} has non-native byte order {dtype.str}")
        flags = g.flags
        if not flags.c_contiguous:
            raise InvalidGradsError(
                f"param {i} (shape {g.shape}) is not C-contiguous; averaging is in place, so "
                "make the gradient itself contiguous and pass it (torch: p.grad = "
                "p.grad.contiguous(), then p.grad.numpy()); np.ascontiguousarray(g) would "
                "average a copy that the optimizer never sees"
            )
        if not flags.writeable:
            raise InvalidGradsError(f"param {i} (shape {g.shape}) is read-only")
        # A subclass (np.matrix, say) may reshape in its own way: its memory, as a plain
        # array, is what is averaged.
        a = g if type(g) is np.ndarray else g.view(np.ndarray)
        views = views or a.base is not None or not flags.owndata
        arrays.append(a)
        flats.append(a.ravel())  # a view (C-contiguous), and half the cost of reshape(-1)
        layout.append((name, a.shape))
    pair = overlapping(arrays, views=views)
    if pair is not None:
        i, j = pair
        what = "the same array" if grads[i] is grads[j] else "views of overlapping memory"
        raise InvalidGradsError(overlap_message(i, j, what))
    return arrays, flats, tuple(layout)


def nonfinite_params(arrays: Sequence[np.ndarray]) -> list[int]:
    """The indices of the arrays that hold a NaN or an Inf.

    Small arrays are checked a batch at a time, flattened side by side into one
    scratch array: a check per array cost ~1.2 us (two numpy calls and a temporary),
    the copy ~0.2 us. Only a batch with a NaN or an Inf is checked array by array, to
    name them. (The scratch array has the widest dtype of the batch, which holds every
    value exactly: a float16 or float32 is non-finite just when it is as a float64.)
    """
    bad: list[int] = []
    batch: list[int] = []
    batch_bytes = 0

    def check_batch() -> None:
        if not np.isfinite(np.concatenate([arrays[i] for i in batch], axis=None)).all():
            bad.extend(i for i in batch if not np.isfinite(arrays[i]).all())

    for i, a in enumerate(arrays):
        nbytes = a.nbytes
        if nbytes >= _FINITE_BATCH_BYTES:
            if not np.isfinite(a).all():
                bad.append(i)
            continue
        batch.append(i)
        batch_bytes += nbytes
        if batch_bytes >= _FINITE_BATCH_BYTES:
            check_batch()
            batch, batch_bytes = [], 0
    if batch:
        check_batch()
    return sorted(bad)


def _others(group: Group, rank: int) -> list[tuple[int, int]]:
    """The element ranges of ``group`` outside ``rank``'s shard."""
    lo, hi = group.shards[rank]
    return [(a, b) for a, b in ((0, lo), (hi, group.size)) if a < b]


class StepEngine:
    """Runs averaging steps for one rank of one generation."""

    def __init__(
        self, cfg: FileGradSyncConfig, gen: Generation, closing: threading.Event | None = None
    ) -> None:
        self.cfg = cfg
        self.gen = gen
        self.rank = cfg.rank
        self.world = cfg.world_size
        self.seq = 0
        self.completed = 0  # calls that ended without an error (told to peers on leaving)
        self._has_mean = False  # this call's mean is all in this rank's arrays or buffers
        # Every file the peers read of this rank in this call is published: they can
        # finish the call without it.
        self._peers_served = False
        self._plan: Plan | None = None
        # The last few layouts' plans, most recent last: a loop that alternates layouts
        # (a GAN's two models, say) would otherwise rebuild a plan every call.
        self._plans: dict[Layout, Plan] = {}
        self._data_paths: dict[tuple[int, str, int | None], Path] = {}
        self._shared: SharedBuffers | None = None
        self._shared_serial = 0
        self._watch: StaleWatch | None = None  # over the last buffers_like arrays
        self._linked: Path | None = None  # the shared file this rank's input name points at
        local = local_filesystem(gen.path)
        mapped = cfg.use_mmap if cfg.use_mmap is not None else local
        try:
            self._dir = GenDir(gen.path)
        except SyncDirError:
            raise
        except OSError as exc:
            raise translate_oserror(exc, "opening the generation directory", gen.path) from exc
        self._transport = Transport(
            mapped=mapped, head_bytes=HEADER_READ_BYTES, shared=not local, dir_fd=self._dir.fd
        )
        self._peers = PeerFiles(
            cfg, gen, self._transport, self.data_path, self._input_names, self._dir, closing
        )
        self._heartbeat = gen.heartbeat or Heartbeat(
            gen.heartbeat_path(self.rank), cfg.heartbeat_interval_s
        )
        local_ranks = sum(1 for m in gen.members if m.same_host)
        self.workers = Workers(cfg.threads or auto_threads(local_ranks))

    def close(self) -> None:
        self._heartbeat.stop()
        self._transport.close()
        self.workers.close()
        self._dir.close()

    # -- the step -----------------------------------------------------------------

    def step(self, grads: Sequence[Any], step: int, deliver: Deliver | None = None) -> StepStats:
        """Average ``grads`` in place with every rank's call of the same sequence number.

        With ``deliver``, the mean is handed to it instead of being copied into
        ``grads``: one call, once every shard is in, with pieces that cover every
        element once. Their arrays are valid only during the call; ``grads`` are then
        scratch (a source that cannot be mapped is read into them first).

        On any error this rank tells its peers (``abort-<rank>``) before raising, so
        they fail at once with the same error instead of waiting for it.
        """
        self.seq += 1
        step_dir = self.gen.path / f"s-{self.seq}"
        self._has_mean = self._peers_served = False
        try:
            stats = self._step(*_checked(grads), step, step_dir, deliver)
        except BaseException as exc:
            # A rank interrupted once it has the whole mean lets its peers, which had all
            # they needed of it, finish the call too (whether they would see a note now
            # is a race): they hear of it at the next call. Otherwise the peers fail this
            # call with it; those that had all they needed of it (it failed reading a
            # peer's shard, say) may have finished it already, and hear why at their next
            # call rather than only that it closed its session.
            later = self.seq + 1
            if self._has_mean:
                note_seqs = [later]
            else:
                note_seqs = [self.seq, later] if self._peers_served else [self.seq]
            for seq in note_seqs:
                self._tell_peers(seq, exc)
            raise
        self.completed = self.seq
        self._dir.release_before(self.seq - 1)
        return stats

    def give_up(self, exc: BaseException) -> None:
        """Tell the peers that this rank's next call will not take place (it failed
        before publishing anything): they raise ``exc``'s reason at once."""
        self._tell_peers(self.seq + 1, exc)

    def _tell_peers(self, seq: int, exc: BaseException) -> None:
        with contextlib.suppress(OSError):
            note = self._dir.step_path(seq) / f"abort-{self.rank}"
            data = json.dumps(error_note(exc)).encode()
            write_note(note, data, dir_fd=self._dir.step_fd(seq, make=True))

    def _step(
        self,
        arrays: list[np.ndarray],
        flats: list[np.ndarray],
        layout: Layout,
        step: int,
        step_dir: Path,
        deliver: Deliver | None,
    ) -> StepStats:
        t0 = time.perf_counter()
        if len(arrays) > MAX_PARAMS:
            raise InvalidGradsError(
                f"step {step}: {len(arrays)} params, more than the {MAX_PARAMS} a gradsync "
                "file describes: concatenate small params into fewer arrays"
            )
        plan = self._plan_for(layout)
        nonfinite = nonfinite_params(flats) if self.cfg.check_finite else []
        shared = self._shared
        in_place = shared is not None and self._publishes_in_place(shared, plan, arrays)
        watch = self._watch if deliver is None else None
        if watch is not None and (in_place or watch.given(arrays)):
            watch.before(step)
        else:
            watch = None
        fault_point("before_publish", self.rank, self.seq)
        self._publish(step_dir, plan, flats, step, nonfinite, shared if in_place else None)
        fault_point("after_publish", self.rank, self.seq)
        # Its input is all the peers read of a rank that publishes no shard of the mean.
        self._peers_served = plan.replicated or not plan.out_lens[self.rank]
        t1 = time.perf_counter()
        peers: dict[int, Peer] = {}
        outs: dict[int, Peer] = {}
        try:
            last_in = self._peers.wait_for(step_dir, "in", range(self.world), step, self.seq, peers)
            check_inputs(plan, self.rank, peers, step, step_dir)
            t2 = time.perf_counter()
            # Arrays published in place lie in payload order in one file: the reduce and
            # the gather take one run of elements per dtype group, not a piece per param.
            work, runs = (plan.runs, list(shared.runs)) if in_place and shared else (plan, flats)
            shard = self._reduce_and_publish(work, runs, peers, step, step_dir)
            self._peers_served = True
            fault_point("after_output", self.rank, self.seq)
            t3 = time.perf_counter()
            publishers = [
                q
                for q in range(self.world)
                if plan.out_lens[q] and q != self.rank and not plan.replicated
            ]
            self._peers.wait_for(step_dir, "out", publishers, step, self.seq, outs)
            for q, peer in outs.items():
                check_length(peer, q, plan.out_lens[q], step)
            t4 = time.perf_counter()
            if deliver is None:
                self._gather(work, runs, shard, outs, step, restore=not in_place)
                if watch is not None:
                    watch.after()
            else:
                ranks = [self.rank] if plan.replicated else range(self.world)
                mapped, read_in = self._pieces(plan, flats, shard, outs, step, ranks)
                _to_the_end(lambda: self._delivered(deliver, mapped + read_in))
            if self.rank == 0 and self.seq > 2:
                # Emptied by the ranks' renames (module docstring): one rmdir, normally.
                self._dir.prune(
                    self.seq - 2, (f"{p}-{q}" for p in ("in", "out") for q in range(self.world))
                )
            t5 = time.perf_counter()
        finally:
            for peer in (*peers.values(), *outs.values()):
                peer.reader.close()
        stats = StepStats(
            step=step,
            world_size=self.world,
            bytes_per_rank=plan.in_len,
            publish_s=t1 - t0,
            wait_inputs_s=t2 - t1,
            reduce_s=t3 - t2,
            wait_outputs_s=t4 - t3,
            gather_s=t5 - t4,
            total_s=t5 - t0,
            last_rank=last_in,
        )
        _log.debug("%s", stats)
        return stats

    def _reduce_and_publish(
        self,
        plan: Plan,
        flats: list[np.ndarray],
        peers: dict[int, Peer],
        step: int,
        step_dir: Path,
    ) -> np.ndarray:
        """Reduce this rank's shard and, unless every rank reduces all, publish it."""
        publishes = bool(plan.out_lens[self.rank]) and not plan.replicated
        out_len = plan.out_lens[self.rank]
        placeholder = crc_placeholder(out_len) if self.cfg.checksums else None
        head = self._header(KIND_OUTPUT, step, plan, out_len, (), placeholder)
        # Mapped: reduce straight into this rank's output file, saving a copy.
        target = None
        if publishes and self._transport.mapped:
            target = self._reserve(self.data_path(self.rank, "out"), len(head) + out_len, step)
        shard = self._reduce(
            plan, flats, peers, step, None if target is None else target[len(head) :]
        )
        if publishes and self.cfg.checksums:
            # Same length as the placeholder: the payload does not move.
            head = self._header(
                KIND_OUTPUT, step, plan, out_len, (), block_crcs([shard.data], out_len)
            )
        if target is not None:
            target[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            self._write(step_dir, "out", [], step)
        elif publishes:
            half = len(shard) // 2
            self._write(step_dir, "out", [head, shard[:half], shard[half:]], step)
        return shard

    def _plan_for(self, layout: Layout) -> Plan:
        if self._plan is not None and self._plan.layout == layout:
            return self._plan
        plan = self._plans.pop(layout, None)
        if plan is None:
            plan = Plan.build(
                layout,
                self.world,
                self.cfg.strategy == "root",
                replicate_below=REPLICATE_BELOW_BYTES,
            )
            if len(self._plans) >= _PLANS_KEPT:
                del self._plans[next(iter(self._plans))]
        self._plans[layout] = self._plan = plan
        return plan

    def _header(
        self,
        kind: int,
        step: int | None,
        plan: Plan,
        payload_len: int,
        nonfinite: Sequence[int] = (),
        crc: str | None = None,
        payload_offset: int | None = None,
    ) -> bytes:
        layout_text = plan.layout_text if kind == KIND_INPUT else None
        meta = encode_meta(layout_text, nonfinite, crc)
        if len(meta) > MAX_META:
            # Readers would take the file for corrupt: refuse it here, before publishing.
            raise InvalidGradsError(
                ("" if step is None else f"step {step}: ")
                + f"the gradients' layout takes {len(meta)} bytes in the file header, more "
                f"than the {MAX_META} a header holds: concatenate small params into fewer "
                "arrays"
            )
        return encode_header(
            kind=kind,
            rank=self.rank,
            world_size=self.world,
            seq=self.seq,
            step=0 if step is None else step,  # None: sizing a header, no step yet
            generation=self.gen.header_id,
            layout_digest=plan.digest,
            meta=meta,
            payload_len=payload_len,
            flags=(FLAG_NONFINITE if nonfinite else 0) | (FLAG_CHECKSUMS if crc is not None else 0),
            payload_offset=payload_offset,
        )

    def data_path(self, rank: int, kind: str, seq: int | None = None) -> Path:
        """The reused data file holding ``rank``'s ``kind`` ("in"/"out") for call ``seq``.

        One file per rank (``d-<r>.<kind>``) suffices when every rank publishes a
        shard: a rank starts call seq+1 only once every rank has published its shard
        of seq, which each did after reading every input of seq. Otherwise (every rank
        reduces everything, or rank 0 does, or some ranks have empty shards) nothing
        orders the last readers of call seq before the writers of seq+1, but all of
        them have finished seq before anyone starts seq+2, so two slots alternate
        (``d-<r>-<seq % 2>.<kind>``). The names differ because the layout, and with it
        the plan, may change between calls: a one-file call right after a two-slot
        one must not overwrite what that call's last readers may still be reading.
        """
        plan = self._plan
        one_slot = plan is not None and _one_slot(plan)
        call = self.seq if seq is None else seq
        key = (rank, kind, None if one_slot else call % 2)
        path = self._data_paths.get(key)
        if path is None:  # built once: joining paths is a visible share of a small step
            path = self._data_paths[key] = self.gen.path / data_name(rank, kind, key[2])
        return path

    def _input_names(self, rank: int, seq: int) -> tuple[Path, Path]:
        """Both names ``rank``'s input of call ``seq`` may have, whatever its plan."""
        return (
            self.gen.path / data_name(rank, "in", None),
            self.gen.path / data_name(rank, "in", seq % 2),
        )

    def _write(
        self,
        step_dir: Path,
        kind: str,
        chunks: Sequence[bytes | memoryview | np.ndarray],
        step: int,
    ) -> None:
        """Write this rank's ``kind`` data in place (no ``chunks``: already written
        through a mapping), then publish its marker."""

        def midway() -> None:
            fault_point(f"mid_{'publish' if kind == 'in' else 'output'}", self.rank, self.seq)

        views = [c if not isinstance(c, np.ndarray) else c.data for c in chunks]
        path = self.data_path(self.rank, kind)
        if not views:  # already written in place through a mapping
            if _FAULTS_ON:
                midway()
        else:
            try:
                self._transport.write(
                    path, views, midway if _FAULTS_ON else None, self.workers.copy
                )
            except OSError as exc:
                raise translate_oserror(exc, "writing", path, step=step) from exc
        marker = step_dir / f"{kind}-{self.rank}"
        # Nobody looks at this rank's marker of call seq-2 any more (module docstring).
        old = self._dir.held_step_fd(self.seq - 2)
        reuse = f"{kind}-{self.rank}" if old is not None else None
        try:
            place_marker(marker, reuse, dir_fd=self._dir.step_fd(self.seq), reuse_dir_fd=old)
        except OSError as exc:
            raise translate_oserror(exc, "publishing", marker, step=step) from exc

    def _publish(
        self,
        step_dir: Path,
        plan: Plan,
        flats: list[np.ndarray],
        step: int,
        nonfinite: list[int],
        shared: SharedBuffers | None,
    ) -> None:
        """Publish this rank's input: only the header when ``shared`` holds the arrays."""
        try:
            self._dir.step_fd(self.seq, make=True)
        except SyncDirError:
            raise
        except OSError as exc:
            raise translate_oserror(
                exc, "creating the step directory", step_dir, step=step
            ) from exc

        def payload() -> list[np.ndarray]:
            return [flats[i] for i in plan.ordered_params() if flats[i].size]

        crc = block_crcs([p.data for p in payload()], plan.in_len) if self.cfg.checksums else None
        if shared is not None:
            head = self._header(
                KIND_INPUT, step, plan, plan.in_len, nonfinite, crc, payload_offset=shared.offset
            )
            shared.mem[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            self._link_input(shared.path, step)
            self._write(step_dir, "in", [], step)
            return
        self._unlink_input(step)
        head = self._header(KIND_INPUT, step, plan, plan.in_len, nonfinite, crc)
        if not self._skip_own(plan):
            self._write(step_dir, "in", [head, *payload()], step)
            return
        # Peers read only their own shards of this file: this rank's shard, which only it
        # reduces (from its arrays), is left out, saving 1/W of the copying.
        path = self.data_path(self.rank, "in")
        buf = self._reserve(path, len(head) + plan.in_len, step)
        buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        packs: list[tuple[np.ndarray, list[np.ndarray]]] = []
        for group in plan.groups:
            base = len(head) + group.in_offset
            size = group.dtype.itemsize
            for lo, hi in _others(group, self.rank):
                dst = buf[base + lo * size : base + hi * size].view(group.dtype)
                packs.append((dst, [flats[p][a:b] for p, a, b, _ in group.segments(lo, hi)]))
        self.workers.pack(packs)
        self._write(step_dir, "in", [], step)

    # -- shared gradient arrays ---------------------------------------------------------

    def buffers_like(self, layout: Layout, *, watch: bool = True) -> list[np.ndarray]:
        """Zero-filled arrays of ``layout`` that later steps publish without copying.

        Plain arrays where that cannot work: a file that is not mapped (another
        host's filesystem), or a plan where readers of one call may still read
        when the next begins (small payloads, strategy "root"). With ``watch``, a
        later step given them unwritten since the last one fails (``_step/stale.py``).

        Raises:
            SyncDirError: the file could not be created or sized.
        """
        plan = self._plan_for(layout)
        if not (self._transport.mapped and _one_slot(plan)):
            arrays = [np.zeros(shape, dtype=np.dtype(dtype)) for dtype, shape in layout]
            if watch:
                self._watch = StaleWatch.for_arrays(arrays, self.rank)
            return arrays
        # Sized for the longest header this layout can have: the longest list of
        # non-finite params (only with check_finite: without it a layout near the
        # header's limit would be refused for a list it never has).
        crc = crc_placeholder(plan.in_len) if self.cfg.checksums else None
        flagged = longest_nonfinite(len(layout) if self.cfg.check_finite else 0)
        worst = self._header(KIND_INPUT, None, plan, plan.in_len, flagged, crc)
        self._shared_serial += 1
        path = self.gen.path / f"d-{self.rank}-b{self._shared_serial}.in"
        old = self._shared
        self._shared = SharedBuffers.create(
            path, plan, len(worst), lambda p, size: self._reserve(p, size, None)
        )
        if watch:
            spans = [[(first, count) for _, first, count in g.params] for g in plan.groups]
            self._watch = StaleWatch.for_runs(
                self._shared.arrays, self._shared.runs, spans, self.rank
            )
        if old is not None:
            # Arrays handed out before keep their memory (the mapping outlives the name).
            self._transport.forget(old.path)
            with contextlib.suppress(OSError):
                os.unlink(old.path.name, dir_fd=self._dir.fd)
        return list(self._shared.arrays)

    @property
    def shared(self) -> SharedBuffers | None:
        """The arrays of the last :meth:`buffers_like` call that mapped a file, if any."""
        return self._shared

    def _publishes_in_place(
        self, shared: SharedBuffers, plan: Plan, arrays: list[np.ndarray]
    ) -> bool:
        return (
            self._transport.mapped
            and plan.layout == shared.layout
            and _one_slot(plan)
            and shared.holds(arrays)
        )

    def _link_input(self, target: Path, step: int) -> None:
        """Point this rank's input-file name at ``target`` (no reader is active: the
        previous call's readers all finished before any rank publishes this one)."""
        if self._linked == target:
            return
        name = self._input_name()
        temp = name.with_name(name.name + ".link")
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp.name, dir_fd=self._dir.fd)
            os.symlink(target.name, temp.name, dir_fd=self._dir.fd)
            os.replace(temp.name, name.name, src_dir_fd=self._dir.fd, dst_dir_fd=self._dir.fd)
        except OSError as exc:
            raise translate_oserror(exc, "publishing", name, step=step) from exc
        self._transport.forget(name)
        self._linked = target

    def _unlink_input(self, step: int) -> None:
        """Make this rank's input-file name a file of its own again before writing it."""
        if self._linked is None:
            return
        name = self._input_name()
        try:
            os.unlink(name.name, dir_fd=self._dir.fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise translate_oserror(exc, "writing", name, step=step) from exc
        self._transport.forget(name)
        self._linked = None

    def _input_name(self) -> Path:
        """This rank's input file of a one-file plan, the name that links to shared
        arrays."""
        return self.gen.path / data_name(self.rank, "in", None)

    def _skip_own(self, plan: Plan) -> bool:
        """Whether this rank's input file leaves out its own shard (mapped, sharded)."""
        return (
            self._transport.mapped
            and not self.cfg.checksums
            and not plan.replicated
            and self.cfg.strategy == "sharded"
        )

    # -- reducing and gathering -------------------------------------------------------

    def _reserve(self, path: Path, size: int, step: int | None) -> np.ndarray:
        try:
            return self._transport.reserve(path, size)
        except OSError as exc:
            raise translate_oserror(exc, "writing", path, step=step) from exc

    def _reduce(
        self,
        plan: Plan,
        flats: list[np.ndarray],
        peers: dict[int, Peer],
        step: int,
        into: np.ndarray | None,
    ) -> np.ndarray:
        """This rank's shard of every group, as bytes (the output payload), in ``into``
        if given."""
        shard = np.empty(plan.out_lens[self.rank], dtype=np.uint8) if into is None else into
        own_from_arrays = not self._transport.mapped or self._skip_own(plan)
        jobs = []
        for group in plan.groups:
            lo, hi = group.shards[self.rank]
            if lo == hi:
                continue
            start = group.out_offsets[self.rank]
            out = shard[start : start + (hi - lo) * group.dtype.itemsize].view(group.dtype)
            fetch = [
                self._fetcher(group, q, lo, hi, flats, peers, step, own_from_arrays)
                for q in range(self.world)
            ]
            pieces = self.workers.pieces(out.nbytes)
            if own_from_arrays and pieces > 1:
                # Own elements spread over many small params are gathered chunk by chunk
                # in Python: threads would queue for the GIL (measured slower on 16 cores).
                count = len(group.segments(lo, hi))
                if out.nbytes < count * SMALL_COPY_BYTES:
                    pieces = 1
            # Threads take turns at the GIL between numpy calls: bigger chunks, fewer turns.
            chunk = CHUNK_ELEMS if self.workers.threads == 1 else THREADED_CHUNK_ELEMS
            jobs += [
                _mean_job(fetch, a, b, out, chunk, self.cfg.wide_sum)
                for a, b in split_range(hi - lo, pieces, 1024)
            ]
        self.workers.run(jobs)
        return shard

    def _fetcher(
        self,
        group: Group,
        q: int,
        lo: int,
        hi: int,
        flats: list[np.ndarray],
        peers: dict[int, Peer],
        step: int,
        own_from_arrays: bool,
    ) -> Any:
        """Rank q's elements of ``group`` in ``[lo, hi)``, chunk by chunk (see mean_into).

        This rank's own come from its arrays when its file lacks them (``pread``, or
        left out of a mapped file); otherwise from its mapping like a peer's: one
        contiguous view instead of pieces of many params.
        """
        if q == self.rank and own_from_arrays:

            def own(start: int, stop: int, buf: np.ndarray) -> np.ndarray:
                # The plan keeps each chunk's segments: chunks fall at the same places
                # every step of a layout.
                segments = group.segments(lo + start, lo + stop)
                if len(segments) == 1:
                    param, first, _, _ = segments[0]
                    return flats[param][first : first + stop - start]
                # One numpy call for all the params of the chunk, not one each.
                out = buf[: stop - start]
                np.concatenate([flats[p][a:b] for p, a, b, _ in segments], out=out)
                return out

            return own
        peer = peers[q]
        base = peer.header.payload_offset + group.in_offset + lo * group.dtype.itemsize
        itemsize = group.dtype.itemsize

        def theirs(start: int, stop: int, buf: np.ndarray) -> np.ndarray:
            out = buf[: stop - start]
            with reading(peer, q, step):
                mapped = peer.reader.view(base + start * itemsize, stop - start, group.dtype)
                if mapped is not None:
                    return mapped
                peer.reader.read_into(base + start * itemsize, out)
            return out

        return theirs

    def _gather(
        self,
        plan: Plan,
        flats: list[np.ndarray],
        shard: np.ndarray,
        outs: dict[int, Peer],
        step: int,
        *,
        restore: bool,
    ) -> None:
        """Copy every rank's shard of the mean into the arrays.

        All shards are published before the first byte is copied, so only an I/O
        error can stop this half-way; the arrays are then restored (``restore``)
        from this rank's own published input, so a failed call never leaves a
        mixed result.
        """
        # Peers' shards first, this rank's own last: a failure then leaves the own range
        # untouched, and the rest is restored from the published input.
        others = [q for q in range(self.world) if q != self.rank and not plan.replicated]
        done = False

        def copy_all() -> None:
            nonlocal done
            for batch in (others, [self.rank]):
                # Mapped shards are copied by the workers, a batch at a time: the own
                # range is only written once every peer's range is in.
                pairs: list[tuple[np.ndarray, np.ndarray]] = []
                for q in batch:
                    for group in plan.groups:
                        lo, hi = group.shards[q]
                        whole = self._shard_source(group, q, flats, shard, outs, step)
                        if whole is not None:  # None: read into the arrays already
                            pairs += [
                                (flats[param][start:stop], whole[at : at + stop - start])
                                for param, start, stop, at in group.segments(lo, hi)
                            ]
                self.workers.copy(pairs)
            done = self._has_mean = True

        try:
            _to_the_end(copy_all)
        except BaseException:
            # Arrays published in place hold no copy to restore from; a mapped gather
            # checks every source before copying, so a failure leaves them untouched.
            if restore and not done:
                self._restore(plan, flats)
            raise

    def _delivered(self, deliver: Deliver, pieces: list[Piece]) -> None:
        deliver(pieces)
        self._has_mean = True

    def _pieces(
        self,
        plan: Plan,
        flats: list[np.ndarray],
        shard: np.ndarray,
        outs: dict[int, Peer],
        step: int,
        ranks: Sequence[int],
    ) -> tuple[list[Piece], list[Piece]]:
        """The shards of the mean of ``ranks`` as pieces of params: those of mapped
        sources, and those that had to be read into the arrays (views of them)."""
        mapped: list[Piece] = []
        read_in: list[Piece] = []
        for q in ranks:
            for group in plan.groups:
                lo, hi = group.shards[q]
                whole = self._shard_source(group, q, flats, shard, outs, step)
                segments = group.segments(lo, hi)
                if whole is None:
                    read_in += [
                        (s.param, s.start, flats[s.param][s.start : s.stop]) for s in segments
                    ]
                else:
                    mapped += [
                        (s.param, s.start, whole[s.at : s.at + s.stop - s.start]) for s in segments
                    ]
        return mapped, read_in

    def _shard_source(
        self,
        group: Group,
        q: int,
        flats: list[np.ndarray],
        shard: np.ndarray,
        outs: dict[int, Peer],
        step: int,
    ) -> np.ndarray | None:
        """Rank q's shard of ``group`` as one 1-D array (this rank's own, or a mapped
        peer's); None when it is empty, or was read into the arrays (no mapping)."""
        lo, hi = group.shards[q]
        if lo == hi:
            return None
        start = group.out_offsets[q]
        if q == self.rank:
            return shard[start : start + (hi - lo) * group.dtype.itemsize].view(group.dtype)
        fault_point("mid_gather", self.rank, self.seq)
        peer = outs[q]
        at = peer.header.payload_offset + start
        itemsize = group.dtype.itemsize
        with reading(peer, q, step):
            # One view of the whole shard (bounds and checksums checked once), sliced
            # per param: with many small params, views per param cost more than copies.
            mapped = peer.reader.view(at, hi - lo, group.dtype)
            if mapped is None:
                for s in group.segments(lo, hi):
                    peer.reader.read_into(at + s.at * itemsize, flats[s.param][s.start : s.stop])
        return mapped

    def _restore(self, plan: Plan, flats: list[np.ndarray]) -> None:
        path = self.data_path(self.rank, "in")
        try:
            reader = self._transport.open(path)
        except OSError:
            _log.error("could not restore the gradients from %s after a failed step", path)
            return
        try:
            head = reader.head_of(header_length(reader.head))
            offset = decode_header(head, str(path)).payload_offset
            for group in plan.groups:
                ranges = _others(group, self.rank) if self._skip_own(plan) else [(0, group.size)]
                for lo, hi in ranges:
                    for seg in group.segments(lo, hi):
                        at = offset + group.in_offset + (lo + seg.at) * group.dtype.itemsize
                        reader.read_into(at, flats[seg.param][seg.start : seg.stop])
        except (OSError, EOFError, GradSyncError, ChecksumError):
            _log.error("could not restore the gradients from %s after a failed step", path)
        finally:
            reader.close()


def data_name(rank: int, kind: str, slot: int | None) -> str:
    """The name of ``rank``'s reused ``kind`` ("in"/"out") file: one file a rank
    (``slot`` None) or one of two alternating slots (see ``StepEngine.data_path``)."""
    return f"d-{rank}.{kind}" if slot is None else f"d-{rank}-{slot}.{kind}"


def _one_slot(plan: Plan) -> bool:
    """Whether every rank publishes a shard, so one input file per rank suffices."""
    return not plan.replicated and all(plan.out_lens)


def _to_the_end(copy: Callable[[], None]) -> None:
    """Run ``copy``, which copies the mean out and may be repeated, to its end.

    An interrupt (Ctrl-C) half-way would leave a mix of gradient and mean; every shard
    is in by then, so the copy is made once more before the interrupt goes on.
    """
    try:
        copy()
    except GradSyncError:
        raise
    except BaseException:
        copy()
        raise


def _mean_job(
    fetch: Sequence[Fetch], a: int, b: int, out: np.ndarray, chunk: int, wide: bool
) -> Any:
    """A job computing elements ``[a, b)`` of ``mean_into(fetch, len(out), out, wide=wide)``."""

    def shifted(f: Fetch) -> Fetch:
        return lambda start, stop, buf: f(start + a, stop + a, buf)

    def job() -> None:
        mean_into(
            [shifted(f) for f in fetch] if a else fetch,
            b - a,
            out[a:b],
            chunk_elems=chunk,
            wide=wide,
        )

    return job
