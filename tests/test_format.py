"""The on-disk header (encode/decode, fuzzed) and the element plan built from a layout."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gradsync import CorruptFileError
from gradsync._step import header as _format
from gradsync._step.header import (
    _CRC,
    _FIXED,
    FIXED_SIZE,
    HEADER_READ_BYTES,
    KIND_INPUT,
    KIND_OUTPUT,
    MAGIC,
    NONFINITE_LISTED,
    VERSION,
    Header,
    Layout,
    decode_header,
    encode_header,
    encode_meta,
    header_length,
    layout_hash,
    layout_json,
    longest_nonfinite,
)
from gradsync._step.plan import Plan
from gradsync._step.reduce import shard_range

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PATH = "/sync/gen-1/step-3/in-2"


def exact(message: str) -> str:
    return f"^{re.escape(message)}$"


def corrupt(message: str) -> pytest.RaisesExc[CorruptFileError]:
    return pytest.raises(CorruptFileError, match=exact(message))


# --- strategies -----------------------------------------------------------------------------

dtype_strs = st.sampled_from(["<f2", "<f4", "<f8", ">f2", ">f4", ">f8"])
shapes = st.lists(st.integers(0, 1 << 40), max_size=4).map(tuple)
layouts = st.lists(st.tuples(dtype_strs, shapes), max_size=8).map(tuple)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def metas(draw: st.DrawFn) -> dict[str, Any]:
    layout = draw(layouts)
    meta: dict[str, Any] = draw(
        st.dictionaries(
            st.text(max_size=10).filter(lambda k: k not in ("layout", "nonfinite")),
            json_values,
            max_size=3,
        )
    )
    if layout or draw(st.booleans()):
        meta["layout"] = [[d, list(s)] for d, s in layout]
    if layout and draw(st.booleans()):
        meta["nonfinite"] = draw(st.lists(st.integers(0, len(layout) - 1), max_size=4))
    return meta


@st.composite
def header_fields(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "kind": draw(st.sampled_from([KIND_INPUT, KIND_OUTPUT])),
        "flags": draw(st.integers(0, 255)),
        "rank": draw(st.integers(0, (1 << 32) - 1)),
        "world_size": draw(st.integers(0, (1 << 32) - 1)),
        "seq": draw(st.integers(0, (1 << 64) - 1)),
        "step": draw(st.integers(-(1 << 63), (1 << 63) - 1)),
        "generation": draw(st.binary(min_size=16, max_size=16)),
        "layout_digest": draw(st.binary(min_size=16, max_size=16)),
        "meta": draw(metas()),
        "payload_len": draw(st.integers(0, (1 << 64) - 1)),
    }


def sample_fields(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "kind": KIND_INPUT,
        "flags": 1,
        "rank": 2,
        "world_size": 4,
        "seq": 9,
        "step": 3,
        "generation": bytes(range(16)),
        "layout_digest": layout_hash((("<f4", (3, 2)),)),
        "meta": {"layout": [["<f4", [3, 2]], ["<f2", []]], "nonfinite": [1]},
        "payload_len": 26,
    }
    fields.update(changes)
    return fields


def expected_header(fields: dict[str, Any], offset: int) -> Header:
    return Header(
        kind=fields["kind"],
        flags=fields["flags"],
        rank=fields["rank"],
        world_size=fields["world_size"],
        seq=fields["seq"],
        step=fields["step"],
        generation=fields["generation"],
        layout_digest=fields["layout_digest"],
        meta=fields["meta"],
        payload_offset=offset,
        payload_len=fields["payload_len"],
    )


def meta_end(encoded: bytes) -> int:
    """End of the checksummed part (fixed fields, CRC and meta) of an encoded header."""
    return FIXED_SIZE + _FIXED.unpack_from(encoded)[10]


def raw_header(
    meta_bytes: bytes,
    *,
    magic: bytes = MAGIC,
    version: int = VERSION,
    kind: int = KIND_INPUT,
    meta_len: int | None = None,
    offset: int | None = None,
) -> bytes:
    """A header built by hand with a correct CRC: lets any meta bytes reach the parser."""
    length = len(meta_bytes) if meta_len is None else meta_len
    pad = offset is None  # an explicit offset is only declared, not padded to
    if offset is None:
        offset = -(-(FIXED_SIZE + len(meta_bytes)) // 64) * 64
    fixed = _FIXED.pack(
        magic, version, kind, 0, 0, 1, 0, 0, bytes(16), bytes(16), length, offset, 0
    )
    crc = zlib.crc32(meta_bytes, zlib.crc32(fixed))
    head = fixed + _CRC.pack(crc) + meta_bytes
    return head + bytes(offset - len(head)) if pad else head


def decodes_or_corrupt(data: bytes) -> Header | None:
    """Decode; only CorruptFileError may come out (anything else fails the test)."""
    error: CorruptFileError | None = None
    try:
        return decode_header(data, PATH)
    except CorruptFileError as exc:
        error = exc
    assert error.path == PATH
    assert str(error).startswith(PATH + " ")
    return None


# --- round trips ----------------------------------------------------------------------------


def test_fixed_size_matches_docs() -> None:
    assert FIXED_SIZE == 88
    assert HEADER_READ_BYTES >= FIXED_SIZE


def test_sample_round_trip() -> None:
    fields = sample_fields()
    encoded = encode_header(**fields)
    assert encoded[:4] == b"GSYN"
    assert len(encoded) % 64 == 0
    header = decode_header(encoded, PATH)
    assert header == expected_header(fields, len(encoded))
    assert header.layout() == (("<f4", (3, 2)), ("<f2", ()))


@FUZZ
@given(header_fields())
def test_round_trip(fields: dict[str, Any]) -> None:
    encoded = encode_header(**fields)
    meta_len = len(json.dumps(fields["meta"], separators=(",", ":")).encode())
    assert len(encoded) % 64 == 0
    assert FIXED_SIZE + meta_len <= len(encoded) < FIXED_SIZE + meta_len + 64
    assert encoded[FIXED_SIZE + meta_len :] == bytes(len(encoded) - FIXED_SIZE - meta_len)
    header = decode_header(encoded, PATH)
    assert header == expected_header(fields, len(encoded))
    assert header.payload_offset == len(encoded)
    layout = tuple((d, tuple(s)) for d, s in fields["meta"].get("layout", []))
    assert header.layout() == layout
    # Trailing payload bytes and a longer read change nothing.
    assert decode_header(encoded + b"\xff" * 100, PATH) == header
    assert decode_header(bytearray(encoded), PATH) == header
    assert decode_header(memoryview(encoded), PATH) == header


@FUZZ
@given(header_fields(), st.integers(0, 120))
def test_header_length_says_how_much_to_read(fields: dict[str, Any], cut: int) -> None:
    encoded = encode_header(**fields)
    meta_len = len(json.dumps(fields["meta"], separators=(",", ":")).encode())
    # Any first read that holds the fixed fields tells the whole header's length.
    assert header_length(encoded[: _FIXED.size + cut]) == FIXED_SIZE + meta_len
    assert header_length(encoded[: _FIXED.size - 1]) == 0


def test_a_header_longer_than_the_first_read_is_read_again() -> None:
    layout = tuple(("<f4", (16, 16)) for _ in range(1100))
    encoded = encode_header(
        kind=KIND_INPUT,
        rank=0,
        world_size=2,
        seq=1,
        step=0,
        generation=b"g" * 16,
        layout_digest=layout_hash(layout),
        meta=encode_meta(layout_json(layout)),
        payload_len=0,
    )
    first = encoded[:HEADER_READ_BYTES]
    assert len(encoded) > HEADER_READ_BYTES
    truncated = r"^/sync/gen-1/step-3/in-2 is truncated: 16384 bytes, its header needs "
    with pytest.raises(CorruptFileError, match=truncated):
        decode_header(first, PATH)
    assert decode_header(encoded[: header_length(first)], PATH).layout() == layout


@FUZZ
@given(header_fields(), st.integers(0, 200))
def test_round_trip_with_reserved_payload_offset(fields: dict[str, Any], extra: int) -> None:
    natural = len(encode_header(**fields))
    encoded = encode_header(**fields, payload_offset=natural + 64 * extra)
    assert len(encoded) == natural + 64 * extra
    header = decode_header(encoded, PATH)
    assert header == expected_header(fields, len(encoded))
    assert encoded[natural:] == bytes(64 * extra)


@pytest.mark.parametrize("delta", [-64, 1, 63])
def test_reserved_payload_offset_must_fit_and_align(delta: int) -> None:
    fields = sample_fields()
    natural = len(encode_header(**fields))
    with pytest.raises(
        ValueError,
        match=rf"^payload_offset {natural + delta} must be a multiple of 64 and at least "
        rf"{natural}, the end of this header$",
    ):
        encode_header(**fields, payload_offset=natural + delta)


def test_output_header_has_empty_layout() -> None:
    encoded = encode_header(**sample_fields(kind=KIND_OUTPUT, meta={}))
    header = decode_header(encoded, PATH)
    assert header.meta == {}
    assert header.layout() == ()
    assert len(encoded) == 128  # 88 fixed + 2 meta, padded to 64


@settings(max_examples=80, deadline=None)
@given(layouts, layouts)
def test_layout_hash(a: Layout, b: Layout) -> None:
    assert len(layout_hash(a)) == 16
    assert layout_hash(a) == layout_hash(tuple((d, tuple(s)) for d, s in a))
    if a != b:
        assert layout_hash(a) != layout_hash(b)


@given(
    st.one_of(st.none(), layouts),
    st.lists(st.integers(0, 7), max_size=8),
    st.one_of(
        st.none(), st.text("0123456789abcdef", max_size=24).map(lambda t: t[: len(t) // 8 * 8])
    ),
)
def test_encoded_meta_is_the_dict_as_json(
    layout: Layout | None, nonfinite: list[int], crc: str | None
) -> None:
    expected: dict[str, Any] = {}
    if layout is not None:
        expected = {"layout": [[d, list(s)] for d, s in layout], "nonfinite": nonfinite}
    if crc is not None:
        expected["crc"] = crc
    raw = encode_meta(None if layout is None else layout_json(layout), nonfinite, crc)
    assert json.loads(raw) == expected
    assert raw == json.dumps(expected, separators=(",", ":")).encode()
    # Either spelling of the meta gives the same header, which decodes to it.
    fields = sample_fields(meta=expected)
    assert encode_header(**{**fields, "meta": raw}) == encode_header(**fields)
    if layout is not None and all(i < len(layout) for i in nonfinite):
        header = decode_header(encode_header(**{**fields, "meta": raw}), PATH)
        assert header.meta == expected
        assert header.layout() == tuple((d, tuple(s)) for d, s in layout)
        unparsed = decode_header(encode_header(**{**fields, "meta": raw}), PATH, parse_meta=False)
        assert unparsed.crc(PATH) == header.crc(PATH) == (crc or "")


def test_the_crc_is_read_without_parsing_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # A checksummed peer file's CRCs are read every step: parsing a layout of many
    # params to get them cost 70 ms a peer a step at 100,000 params.
    layout = tuple(("<f4", (3, i)) for i in range(10_000))
    raw = encode_meta(layout_json(layout), [5, 7], "0123abcd" * 3)
    header = decode_header(encode_header(**sample_fields(meta=raw)), PATH, parse_meta=False)

    def no_parsing(meta_bytes: bytes, path: str) -> Any:
        raise AssertionError("parsed the whole meta")

    monkeypatch.setattr(_format, "_parse_meta", no_parsing)
    assert header.crc(PATH) == "0123abcd" * 3


@pytest.mark.parametrize(
    "meta",
    [b'{"crc":"0123abc"}', b'{"crc":"0123abcX"}', b'{"crc":"0123abcd","x":"0123abcd"}'],
)
def test_a_crc_that_is_not_where_gradsync_writes_it_is_checked_whole(meta: bytes) -> None:
    header = decode_header(raw_header(meta), PATH, parse_meta=False)
    if meta.endswith(b'"x":"0123abcd"}'):
        assert header.crc(PATH) == "0123abcd"  # another key last: parsed whole, valid
        return
    with corrupt(f"{PATH} has a malformed header meta"):
        header.crc(PATH)


# --- exact error messages -------------------------------------------------------------------


def test_bad_magic() -> None:
    encoded = bytearray(encode_header(**sample_fields()))
    encoded[:4] = b"GSYM"
    with corrupt(f"{PATH} is not a gradsync file (magic b'GSYM')"):
        decode_header(bytes(encoded), PATH)
    with corrupt(f"{PATH} is not a gradsync file (magic b'\\x00\\x00\\x00\\x00')"):
        decode_header(bytes(200), PATH)


@pytest.mark.parametrize("version", [0, 2, 65535])
def test_version_mismatch(version: int) -> None:
    encoded = bytearray(encode_header(**sample_fields()))
    struct.pack_into("<H", encoded, 4, version)
    with corrupt(f"{PATH} has format version {version}; this gradsync reads version 1"):
        decode_header(bytes(encoded), PATH)


def test_truncated_fixed_part() -> None:
    with corrupt(f"{PATH} is truncated: 0 bytes, a header needs 88"):
        decode_header(b"", PATH)
    with corrupt(f"{PATH} is truncated: 87 bytes, a header needs 88"):
        decode_header(encode_header(**sample_fields())[:87], PATH)


def test_truncated_meta() -> None:
    encoded = encode_header(**sample_fields())
    end = meta_end(encoded)
    with corrupt(f"{PATH} is truncated: {end - 1} bytes, its header needs {end}"):
        decode_header(encoded[: end - 1], PATH)


@pytest.mark.parametrize(
    ("meta_len", "offset"),
    [(10, 64), (16 << 20, 1 << 40), ((16 << 20) + 1, 1 << 40), (0, 0), (5, 92)],
)
def test_inconsistent_header(meta_len: int, offset: int) -> None:
    data = raw_header(b"{}", meta_len=meta_len, offset=offset)[: FIXED_SIZE + 2]
    if meta_len <= 16 << 20 and offset >= FIXED_SIZE + meta_len:
        with corrupt(
            f"{PATH} is truncated: {len(data)} bytes, its header needs {FIXED_SIZE + meta_len}"
        ):
            decode_header(data, PATH)
    else:
        with corrupt(
            f"{PATH} has an inconsistent header (meta {meta_len} bytes, payload at {offset})"
        ):
            decode_header(data, PATH)


def test_checksum_mismatch() -> None:
    encoded = bytearray(encode_header(**sample_fields()))
    encoded[FIXED_SIZE] ^= 0x01  # first byte of the meta
    with corrupt(f"{PATH} has a corrupt header (checksum mismatch)"):
        decode_header(bytes(encoded), PATH)


@pytest.mark.parametrize("kind", [0, 4, 255])
def test_unknown_kind(kind: int) -> None:
    with corrupt(f"{PATH} has unknown kind {kind}"):
        decode_header(encode_header(**sample_fields(kind=kind)), PATH)


@pytest.mark.parametrize("meta_bytes", [b"{", b"\xff\xfe", b"", b"{'a': 1}", b"NaN?"])
def test_unreadable_meta(meta_bytes: bytes) -> None:
    with corrupt(f"{PATH} has an unreadable header meta"):
        decode_header(raw_header(meta_bytes), PATH)


@pytest.mark.parametrize(
    "meta",
    [
        [],
        "layout",
        7,
        None,
        {"layout": "x"},
        {"layout": {}},
        {"nonfinite": 0},
        {"layout": [["<f4"]]},
        {"layout": [["<f4", [2], 3]]},
        {"layout": [[4, [2]]]},
        {"layout": [["<f4", 2]]},
        {"layout": [["<i4", [2]]]},
        {"layout": [["float32", [2]]]},
        {"layout": [["<f4", [-1]]]},
        {"layout": [["<f4", [1 << 62]]]},
        {"layout": [["<f4", [2.0]]]},
        {"layout": [["<f4", [True]]]},
        {"layout": [["<f4", ["2"]]]},
        {"nonfinite": [0]},
        {"layout": [["<f4", [2]]], "nonfinite": [1]},
        {"layout": [["<f4", [2]]], "nonfinite": [-1]},
        {"layout": [["<f4", [2]]], "nonfinite": [False]},
        {"layout": [["<f4", [2]]], "nonfinite": [0], "nonfinite_more": -1},
        {"layout": [["<f4", [2]]], "nonfinite": [0], "nonfinite_more": 2},
        {"layout": [["<f4", [2]]], "nonfinite": [0], "nonfinite_more": 1.0},
    ],
)
def test_malformed_meta(meta: Any) -> None:
    with corrupt(f"{PATH} has a malformed header meta"):
        decode_header(encode_header(**sample_fields(meta=meta)), PATH)


@given(st.integers(0, 100_000), st.data())
def test_no_nonfinite_list_encodes_longer_than_the_longest(
    params: int, data: st.DataObject
) -> None:
    # buffers_like reserves a header sized by longest_nonfinite before any step.
    bad = data.draw(st.lists(st.integers(0, max(params - 1, 0)), unique=True, max_size=30))
    bad = sorted(bad) if params else []
    if data.draw(st.booleans()):
        bad = list(range(params - len(bad), params))  # the highest indices
    longest = len(encode_meta("[]", longest_nonfinite(params)))
    assert len(encode_meta("[]", bad)) <= longest
    assert len(encode_meta("[]", list(range(params)))) <= longest


@pytest.mark.parametrize("bad", [0, 1, NONFINITE_LISTED, NONFINITE_LISTED + 1, 1000])
def test_a_long_nonfinite_list_is_cut_and_counted(bad: int) -> None:
    layout = tuple(("<f4", (2,)) for _ in range(1000))
    meta = json.loads(encode_meta(layout_json(layout), range(1000 - bad, 1000), "0" * 8))
    listed = list(range(1000 - bad, 1000))[:NONFINITE_LISTED]
    more = {"nonfinite_more": bad - NONFINITE_LISTED} if bad > NONFINITE_LISTED else {}
    assert meta == {
        "layout": json.loads(layout_json(layout)),
        "nonfinite": listed,
        **more,
        "crc": "0" * 8,
    }
    assert decode_header(encode_header(**sample_fields(meta=meta)), PATH).full_meta(PATH) == meta


def test_deeply_nested_meta_is_corrupt_not_recursion_error() -> None:
    depth = 100_000
    with corrupt(f"{PATH} has an unreadable header meta"):
        decode_header(raw_header(b"[" * depth + b"]" * depth), PATH)


# --- fuzzing --------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    decodes_or_corrupt(data)


@FUZZ
@given(st.binary(max_size=300), st.binary(max_size=64))
def test_fuzz_after_valid_magic_and_version(tail: bytes, meta: bytes) -> None:
    decodes_or_corrupt(MAGIC + struct.pack("<H", VERSION) + tail)
    # With a correct CRC the meta itself reaches the JSON parser and the validator.
    decodes_or_corrupt(raw_header(meta))
    decodes_or_corrupt(raw_header(meta, kind=KIND_OUTPUT)[: FIXED_SIZE + len(meta)])


@FUZZ
@given(json_values)
def test_fuzz_arbitrary_json_meta(meta: Any) -> None:
    header = decodes_or_corrupt(raw_header(json.dumps(meta).encode()))
    if header is not None:
        assert header.meta == meta
        header.layout()  # a validated meta always yields a layout


def test_truncation_at_every_length() -> None:
    encoded = encode_header(**sample_fields())
    end = meta_end(encoded)
    whole = decode_header(encoded, PATH)
    for n in range(len(encoded) + 1):
        data = encoded[:n]
        if n < FIXED_SIZE:
            with corrupt(f"{PATH} is truncated: {n} bytes, a header needs {FIXED_SIZE}"):
                decode_header(data, PATH)
        elif n < end:
            with corrupt(f"{PATH} is truncated: {n} bytes, its header needs {end}"):
                decode_header(data, PATH)
        else:  # the padding is not needed to decode
            assert decode_header(data, PATH) == whole


@FUZZ
@given(header_fields(), st.data())
def test_truncation_of_random_headers(fields: dict[str, Any], data: st.DataObject) -> None:
    encoded = encode_header(**fields)
    n = data.draw(st.integers(0, meta_end(encoded) - 1))
    with pytest.raises(CorruptFileError, match=r" is truncated: "):
        decode_header(encoded[:n], PATH)


@FUZZ
@given(header_fields(), st.data())
def test_byte_flips_detected(fields: dict[str, Any], data: st.DataObject) -> None:
    encoded = encode_header(**fields)
    end = meta_end(encoded)
    flips = data.draw(
        st.dictionaries(st.integers(0, len(encoded) - 1), st.integers(1, 255), min_size=1)
    )
    mutated = bytearray(encoded)
    for pos, mask in flips.items():
        mutated[pos] ^= mask
    header = decodes_or_corrupt(bytes(mutated))
    if any(pos < end for pos in flips):
        # Everything before the padding is covered by magic, version or the CRC-32.
        assert header is None
    else:
        assert header == decode_header(encoded, PATH)  # padding is not checked


def test_every_single_byte_flip_detected() -> None:
    encoded = encode_header(**sample_fields())
    for pos in range(meta_end(encoded)):
        for mask in (0x01, 0x80, 0xFF):
            mutated = bytearray(encoded)
            mutated[pos] ^= mask
            assert decodes_or_corrupt(bytes(mutated)) is None, (pos, mask)


def test_huge_declared_meta_does_not_allocate_or_hang() -> None:
    data = raw_header(b"", meta_len=16 << 20, offset=1 << 62)[:FIXED_SIZE]
    with corrupt(
        f"{PATH} is truncated: {FIXED_SIZE} bytes, its header needs {FIXED_SIZE + (16 << 20)}"
    ):
        decode_header(data, PATH)


# --- Plan.build -----------------------------------------------------------------------------

plan_layouts = st.lists(
    st.tuples(
        st.sampled_from(["<f4", "<f2", "<f8"]),
        st.lists(st.integers(0, 40), max_size=3).map(tuple),
    ),
    max_size=7,
).map(tuple)


def check_plan(layout: Layout, world: int, root_only: bool) -> Plan:
    plan = Plan.build(layout, world, root_only)
    assert plan.layout == layout
    assert plan.digest == layout_hash(layout)
    # Groups: one per dtype, in order of first appearance, params in caller order.
    first_seen: list[str] = []
    for dtype, _ in layout:
        if dtype not in first_seen:
            first_seen.append(dtype)
    assert [g.dtype for g in plan.groups] == [np.dtype(d) for d in first_seen]
    in_offset = 0
    out_offsets = [0] * world
    for group, dtype_str in zip(plan.groups, first_seen, strict=True):
        members = [i for i, (d, _) in enumerate(layout) if d == dtype_str]
        assert [p[0] for p in group.params] == members
        first = 0
        for index, start, count in group.params:
            assert start == first
            assert count == int(np.prod(layout[index][1], dtype=np.int64))
            first += count
        assert group.size == first
        assert group.in_offset == in_offset
        in_offset += group.size * group.dtype.itemsize
        # Shards tile the group; the root strategy gives everything to rank 0.
        assert len(group.shards) == world
        if root_only:
            assert group.shards == ((0, group.size),) + ((group.size, group.size),) * (world - 1)
        else:
            assert group.shards == tuple(shard_range(group.size, q, world) for q in range(world))
        assert group.out_offsets == tuple(out_offsets)
        for q, (lo, hi) in enumerate(group.shards):
            out_offsets[q] += (hi - lo) * group.dtype.itemsize
            check_segments(group, lo, hi)
    assert plan.in_len == in_offset
    assert plan.out_lens == tuple(out_offsets)
    assert sum(plan.out_lens) == plan.in_len
    if root_only:
        assert plan.out_lens == (plan.in_len,) + (0,) * (world - 1)
    assert sorted(plan.ordered_params()) == list(range(len(layout)))
    assert plan.ordered_params() == [p[0] for g in plan.groups for p in g.params]
    return plan


def check_segments(group: Any, lo: int, hi: int) -> None:
    """The segments of [lo, hi) map each flat element to exactly one param element."""
    segments = group.segments(lo, hi)
    at = 0
    owner = {index: first for index, first, _ in group.params}
    for seg in segments:
        assert seg.at == at
        assert seg.start < seg.stop
        count = next(c for i, _, c in group.params if i == seg.param)
        assert 0 <= seg.start < seg.stop <= count
        assert owner[seg.param] + seg.start == lo + seg.at  # same group element
        at += seg.stop - seg.start
    assert at == hi - lo


@settings(max_examples=150, deadline=None)
@given(plan_layouts, st.integers(1, 6), st.booleans())
def test_plan_properties(layout: Layout, world: int, root_only: bool) -> None:
    check_plan(layout, world, root_only)


@settings(max_examples=50, deadline=None)
@given(plan_layouts, st.integers(1, 6), st.data())
def test_group_segments_any_range(layout: Layout, world: int, data: st.DataObject) -> None:
    plan = Plan.build(layout, world, False)
    assume(plan.groups)
    group = data.draw(st.sampled_from(plan.groups))
    lo = data.draw(st.integers(0, group.size))
    hi = data.draw(st.integers(lo, group.size))
    check_segments(group, lo, hi)


def test_group_segments_look_only_at_the_params_of_their_range() -> None:
    # The reduce asks for every chunk's segments: scanning every param for each made
    # the first step O(params x chunks) (200,000 params in 200 chunks: 6 s).
    looked = 0

    class Counted(tuple[tuple[int, int, int], ...]):
        def __getitem__(self, key: Any) -> Any:
            nonlocal looked
            looked += 1
            return super().__getitem__(key)

        def __iter__(self) -> Any:
            nonlocal looked
            for item in super().__iter__():
                looked += 1
                yield item

    plain = Plan.build(tuple(("<f4", (7,)) for _ in range(3000)), 1, False).groups[0]
    counted = dataclasses.replace(plain, params=Counted(plain.params), _memo={})
    chunks = [(lo, min(lo + 64, plain.size)) for lo in range(0, plain.size, 64)]
    got = [counted.segments(lo, hi) for lo, hi in chunks]
    assert looked <= 3 * (len(plain.params) + len(chunks)), looked
    assert got == [plain.segments(lo, hi) for lo, hi in chunks]
    for lo, hi in chunks:
        check_segments(plain, lo, hi)


@settings(max_examples=50, deadline=None)
@given(plan_layouts, st.integers(1, 6), st.booleans())
def test_plan_runs_keep_everything_the_files_see(
    layout: Layout, world: int, root_only: bool
) -> None:
    plan = Plan.build(layout, world, root_only, replicate_below=200)
    runs = plan.runs
    assert runs is plan.runs  # built once
    assert (runs.digest, runs.layout_text, runs.in_len, runs.out_lens, runs.replicated) == (
        plan.digest,
        plan.layout_text,
        plan.in_len,
        plan.out_lens,
        plan.replicated,
    )
    assert len(runs.groups) == len(plan.groups)
    for k, (run, group) in enumerate(zip(runs.groups, plan.groups, strict=True)):
        assert run.params == ((k, 0, group.size),)
        assert (run.dtype, run.size, run.in_offset, run.shards, run.out_offsets) == (
            group.dtype,
            group.size,
            group.in_offset,
            group.shards,
            group.out_offsets,
        )
    assert runs.layout == tuple((g.dtype.str, (g.size,)) for g in plan.groups)


def test_plan_example() -> None:
    layout: Layout = (
        ("<f4", (40,)),
        ("<f2", (3, 2)),
        ("<f4", (2, 5)),
        ("<f4", ()),
        ("<f8", (0,)),
    )
    plan = check_plan(layout, 2, False)
    f4, f2, f8 = plan.groups
    assert f4.params == ((0, 0, 40), (2, 40, 10), (3, 50, 1))
    assert (f4.size, f4.in_offset, f4.shards) == (51, 0, ((0, 32), (32, 51)))
    assert (f2.size, f2.in_offset, f2.shards) == (6, 204, ((0, 0), (0, 6)))
    assert (f8.size, f8.in_offset, f8.shards) == (0, 216, ((0, 0), (0, 0)))
    assert f2.out_offsets == (128, 76)
    assert plan.in_len == 216
    assert plan.out_lens == (128, 88)
    assert plan.ordered_params() == [0, 2, 3, 1, 4]
    assert [(s.param, s.start, s.stop, s.at) for s in f4.segments(16, 51)] == [
        (0, 16, 40, 0),
        (2, 0, 10, 24),
        (3, 0, 1, 34),
    ]
    root = check_plan(layout, 3, True)
    assert root.out_lens == (216, 0, 0)
    assert [g.shards for g in root.groups] == [
        ((0, 51), (51, 51), (51, 51)),
        ((0, 6), (6, 6), (6, 6)),
        ((0, 0), (0, 0), (0, 0)),
    ]


def test_plan_empty_layout() -> None:
    plan = check_plan((), 3, False)
    assert (plan.groups, plan.in_len, plan.out_lens) == ((), 0, (0, 0, 0))
