"""Where a compressed payload keeps each dtype group's scales and codes.

An input payload holds, per group, the scales of every block then the codes of every
element; rank q's output payload holds, per group, those of its shard. Each section
starts on a multiple of 64 bytes. A group the codec would not shrink (float16 under
bf16 or fp16) keeps its elements as they are, with no scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .codec import BLOCK, Codec

if TYPE_CHECKING:
    from .plan import Group

__all__ = ["Section", "Wire"]

_ALIGN = 64


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Section:
    """A run's scales and codes: byte offsets into a payload."""

    scales: int
    codes: int


@dataclass(frozen=True)
class Wire:
    """The compressed payloads of a plan."""

    codec: Codec
    codecs: tuple[Codec | None, ...]  # per group; None: its elements pass as they are
    inputs: tuple[Section, ...]  # per group, in every input payload
    outputs: tuple[tuple[Section, ...], ...]  # per rank, per group, in its output payload
    in_len: int
    out_lens: tuple[int, ...]

    @classmethod
    def build(cls, codec: Codec, groups: Sequence[Group], world_size: int) -> Wire:
        """The layout for ``groups`` (whose shards start on multiples of ``BLOCK``)."""
        codecs = tuple(codec if codec.compresses(g.dtype) else None for g in groups)
        inputs: list[Section] = []
        at = 0
        for group, c in zip(groups, codecs, strict=True):
            codes_at = at + _padded(_scale_bytes(c, group.size))
            inputs.append(Section(at, codes_at))
            at = codes_at + _padded(group.size * code_dtype(c, group).itemsize)
        outputs: list[tuple[Section, ...]] = []
        out_lens: list[int] = []
        for q in range(world_size):
            sections: list[Section] = []
            end = 0
            for group, c in zip(groups, codecs, strict=True):
                lo, hi = group.shards[q]
                codes_at = end + _padded(_scale_bytes(c, hi - lo))
                sections.append(Section(end, codes_at))
                end = codes_at + _padded((hi - lo) * code_dtype(c, group).itemsize)
            outputs.append(tuple(sections))
            out_lens.append(end)
        return cls(codec, codecs, tuple(inputs), tuple(outputs), at, tuple(out_lens))

    def shard_spans(self, groups: Sequence[Group], rank: int) -> list[tuple[int, int]]:
        """Byte ranges ``[a, b)`` of an input payload holding ``rank``'s shard of every
        group (its scales, then its codes), in order."""
        spans: list[tuple[int, int]] = []
        for group, codec, at in zip(groups, self.codecs, self.inputs, strict=True):
            lo, hi = group.shards[rank]
            if lo == hi:
                continue
            if codec is not None and codec.scaled:
                spans.append((at.scales + 4 * block_of(lo), at.scales + 4 * -(-hi // BLOCK)))
            size = code_dtype(codec, group).itemsize
            spans.append((at.codes + lo * size, at.codes + hi * size))
        return spans


def _scale_bytes(codec: Codec | None, n: int) -> int:
    return 0 if codec is None else 4 * codec.scale_count(n)


def code_dtype(codec: Codec | None, group: Group) -> np.dtype[Any]:
    """The dtype of ``group``'s codes: the codec's, or the group's own (pass-through)."""
    return group.dtype if codec is None else codec.code


def block_of(element: int) -> int:
    """The block holding ``element`` of a run (runs start on block boundaries)."""
    return element // BLOCK
