"""Where every element lives: params grouped by dtype, payload offsets, shard ranges.

A rank's input payload is the concatenation of dtype groups (in order of first
appearance), each the concatenation of its params in the caller's order. Each
group is split into contiguous shards, one per rank; a rank's output payload is
its shard of every group, in group order. Everything here is derived from the
layout alone, so every rank computes the same plan without talking.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .codec import BLOCK, Codec
from .header import Layout, layout_json, layout_text_hash
from .reduce import shard_range
from .wire import Wire

__all__ = ["Group", "Plan", "Segment"]


class Segment(NamedTuple):
    """Elements ``[start, stop)`` of param ``param``, at element ``at`` of a flat range.

    A tuple: the copy loops of a step unpack one per param, several times faster than
    reading a dataclass's four attributes.
    """

    param: int
    start: int
    stop: int
    at: int


@dataclass(frozen=True)
class Group:
    dtype: np.dtype[Any]
    params: tuple[tuple[int, int, int], ...]  # (param index, first element, element count)
    size: int
    in_offset: int  # bytes into the input payload
    shards: tuple[tuple[int, int], ...]  # per rank: element range [lo, hi)
    out_offsets: tuple[int, ...]  # per rank: bytes into that rank's output payload
    # A plan lives as long as the layout does: with a hundred params, recomputing the
    # few ranges a step asks for cost more than half a millisecond per step.
    _memo: dict[tuple[int, int], tuple[Segment, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def segments(self, lo: int, hi: int) -> tuple[Segment, ...]:
        """The params' pieces covering group elements ``[lo, hi)``."""
        found = self._memo.get((lo, hi))
        if found is not None:
            return found
        out: list[Segment] = []
        params = self.params
        # From the param holding element lo: a scan of every param for each range made
        # the first step O(params x chunks) (200,000 params, 200 chunks: 6 s).
        for k in range(max(bisect.bisect_right(self._firsts, lo) - 1, 0), len(params)):
            index, first, count = params[k]
            if first >= hi:
                break
            a, b = max(lo, first), min(hi, first + count)
            if a < b:
                out.append(Segment(index, a - first, b - first, a - lo))
        self._memo[(lo, hi)] = result = tuple(out)
        return result

    @functools.cached_property
    def _firsts(self) -> list[int]:
        """Each param's first element, in order (params lie back to back)."""
        return [first for _, first, _ in self.params]


@dataclass(frozen=True)
class Plan:
    layout: Layout
    digest: bytes
    groups: tuple[Group, ...]
    in_len: int  # input payload bytes
    out_lens: tuple[int, ...]  # per rank: output payload bytes
    # Every rank reduces everything itself and publishes no shard (small payloads).
    replicated: bool = False
    layout_text: str = ""  # the layout as input headers carry it (format.layout_json)
    # Compressed payloads: where each group's scales and codes lie (in_len and out_lens
    # are then its lengths), shards on multiples of the codec's block.
    wire: Wire | None = None

    @classmethod
    def build(
        cls,
        layout: Layout,
        world_size: int,
        root_only: bool,
        *,
        replicate_below: int = 0,
        codec: Codec | None = None,
    ) -> Plan:
        """The plan for ``layout``.

        ``root_only``: rank 0 reduces everything. Otherwise, payloads of fewer than
        ``replicate_below`` bytes are reduced whole by every rank, which skips a round
        of files and waiting; larger ones are split into one shard per rank. The mean
        of every element is computed alike in all three, so the bits are the same.
        With ``codec``, files hold the compressed payloads that ``wire`` lays out.
        """
        order: list[str] = []
        members: dict[str, list[int]] = {}
        for index, (name, _shape) in enumerate(layout):
            if name not in members:
                order.append(name)
                members[name] = []
            members[name].append(index)
        # math.prod, not np.prod: a numpy call per param was most of a plan's cost.
        total = sum(math.prod(shape) * np.dtype(name).itemsize for name, shape in layout)
        replicate = not root_only and total < replicate_below
        groups: list[Group] = []
        in_offset = 0
        out_lens = [0] * world_size
        for dtype_str in order:
            dtype: np.dtype[Any] = np.dtype(dtype_str)
            params: list[tuple[int, int, int]] = []
            size = 0
            for index in members[dtype_str]:
                count = math.prod(layout[index][1])
                params.append((index, size, count))
                size += count
            if replicate:
                shards = tuple((0, size) for _ in range(world_size))
            elif root_only:
                shards = tuple((0, size) if q == 0 else (size, size) for q in range(world_size))
            else:
                align = BLOCK if codec is not None else 16
                shards = tuple(shard_range(size, q, world_size, align) for q in range(world_size))
            out_offsets = tuple(out_lens)
            for q, (lo, hi) in enumerate(shards):
                out_lens[q] += (hi - lo) * dtype.itemsize
            groups.append(Group(dtype, tuple(params), size, in_offset, shards, out_offsets))
            in_offset += size * dtype.itemsize
        text = layout_json(layout)
        wire = None if codec is None else Wire.build(codec, groups, world_size)
        return cls(
            layout,
            layout_text_hash(text),
            tuple(groups),
            in_offset if wire is None else wire.in_len,
            tuple(out_lens) if wire is None else wire.out_lens,
            replicate,
            text,
            wire,
        )

    @functools.cached_property
    def runs(self) -> Plan:
        """This plan with each group as one param (the group's index): for arrays that
        lie in payload order in one block of memory, as ``buffers_like`` arrays do,
        one run of elements per group instead of a piece per param. Everything that
        reaches the files (digest, offsets, shards) is this plan's."""
        groups = tuple(
            Group(g.dtype, ((k, 0, g.size),), g.size, g.in_offset, g.shards, g.out_offsets)
            for k, g in enumerate(self.groups)
        )
        layout = tuple((g.dtype.str, (g.size,)) for g in self.groups)
        return Plan(
            layout,
            self.digest,
            groups,
            self.in_len,
            self.out_lens,
            self.replicated,
            self.layout_text,
        )

    def input_spans(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Byte ranges ``[a, b)`` of an input payload holding ``rank``'s shard of every
        group, in order: what its reducer reads of each rank's input."""
        return self._input_spans[rank]

    def input_shard_len(self, rank: int) -> int:
        """The bytes of :meth:`input_spans` of ``rank``."""
        return self._input_shard_lens[rank]

    @functools.cached_property
    def least_input_shard(self) -> int:
        """The bytes of the smallest shard's part of an input payload."""
        return min(self._input_shard_lens)

    @functools.cached_property
    def _input_shard_lens(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in spans) for spans in self._input_spans)

    @functools.cached_property
    def _input_spans(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        world = len(self.out_lens)
        if self.wire is not None:
            return tuple(tuple(self.wire.shard_spans(self.groups, q)) for q in range(world))
        return tuple(
            tuple(
                (g.in_offset + lo * g.dtype.itemsize, g.in_offset + hi * g.dtype.itemsize)
                for g in self.groups
                for lo, hi in [g.shards[q]]
                if lo < hi
            )
            for q in range(world)
        )

    def ordered_params(self) -> list[int]:
        """Param indices in payload order."""
        return [index for g in self.groups for index, _, _ in g.params]
