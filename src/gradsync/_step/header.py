"""The on-disk format of published files: a checked header, then the payload.

Layout of every file (little-endian)::

    fixed header (88 bytes, ``_FIXED``)
    meta: UTF-8 JSON of ``meta_len`` bytes (param layout, non-finite params)
    zero padding up to ``payload_offset`` (a multiple of 64)
    payload: ``payload_len`` bytes of gradient elements

The header's CRC-32 covers the fixed fields and the meta, so a torn or garbled
header is caught before anything is read. Decoding raises only
:class:`CorruptFileError`, whatever the bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync._errors import CorruptFileError

__all__ = [
    "HEADER_READ_BYTES",
    "KIND_INPUT",
    "KIND_OUTPUT",
    "KIND_SHARD",
    "MAX_META",
    "MAX_PARAMS",
    "NONFINITE_LISTED",
    "Header",
    "Layout",
    "decode_header",
    "encode_header",
    "encode_meta",
    "header_length",
    "layout_hash",
    "layout_json",
    "layout_text_hash",
    "longest_nonfinite",
]

MAGIC = b"GSYN"
VERSION = 1
KIND_INPUT = 1  # a rank's whole gradient, as handed in
KIND_OUTPUT = 2  # a rank's reduced shard of the mean
KIND_SHARD = 3  # the part of a rank's input that one shard's reducer reads (names.shard_data_name)
_KINDS = (KIND_INPUT, KIND_OUTPUT, KIND_SHARD)
FLAG_NONFINITE = 1
FLAG_CHECKSUMS = 2  # meta["crc"]: CRC-32 of every CRC_BLOCK bytes of payload, 8 hex digits each
CRC_BLOCK = 1 << 20
_FIXED = struct.Struct("<4sHBBIIQq16s16sIQQ")
_CRC = struct.Struct("<I")
FIXED_SIZE = _FIXED.size + _CRC.size
_ALIGN = 64
# What a reader accepts of a header (bounds a corrupt file's cost); writers refuse more.
MAX_META = 16 << 20
MAX_PARAMS = 1 << 20
# A header lists this many of its non-finite params, then counts the rest
# ("nonfinite_more"): the error names no more, and a million would outgrow MAX_META.
NONFINITE_LISTED = 10
_DTYPE_STRS = frozenset({"<f2", "<f4", "<f8", ">f2", ">f4", ">f8"})
# The meta's last key when it has checksums (encode_meta): no layout text contains it.
_CRC_KEY = b'"crc":"'
# One read of this many bytes gets the header of any ordinary job.
HEADER_READ_BYTES = 16384

# (dtype string such as "<f4", shape) per param, in the caller's order.
Layout = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Header:
    """The decoded header of a published file."""

    kind: int
    flags: int
    rank: int
    world_size: int
    seq: int
    step: int
    generation: bytes
    layout_digest: bytes
    meta: dict[str, Any]
    payload_offset: int
    payload_len: int
    meta_raw: bytes = field(default=b"", compare=False, repr=False)

    def full_meta(self, path: str) -> dict[str, Any]:
        """The meta, parsing it now if ``decode_header`` was told to skip it.

        Raises:
            CorruptFileError: the meta is not valid.
        """
        return self.meta if self.meta or not self.meta_raw else _parse_meta(self.meta_raw, path)

    def crc(self, path: str) -> str:
        """The meta's ``crc`` (see ``FLAG_CHECKSUMS``), ``""`` if it has none.

        Taken from the end of the meta, where :func:`encode_meta` puts it, without
        parsing the layout before it: with a hundred thousand params that is a
        megabyte of JSON a peer a step. Anything else is parsed whole.

        Raises:
            CorruptFileError: the meta is not valid.
        """
        raw = self.meta_raw
        at = raw.rfind(_CRC_KEY)
        if not self.meta and at >= 0 and raw.endswith(b'"}'):
            value = raw[at + len(_CRC_KEY) : -2]
            if not (len(value) % 8 or value.strip(b"0123456789abcdef")):
                return value.decode("ascii")
        crc: str = self.full_meta(path).get("crc", "")
        return crc

    def layout(self, path: str = "") -> Layout:
        """The param layout carried in the meta (input files only)."""
        raw = self.full_meta(path).get("layout", [])
        return tuple((str(d), tuple(int(x) for x in s)) for d, s in raw)


def layout_json(layout: Layout) -> str:
    """The layout as compact JSON: ``[["<f4",[3,4]],...]``."""
    return json.dumps([[d, list(s)] for d, s in layout], separators=(",", ":"))


def layout_hash(layout: Layout) -> bytes:
    """A 16-byte digest of a layout; equal layouts, equal digests."""
    return layout_text_hash(layout_json(layout))


def layout_text_hash(text: str) -> bytes:
    """:func:`layout_hash` of the layout whose :func:`layout_json` is ``text``."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def encode_meta(
    layout_text: str | None, nonfinite: Sequence[int] = (), crc: str | None = None
) -> bytes:
    """A header's meta as JSON bytes: ``layout_text`` (from :func:`layout_json`, input
    files only, with the first ``NONFINITE_LISTED`` of the ``nonfinite`` param indices
    and how many more there are) and the payload ``crc``.

    Built as text: the layout's part is encoded once per plan, not every step.
    """
    parts = ["{"]
    if layout_text is not None:
        parts += [
            '"layout":',
            layout_text,
            ',"nonfinite":',
            json.dumps([int(i) for i in nonfinite[:NONFINITE_LISTED]], separators=(",", ":")),
        ]
        if len(nonfinite) > NONFINITE_LISTED:
            parts.append(f',"nonfinite_more":{len(nonfinite) - NONFINITE_LISTED}')
    if crc is not None:
        parts += ["," if layout_text is not None else "", '"crc":', json.dumps(crc)]
    parts.append("}")
    return "".join(parts).encode()


