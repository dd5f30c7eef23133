"""What a rank's step engine keeps from call to call: its files, plans and threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gradsync._config import FileGradSyncConfig
from gradsync._errors import InvalidGradsError, SyncDirError
from gradsync._job.liveness import Heartbeat
from gradsync._job.rendezvous import Generation
from gradsync._names import (
    call_data_name,
    data_name,
    input_marker,
    output_marker,
    shard_data_name,
)
from gradsync._store.dirs import GenDir
from gradsync._store.files import translate_oserror

from .buffers import SharedBuffers
from .checks import Peer
from .codec import Codec, codec_for
from .header import (
    FLAG_CHECKSUMS,
    FLAG_NONFINITE,
    HEADER_READ_BYTES,
    KIND_INPUT,
    KIND_SHARD,
    MAX_META,
    Layout,
    encode_header,
    encode_meta,
)
from .parallel import Workers, auto_threads
from .peers import PeerFiles
from .plan import Group, Plan
from .stale import StaleWatch
from .transport import Transport, local_filesystem

__all__ = ["EngineState", "one_slot", "others"]

# Below this many bytes per rank every rank reduces all of it: reading W small inputs
# costs less than a second round of files, waiting and gathering.
REPLICATE_BELOW_BYTES = 256 * 1024
# Across hosts a round of files costs round trips to the shared filesystem's servers:
# every rank reduces all while reading the other W - 1 inputs stays within this
# (benchmarks/RESULTS.md, 2026-12-07).
REPLICATE_READ_BYTES_ACROSS_HOSTS = 4 << 20
# Across hosts an input is a file per shard from this many bytes a shard: below it the
# files' own costs (create, open, remove) outweigh the blocks a whole file's readers
# fetch beyond their range (benchmarks/RESULTS.md, 2026-12-06).
SHARD_FILES_FROM_BYTES = 1 << 20
# Plans kept for layouts seen before: building one is per-param work.
_PLANS_KEPT = 4

_log = logging.getLogger("gradsync")


class EngineState:
    """One rank's state in one generation: config, directory, transport, peers, plans."""

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
        # Elastic: rank 0 said in this call that joiners come in after it.
        self.joins_due = False
        self._next_join_look = 0.0
        self._plan: Plan | None = None
        self._publishers: list[int] = []
        # The last few layouts' plans, most recent last: a loop that alternates layouts
        # (a GAN's two models, say) would otherwise rebuild a plan every call.
        self._plans: dict[tuple[Layout, bool], Plan] = {}
        self._data_paths: dict[tuple[int, str, int | None], Path] = {}
        self._shared: SharedBuffers | None = None
        self._shared_serial = 0
        self._watch: StaleWatch | None = None  # over the last buffers_like arrays
        self._linked: Path | None = None  # the shared file this rank's input name points at
        # Across hosts: the files this rank wrote for each call, removed two calls later.
        self._call_files: dict[int, list[Path]] = {}
        # This call's own input as peers see it, where this rank writes no file to read.
        self.own_input: Peer | None = None
        self._markers = {"in": input_marker(self.rank), "out": output_marker(self.rank)}
        # Every rank's markers: what rank 0 expects in a step directory it removes.
        self._marker_names = [
            name(q) for name in (input_marker, output_marker) for q in range(self.world)
        ]
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
        # Files rewritten in place pile up slices that JuiceFS's readers merge (reading
        # and rewriting them whole): where other hosts read, each call's files are new.
        self._per_call = not local and not mapped
        self._peers = PeerFiles(
            cfg, gen, self._transport, self._peer_path, self._data_names, self._dir, closing
        )
        self._heartbeat = gen.heartbeat or Heartbeat(
            gen.heartbeat_path(self.rank), cfg.heartbeat_interval_s
        )
        local_ranks = sum(1 for m in gen.members if m.same_host)
        # Both by the roster alone, which every rank reads alike (ranks of one host may
        # judge its filesystem differently, as an NFS server's own ranks do).
        self.codec = _wire_codec(cfg, local_ranks == self.world)
        self._replicate_below = _replicate_below(self.world, local_ranks < self.world)
        self.workers = Workers(cfg.threads or auto_threads(local_ranks))
        # Where each call's files are new on another host's filesystem, a rank writes its
        # files for its peers, and reads theirs of the mean, at once: each waits on the
        # filesystem's round trips (a close on its upload).
        self.writers = Workers(self.world - 1 if self._per_call else 1)

    def close(self) -> None:
        self._heartbeat.stop()
        self._transport.close()
        self.workers.close()
        self.writers.close()
        self._dir.close()

    def _plan_for(self, layout: Layout, *, exact: bool = False) -> Plan:
        """The plan of calls of ``layout``; ``exact``: published as is, never compressed."""
        codec = None if exact else self.codec
        key = (layout, codec is None)
        last = self._plan
        if last is not None and last.layout == layout and (last.wire is None) == (codec is None):
            return last
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = Plan.build(
                layout,
                self.world,
                self.cfg.strategy == "root",
                replicate_below=self._replicate_below,
                codec=codec,
            )
            if len(self._plans) >= _PLANS_KEPT:
                del self._plans[next(iter(self._plans))]
        self._plans[key] = self._plan = plan
        # The peers whose shards a call of this plan waits for.
        self._publishers = [
            q
            for q in range(self.world)
            if plan.out_lens[q] and q != self.rank and not plan.replicated
        ]
        return plan

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

        Where other hosts read them (not mapped, not a local filesystem), each call has
        files of its own (``d-<r>-c<seq>.<kind>``) that their writer removes two calls
        later, when all their readers have finished, as above.
        """
        plan = self._plan
        single = plan is not None and one_slot(plan)
        call = self.seq if seq is None else seq
        if self._per_call:
            return self.gen.path / call_data_name(rank, kind, call)
        key = (rank, kind, None if single else call % 2)
        path = self._data_paths.get(key)
        if path is None:  # built once: joining paths is a visible share of a small step
            path = self._data_paths[key] = self.gen.path / data_name(rank, kind, key[2])
        return path

    def _data_names(self, rank: int, kind: str, seq: int) -> tuple[Path, ...]:
        """Every name ``rank``'s ``kind`` data of call ``seq`` may have: one file, two
        slots, a file of that call alone, or the part of its input that this rank reads
        (a peer that sees the filesystem as its own host's keeps reusing files where
        this rank does not)."""
        names = (
            self.gen.path / data_name(rank, kind, None),
            self.gen.path / data_name(rank, kind, seq % 2),
            self.gen.path / call_data_name(rank, kind, seq),
        )
        if kind == "in":
            return (*names, self.gen.path / shard_data_name(rank, self.rank, seq))
        return names

    def _shard_inputs(self, plan: Plan) -> bool:
        """Whether this rank writes its input as one file per shard, each read by that
        shard's reducer alone: across hosts, where a reader of a range of a shared file
        fetches whole blocks of it (the filesystem's, 4 MiB on JuiceFS), for shards of
        ``SHARD_FILES_FROM_BYTES`` or more."""
        return (
            self._per_call
            and one_slot(plan)
            and self.cfg.strategy == "sharded"
            and plan.least_input_shard >= SHARD_FILES_FROM_BYTES
        )

    def _peer_path(self, rank: int, kind: str) -> Path:
        """The file of ``rank``'s ``kind`` data of this call that this rank reads."""
        plan = self._plan
        if kind == "in" and plan is not None and self._shard_inputs(plan):
            return self.gen.path / shard_data_name(rank, self.rank, self.seq)
        return self.data_path(rank, kind)

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

    def _reserve(self, path: Path, size: int, step: int | None) -> np.ndarray:
        try:
            return self._transport.reserve(path, size)
        except OSError as exc:
            raise translate_oserror(exc, "writing", path, step=step) from exc

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
        layout_text = plan.layout_text if kind in (KIND_INPUT, KIND_SHARD) else None
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


def one_slot(plan: Plan) -> bool:
    """Whether every rank publishes a shard, so one input file per rank suffices."""
    return not plan.replicated and all(plan.out_lens)


def others(group: Group, rank: int) -> list[tuple[int, int]]:
    """The element ranges of ``group`` outside ``rank``'s shard."""
    lo, hi = group.shards[rank]
    return [(a, b) for a, b in ((0, lo), (hi, group.size)) if a < b]


def _replicate_below(world: int, across_hosts: bool) -> int:
    """The payload bytes below which every rank reduces all of a call's payload."""
    if not across_hosts:
        return REPLICATE_BELOW_BYTES
    return max(REPLICATE_BELOW_BYTES, REPLICATE_READ_BYTES_ACROSS_HOSTS // (world - 1))


def _wire_codec(cfg: FileGradSyncConfig, one_host: bool) -> Codec | None:
    """The codec of the job's files: none where the roster puts every rank on this
    host, unless ``compress_local``."""
    codec = codec_for(cfg.compression)
    if codec is not None and one_host and not cfg.compress_local:
        _log.info(
            "gradsync: compression %r not applied: every rank runs on this host "
            "(compress_local=True applies it)",
            cfg.compression,
        )
        return None
    return codec
