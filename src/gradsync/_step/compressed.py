"""An averaging step over compressed files (``compression``): the same pipeline as an
uncompressed step, with every published payload encoded.

Each rank encodes its gradient into its input file; the owner of a shard decodes
every rank's part of it, takes the mean in rank order, encodes the mean into its
output file, and uses the decoded mean itself, as every peer does: every rank gets
the same bits. With ``error_feedback`` what encoding lost is added to the next call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .codec import BLOCK, Codec
from .feedback import Residuals, add_residual, lost, work_dtype
from .gather import Piece, Sink, to_the_end
from .header import KIND_INPUT, KIND_OUTPUT, block_crcs, crc_placeholder
from .parallel import split_range
from .peers import Peer, reading
from .plan import Group, Plan
from .publish import Publishing
from .reduce import CHUNK_ELEMS, Fetch, mean_into
from .wire import Section, Wire, code_dtype

__all__ = ["Compressing", "EncodedStages"]

# (scales, codes) of a run, as arrays.
Run = tuple[np.ndarray, np.ndarray]


class Compressing(Publishing):
    """The part of a step engine that runs compressed steps."""

    # Error feedback's residuals; kept byte buffers of unmapped payloads.
    _residuals: Residuals | None = None
    _scratches: dict[str, np.ndarray] | None = None

    def _encoded_stages(
        self, plan: Plan, flats: list[np.ndarray], step: int, sink: Sink | None
    ) -> EncodedStages:
        """The stages of a call whose payloads are encoded with ``plan.wire``."""
        assert plan.wire is not None
        self._keep_residuals(plan)
        return EncodedStages(self, plan, plan.wire, flats, step, sink)

    def _keep_residuals(self, plan: Plan) -> None:
        """Error feedback: ``plan``'s layout's residuals are this call's."""
        if self._residuals is None:
            self._residuals = Residuals()
        self._residuals.use(plan.layout)

    # -- publishing -------------------------------------------------------------------

    def _publish_encoded(
        self,
        step_dir: Path,
        plan: Plan,
        wire: Wire,
        flats: list[np.ndarray],
        step: int,
        nonfinite: list[int],
    ) -> np.ndarray:
        """Encode this rank's gradient into its input file and publish it; return the
        encoded payload."""
        self._dir.step_fd(self.seq, make=True)
        crc = crc_placeholder(plan.in_len) if self.cfg.checksums else None
        size = len(self._header(KIND_INPUT, step, plan, plan.in_len, nonfinite, crc))
        mapped = self._transport.mapped
        if mapped:
            buf = self._reserve(self.data_path(self.rank, "in"), size + plan.in_len, step)
        else:
            buf = self._scratch("in", size + plan.in_len)
        payload = buf[size:]
        for k, group in enumerate(plan.groups):
            x = _group_input(group, flats)
            self._encode(wire.codecs[k], group, x, payload, wire.inputs[k], 0, "in", k)
        if self._shard_inputs(plan):
            spans = plan.input_spans
            self._write_shards(
                step_dir, plan, step, nonfinite, lambda q: [payload[a:b] for a, b in spans(q)]
            )
            return payload
        if self.cfg.checksums:
            crc = block_crcs([payload.data], plan.in_len)
        head = self._header(KIND_INPUT, step, plan, plan.in_len, nonfinite, crc)
        buf[:size] = np.frombuffer(head, dtype=np.uint8)
        self._write(step_dir, "in", [] if mapped else self._input_chunks(plan, buf, size), step)
        return payload

    def _input_chunks(self, plan: Plan, buf: np.ndarray, head: int) -> list[np.ndarray | int]:
        """The input file's bytes to write: its own shard left out (skipped bytes) where
        peers read only theirs and no checksum covers it; only this rank reads it, from
        memory. Not where the shard is several runs (int8's scales and codes): JuiceFS
        counts each gap as a piece of the file, and a reader of a file of five pieces or
        more rewrites it whole (benchmarks/RESULTS.md, 2026-12-06)."""
        if self.cfg.checksums or plan.replicated or self.cfg.strategy != "sharded":
            return [buf]
        spans = plan.input_spans(self.rank)
        if len(spans) > 1:
            return [buf]
        chunks: list[np.ndarray | int] = []
        at = 0
        for a, b in spans:
            chunks += [buf[at : head + a], b - a]
            at = head + b
        chunks.append(buf[at:])
        return chunks

    def _encode(
        self,
        codec: Codec | None,
        group: Group,
        x: np.ndarray,
        payload: np.ndarray,
        at: Section,
        first: int,
        kind: str,
        key: int,
    ) -> np.ndarray:
        """Encode ``x`` (elements from ``first`` of ``group``) into the run at ``at``
        (adding and updating the residual of ``kind``/``key`` with error feedback);
        return its decoded value when the encoding is lossy, else ``x``."""
        scales, codes = _run_arrays(codec, group, payload, at, len(x))
        if codec is None:
            np.copyto(codes, x)
            return x
        residuals = self._residuals if self.cfg.error_feedback else None
        clipped = None
        if residuals is not None:
            x, clipped = add_residual(x, group.dtype, residuals.get(kind, key))
        jobs = [
            _job(codec.encode, x[a:b], scales[a // BLOCK :], codes[a:b])
            for a, b in split_range(len(x), self.workers.pieces(x.nbytes), CHUNK_ELEMS)
        ]
        self.workers.run(jobs)
        if not self.cfg.error_feedback and kind == "in":
            return x
        decoded = self._scratch(f"decoded-{kind}-{key}", len(x), work_dtype(group.dtype))
        self._decode(codec, (scales, codes), decoded)
        if residuals is not None:
            residuals.put(kind, key, lost(x, decoded, clipped))  # x is this call's own copy
        return decoded

    def _decode(self, codec: Codec | None, run: Run, out: np.ndarray) -> None:
        scales, codes = run
        if codec is None:
            np.copyto(out, codes)
            return
        jobs = [
            _job(codec.decode, scales[a // BLOCK :], codes[a:b], out[a:b])
            for a, b in split_range(len(out), self.workers.pieces(out.nbytes), CHUNK_ELEMS)
        ]
        self.workers.run(jobs)

    def _scratch(self, name: str, count: int, dtype: Any = np.uint8) -> np.ndarray:
        """A kept array of ``count`` elements, reused from call to call (fresh pages
        cost a fault each); its contents are valid until the next call."""
        if self._scratches is None:
            self._scratches = {}
        buf = self._scratches.get(name)
        if buf is None or len(buf) != count or buf.dtype != dtype:
            buf = self._scratches[name] = np.empty(count, dtype=dtype)
        return buf

    # -- reducing ---------------------------------------------------------------------

    def _reduce_encoded(
        self,
        plan: Plan,
        wire: Wire,
        payload: np.ndarray,
        peers: dict[int, Peer],
        step: int,
        step_dir: Path,
    ) -> dict[int, np.ndarray]:
        """This rank's shard of each group's mean, decoded as every rank decodes it;
        published (encoded) unless every rank reduces all."""
        out_len = plan.out_lens[self.rank]
        publishes = bool(out_len) and not plan.replicated
        out = self._scratch("out", out_len)
        means: dict[int, np.ndarray] = {}
        for k, group in enumerate(plan.groups):
            lo, hi = group.shards[self.rank]
            if lo == hi:
                continue
            codec = wire.codecs[k]
            runs = [
                _own_run(codec, group, payload, wire.inputs[k], lo, hi)
                if q == self.rank
                else _peer_run(codec, group, peers[q], q, wire.inputs[k], lo, hi, step)
                for q in range(self.world)
            ]
            mean = self._scratch(f"mean-{k}", hi - lo, group.dtype)
            fetch = [_decoding(codec, run) for run in runs]
            self.workers.run(
                [
                    _mean_job(fetch, a, b, mean, self.cfg.wide_sum)
                    for a, b in split_range(hi - lo, self.workers.pieces(mean.nbytes), CHUNK_ELEMS)
                ]
            )
            section = wire.outputs[self.rank][k]
            decoded = self._encode(codec, group, mean, out, section, lo, "out", k)
            means[k] = decoded if decoded.dtype == group.dtype else decoded.astype(group.dtype)
        if publishes:
            crc = block_crcs([out.data], out_len) if self.cfg.checksums else None
            head = self._header(KIND_OUTPUT, step, plan, out_len, (), crc)
            self._write(step_dir, "out", [head, out], step)
        return means

    # -- gathering --------------------------------------------------------------------

    def _gather_encoded(
        self,
        plan: Plan,
        wire: Wire,
        flats: list[np.ndarray],
        means: dict[int, np.ndarray],
        outs: dict[int, Peer],
        step: int,
        sink: Sink | None,
    ) -> None:
        """Decode every rank's shard of the mean into the arrays, or hand it to ``sink``.

        Every shard's bytes are read (and checked) first, so only an interrupt can
        stop the writing half-way, and it is then finished (``to_the_end``)."""
        runs: list[tuple[str, Group, int, int, Codec | None, Run | None, np.ndarray | None]] = []
        for q in range(self.world) if not plan.replicated else [self.rank]:
            for k, group in enumerate(plan.groups):
                lo, hi = group.shards[q]
                if lo == hi:
                    continue
                if q == self.rank:
                    runs.append(("", group, lo, hi, None, None, means[k]))
                    continue
                codec = wire.codecs[k]
                section = wire.outputs[q][k]
                run = _peer_run(codec, group, outs[q], q, section, 0, hi - lo, step)
                runs.append((f"gather-{q}-{k}", group, lo, hi, codec, run, None))
        pieces: list[Piece] = []

        def write_back() -> None:
            pieces.clear()
            for name, group, lo, hi, codec, run, own in runs:
                segments = group.segments(lo, hi)
                mean = own
                if mean is None and run is not None:
                    if sink is None and len(segments) == 1:
                        p, a, b, _ = segments[0]
                        self._decode(codec, run, flats[p][a:b])
                        continue
                    mean = self._scratch(name, hi - lo, group.dtype)
                    self._decode(codec, run, mean)
                assert mean is not None
                for p, a, b, at in segments:
                    if sink is None:
                        np.copyto(flats[p][a:b], mean[at : at + b - a])
                    else:
                        pieces.append((p, a, mean[at : at + b - a]))
            if sink is not None:
                sink(pieces)
            self._has_mean = True

        to_the_end(write_back)


class EncodedStages:
    """A call whose published payloads are encoded (the stages of ``StepEngine._step``)."""

    def __init__(
        self,
        engine: Compressing,
        plan: Plan,
        wire: Wire,
        flats: list[np.ndarray],
        step: int,
        sink: Sink | None,
    ) -> None:
        self._engine, self._plan, self._wire = engine, plan, wire
        self._flats, self._step, self._sink = flats, step, sink
        self.codec: str | None = wire.codec.name
        self._payload: np.ndarray | None = None
        self._means: dict[int, np.ndarray] = {}

    def publish(self, step_dir: Path, nonfinite: list[int]) -> None:
        self._payload = self._engine._publish_encoded(
            step_dir, self._plan, self._wire, self._flats, self._step, nonfinite
        )

    def reduce(self, peers: dict[int, Peer], step_dir: Path) -> None:
        assert self._payload is not None
        self._means = self._engine._reduce_encoded(
            self._plan, self._wire, self._payload, peers, self._step, step_dir
        )

    def gather(self, outs: dict[int, Peer]) -> None:
        self._engine._gather_encoded(
            self._plan, self._wire, self._flats, self._means, outs, self._step, self._sink
        )


def _group_input(group: Group, flats: list[np.ndarray]) -> np.ndarray:
    """The group's elements as one array (a view when it is one param)."""
    if len(group.params) == 1:
        index, _, count = group.params[0]
        return flats[index][:count]
    return np.concatenate([flats[index] for index, _, _ in group.params])


def _run_arrays(codec: Codec | None, group: Group, payload: np.ndarray, at: Section, n: int) -> Run:
    """The scales and codes of a run of ``n`` elements at ``at`` of ``payload``."""
    dtype = code_dtype(codec, group)
    count = 0 if codec is None else codec.scale_count(n)
    scales = payload[at.scales : at.scales + 4 * count].view(np.float32)
    return scales, payload[at.codes : at.codes + n * dtype.itemsize].view(dtype)


def _own_run(
    codec: Codec | None, group: Group, payload: np.ndarray, at: Section, lo: int, hi: int
) -> Run:
    scales, codes = _run_arrays(codec, group, payload, at, group.size)
    return scales[lo // BLOCK :], codes[lo:hi]


def _peer_run(
    codec: Codec | None,
    group: Group,
    peer: Peer,
    q: int,
    at: Section,
    lo: int,
    hi: int,
    step: int,
) -> Run:
    """Elements ``[lo, hi)`` of the run at ``at`` of rank q's file: views of its mapping,
    or read into memory."""
    dtype = code_dtype(codec, group)
    count = 0 if codec is None else codec.scale_count(hi - lo)
    base = peer.header.payload_offset
    parts = (
        (base + at.scales + 4 * (lo // BLOCK), count, np.dtype(np.float32)),
        (base + at.codes + lo * dtype.itemsize, hi - lo, dtype),
    )
    arrays: list[np.ndarray] = []
    with reading(peer, q, step):
        for offset, n, dt in parts:
            view = peer.reader.view(offset, n, dt)
            if view is None:
                view = np.empty(n, dtype=dt)
                peer.reader.read_into(offset, view)
            arrays.append(view)
    return arrays[0], arrays[1]


def _decoding(codec: Codec | None, run: Run) -> Fetch:
    """Elements of ``run`` decoded into the fetch buffer, chunk by chunk."""
    scales, codes = run

    def fetch(start: int, stop: int, buf: np.ndarray) -> np.ndarray:
        out = buf[: stop - start]
        if codec is None:
            return codes[start:stop]
        codec.decode(scales[start // BLOCK :], codes[start:stop], out)
        return out

    return fetch


def _job(fn: Callable[..., None], *args: np.ndarray) -> Callable[[], None]:
    return lambda: fn(*args)


def _mean_job(
    fetch: list[Fetch], a: int, b: int, out: np.ndarray, wide: bool
) -> Callable[[], None]:
    """Elements ``[a, b)`` of the mean of ``fetch`` into ``out``."""

    def shifted(f: Fetch) -> Fetch:
        return lambda start, stop, buf: f(start + a, stop + a, buf)

    return lambda: mean_into([shifted(f) for f in fetch], b - a, out[a:b], wide=wide)