def longest_nonfinite(params: int) -> list[int]:
    """The non-finite list of ``params`` params that :func:`encode_meta` writes longest:
    the highest indices listed and the most counted (sizes a header before any step)."""
    return [*range(max(params - NONFINITE_LISTED, 0), params), *range(params - NONFINITE_LISTED)]


def encode_header(
    *,
    kind: int,
    rank: int,
    world_size: int,
    seq: int,
    step: int,
    generation: bytes,
    layout_digest: bytes,
    meta: dict[str, Any] | bytes,
    payload_len: int,
    flags: int = 0,
    payload_offset: int | None = None,
) -> bytes:
    """Encode a header, padded so the payload starts at a multiple of 64 bytes:
    the first after the meta, or ``payload_offset``. ``meta`` is a dict, or its JSON
    already encoded (:func:`encode_meta`).

    Raises:
        ValueError: ``payload_offset`` is not a multiple of 64 or leaves the header
            no room.
    """
    meta_bytes = (
        meta if isinstance(meta, bytes) else json.dumps(meta, separators=(",", ":")).encode()
    )
    offset = -(-(FIXED_SIZE + len(meta_bytes)) // _ALIGN) * _ALIGN
    if payload_offset is not None:
        if payload_offset < offset or payload_offset % _ALIGN:
            raise ValueError(
                f"payload_offset {payload_offset} must be a multiple of {_ALIGN} and at "
                f"least {offset}, the end of this header"
            )
        offset = payload_offset
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        kind,
        flags,
        rank,
        world_size,
        seq,
        step,
        generation,
        layout_digest,
        len(meta_bytes),
        offset,
        payload_len,
    )
    crc = zlib.crc32(meta_bytes, zlib.crc32(fixed))
    head = fixed + _CRC.pack(crc) + meta_bytes
    return head + bytes(offset - len(head))


def header_length(data: bytes) -> int:
    """How many bytes the header starting ``data`` spans up to the end of its meta, as
    its fixed fields say (unchecked: :func:`decode_header` checks them); 0 when ``data``
    is too short to say. A reader whose first read was shorter reads that much again:
    the meta of a job with a thousand params is longer than ``HEADER_READ_BYTES``."""
    if len(data) < _FIXED.size:
        return 0
    meta_len: int = _FIXED.unpack_from(data)[10]
    return FIXED_SIZE + min(meta_len, MAX_META + 1)


def decode_header(data: bytes, path: str, *, parse_meta: bool = True) -> Header:
    """Decode the header at the start of ``data`` (at least the whole header).

    With ``parse_meta=False`` the meta is checksummed but not parsed (``meta`` is
    empty): the hot path needs it only when layouts differ; ``full_meta`` parses it.

    Raises:
        CorruptFileError: naming ``path`` and what is wrong; nothing else, for any input.
    """
    if len(data) < FIXED_SIZE:
        raise CorruptFileError(
            f"{path} is truncated: {len(data)} bytes, a header needs {FIXED_SIZE}", path=path
        )
    (magic, version, kind, flags, rank, world, seq, step, gen, digest, meta_len, offset, plen) = (
        _FIXED.unpack_from(data)
    )
    if magic != MAGIC:
        raise CorruptFileError(f"{path} is not a gradsync file (magic {magic!r})", path=path)
    if version != VERSION:
        raise CorruptFileError(
            f"{path} has format version {version}; this gradsync reads version {VERSION}",
            path=path,
        )
    if meta_len > MAX_META or offset < FIXED_SIZE + meta_len:
        raise CorruptFileError(
            f"{path} has an inconsistent header (meta {meta_len} bytes, payload at {offset})",
            path=path,
        )
    end = FIXED_SIZE + meta_len
    if len(data) < end:
        raise CorruptFileError(
            f"{path} is truncated: {len(data)} bytes, its header needs {end}", path=path
        )
    (crc,) = _CRC.unpack_from(data, _FIXED.size)
    meta_bytes = bytes(data[FIXED_SIZE:end])
    if zlib.crc32(meta_bytes, zlib.crc32(bytes(data[: _FIXED.size]))) != crc:
        raise CorruptFileError(f"{path} has a corrupt header (checksum mismatch)", path=path)
    if kind not in _KINDS:
        raise CorruptFileError(f"{path} has unknown kind {kind}", path=path)
    meta = _parse_meta(meta_bytes, path) if parse_meta else {}
    return Header(kind, flags, rank, world, seq, step, gen, digest, meta, offset, plen, meta_bytes)


def _parse_meta(meta_bytes: bytes, path: str) -> dict[str, Any]:
    try:
        meta = json.loads(meta_bytes)
    except (ValueError, RecursionError):
        raise CorruptFileError(f"{path} has an unreadable header meta", path=path) from None
    if not isinstance(meta, dict) or not _valid_meta(meta):
        raise CorruptFileError(f"{path} has a malformed header meta", path=path)
    return meta


def block_crcs(chunks: Sequence[bytes | memoryview], total: int) -> str:
    """CRC-32 of every ``CRC_BLOCK`` bytes of the concatenated ``chunks``, as hex."""
    out: list[str] = []
    crc = 0
    filled = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while len(view):
            take = min(len(view), CRC_BLOCK - filled)
            crc = zlib.crc32(view[:take], crc)
            filled += take
            view = view[take:]
            if filled == CRC_BLOCK:
                out.append(f"{crc:08x}")
                crc, filled = 0, 0
    if filled:
        out.append(f"{crc:08x}")
    if len(out) != -(-total // CRC_BLOCK):
        raise ValueError(
            f"chunks hold {sum(len(memoryview(c).cast('B')) for c in chunks)} bytes, not {total}"
        )
    return "".join(out)


def crc_placeholder(total: int) -> str:
    """A CRC string of the right length for ``total`` bytes (headers are sized first)."""
    return "0" * 8 * -(-total // CRC_BLOCK)


def _valid_meta(meta: dict[str, Any]) -> bool:
    crc = meta.get("crc", "")
    if not isinstance(crc, str) or len(crc) % 8 or any(c not in "0123456789abcdef" for c in crc):
        return False
    layout = meta.get("layout", [])
    nonfinite = meta.get("nonfinite", [])
    if not isinstance(layout, list) or not isinstance(nonfinite, list):
        return False
    if len(layout) > MAX_PARAMS:
        return False
    for item in layout:
        if not (isinstance(item, list) and len(item) == 2):
            return False
        dtype, shape = item
        if not isinstance(dtype, str) or not isinstance(shape, list):
            return False
        if dtype not in _DTYPE_STRS or not all(type(x) is int and 0 <= x < 1 << 62 for x in shape):
            return False
    more = meta.get("nonfinite_more", 0)
    if type(more) is not int or not 0 <= more <= len(layout):
        return False
    return all(type(x) is int and 0 <= x < len(layout) for x in nonfinite)
