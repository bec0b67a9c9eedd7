"""Checksums (whole file, blocks, S3 multipart parts) and ranged-read planning."""

from __future__ import annotations

import base64
import os
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from uc_checkpoint.engine.ranges import TAIL_FOLD, ByteBudget, RangeRequest, plan_ranges
from uc_checkpoint.errors import CorruptCheckpointError
from uc_checkpoint.format.integrity import (
    Digest,
    block_span,
    composite_crc32_base64,
    crc32_base64,
    digest_file,
    verify_blocks,
)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=5000),
    block=st.integers(1, 700),
    part=st.integers(1, 900),
    cuts=st.lists(st.integers(0, 5000), max_size=6),
)
def test_digest_matches_zlib_whatever_the_chunking(data: bytes, block: int, part: int, cuts: list[int]) -> None:
    digest = Digest(block_size=block, part_size=part)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    for lo, hi in zip(bounds, bounds[1:]):
        digest.update(data[lo:hi])
    record = digest.record("f")
    assert record.size == len(data)
    assert record.crc32 == f"{zlib.crc32(data):08x}"
    blocks = struct.unpack(f">{len(record.block_crc32) // 4}I", record.block_crc32)
    assert list(blocks) == [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]
    assert digest.part_crc32 == [zlib.crc32(data[i : i + part]) for i in range(0, len(data), part)]


def test_digest_file_and_s3_checksum_forms(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 + 17)
    path = tmp_path / "f"
    path.write_bytes(data)
    digest = digest_file(path, part_size=1024)
    assert digest.record("f").crc32 == f"{zlib.crc32(data):08x}"
    assert crc32_base64(zlib.crc32(data)) == base64.b64encode(struct.pack(">I", zlib.crc32(data))).decode()
    parts = [data[i : i + 1024] for i in range(0, len(data), 1024)]
    expected = zlib.crc32(b"".join(struct.pack(">I", zlib.crc32(p)) for p in parts))
    assert composite_crc32_base64(digest.part_crc32) == crc32_base64(expected)


def test_verify_blocks_finds_the_flipped_block() -> None:
    data = bytearray(os.urandom(10_000))
    digest = Digest(block_size=1000)
    digest.update(data)
    record = digest.record("__0_x_0.distcp")
    verify_blocks(memoryview(data)[2000:5000], 2000, record, "s3://b/ck/__0_x_0.distcp")
    verify_blocks(memoryview(data)[9000:], 9000, record, "w")  # short last block
    data[3500] ^= 0x01
    with pytest.raises(CorruptCheckpointError, match=r"s3://b/ck/__0_x_0.distcp.*bytes 3000-3999 \(block 3\)"):
        verify_blocks(memoryview(data)[2000:5000], 2000, record, "s3://b/ck/__0_x_0.distcp")
    with pytest.raises(ValueError, match="aligned"):
        verify_blocks(memoryview(data)[10:20], 10, record, "w")


def test_block_span() -> None:
    assert block_span(0, 1, 100, 10) == (0, 10)
    assert block_span(15, 25, 100, 10) == (10, 30)
    assert block_span(95, 100, 97, 10) == (90, 97)  # clipped to the file
    assert block_span(20, 30, 100, 10) == (20, 30)


def test_plan_ranges_merges_small_gaps_and_widens_to_blocks() -> None:
    spans = [
        ("a", 0, 100, "i0"),
        ("a", 150, 50, "i1"),  # 50-byte gap: merged
        ("a", 10_000, 10, "i2"),  # far: separate
        ("b", 5, 5, "j0"),
    ]
    reqs = plan_ranges(spans, file_sizes={"a": 20_000, "b": 50}, block_sizes={"a": 64}, gap_bytes=100)
    assert [(r.name, r.start, r.end, r.items) for r in reqs] == [
        ("a", 0, 256, ["i0", "i1"]),
        ("a", 9984, 10048, ["i2"]),
        ("b", 5, 10, ["j0"]),
    ]


def test_plan_ranges_caps_merged_size_but_keeps_big_items_whole() -> None:
    spans = [("a", i * 100, 100, i) for i in range(10)] + [("a", 5000, 3000, "big")]
    reqs = plan_ranges(spans, file_sizes={"a": 8000}, gap_bytes=0, max_range_bytes=250)
    assert [(r.start, r.end) for r in reqs] == [(0, 200), (200, 400), (400, 600), (600, 800), (800, 1000), (5000, 8000)]
    assert reqs[-1].pieces(1024) == [(5000, 6024), (6024, 7048), (7048, 8000)]


@settings(max_examples=80, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 5000), st.integers(1, 800)), min_size=1, max_size=30
    ),
    gap=st.integers(0, 600),
    cap=st.integers(1, 3000),
    block=st.sampled_from([0, 1, 64, 1000]),
)
def test_plan_ranges_covers_every_item_exactly_once(items, gap: int, cap: int, block: int) -> None:
    spans = [(name, off, length, idx) for idx, (name, off, length) in enumerate(items)]
    sizes = {n: 6000 for n in "abc"}
    reqs = plan_ranges(
        spans,
        file_sizes=sizes,
        block_sizes={n: block for n in "abc"} if block else None,
        gap_bytes=gap,
        max_range_bytes=cap,
    )
    seen = [i for r in reqs for i in r.items]
    assert sorted(seen) == list(range(len(items)))
    for r in reqs:
        for i in r.items:
            name, off, length = items[i]
            assert r.name == name and r.start <= off and off + length <= r.end
            if block:
                assert r.start % block == 0 and (r.end % block == 0 or r.end == sizes[name])
    for name in "abc":  # no byte of a file is fetched twice
        spans_of = sorted((r.start, r.end) for r in reqs if r.name == name)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans_of, spans_of[1:]))


def test_contiguous_items_sharing_checksum_blocks_are_one_range_past_the_cap() -> None:
    # A 128 MiB-style file of unaligned contiguous items, verified in blocks: cut at the cap, each
    # cut fetched its straddling block twice and added a GET.
    spans = [("a", 10 + i * 1000, 1000, i) for i in range(12)]
    reqs = plan_ranges(spans, file_sizes={"a": 12_020}, block_sizes={"a": 256}, gap_bytes=0, max_range_bytes=4000)
    assert [(r.start, r.end, r.items) for r in reqs] == [(0, 12_020, list(range(12)))]
    assert len(reqs[0].pieces(4096)) == 3  # what the file's size asks for, not a piece more
    # Without blocks the same spans do not overlap: the cap still cuts them.
    plain = plan_ranges(spans, file_sizes={"a": 12_020}, gap_bytes=0, max_range_bytes=4000)
    assert [(r.start, r.end) for r in plain] == [(10, 4010), (4010, 8010), (8010, 12_010)]


def test_byte_budget_admits_one_oversized_request_alone() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(500)  # nothing held: proceeds alone
    assert not budget.try_take(1)
    budget.give(500)
    assert budget.try_take(60) and not budget.try_take(50) and budget.try_take(40)


def test_crc32_combine_is_the_crc_of_the_concatenation() -> None:
    import os
    import random
    import zlib

    from uc_checkpoint.format.integrity import crc32_combine

    rng = random.Random(7)
    for _ in range(200):
        a, b = os.urandom(rng.randint(0, 3000)), os.urandom(rng.randint(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("part_size", [None, 3, 64, 100, 5000])
@pytest.mark.parametrize("block_size", [1, 7, 64, 4096])
def test_one_pass_digest_equals_separate_crcs(block_size: int, part_size: int | None) -> None:
    # Whole, block and part CRC-32s come from one zlib pass over each span plus crc32_combine; they
    # must equal CRCs computed separately, whatever the chunks the bytes arrive in.
    import os
    import random
    import struct
    import zlib

    rng = random.Random(block_size * 31 + (part_size or 0))
    for size in (0, 1, block_size, 3 * block_size + 5, rng.randint(0, 20000)):
        data = os.urandom(size)
        digest = Digest(block_size, part_size)
        pos = 0
        while pos < size:
            step = rng.randint(1, 3000)
            digest.update(data[pos : pos + step])
            pos += step
        record = digest.record("f")
        assert record.crc32 == f"{zlib.crc32(data):08x}"
        blocks = struct.unpack(f">{len(record.block_crc32) // 4}I", record.block_crc32)
        assert list(blocks) == [zlib.crc32(data[i : i + block_size]) for i in range(0, size, block_size)]
        if part_size:
            assert digest.part_crc32 == [zlib.crc32(data[i : i + part_size]) for i in range(0, size, part_size)]


def test_a_short_tail_is_read_with_the_piece_before_it() -> None:
    chunk = 16 << 20
    # A data file is a few KiB of archive records longer than its tensors: one GET, not two.
    assert RangeRequest("a", 0, chunk + 1577).pieces(chunk) == [(0, chunk + 1577)]
    # A tail of a quarter chunk or more is a piece of its own.
    assert RangeRequest("a", 0, 2 * chunk + chunk // 4).pieces(chunk) == [
        (0, chunk),
        (chunk, 2 * chunk),
        (2 * chunk, 2 * chunk + chunk // 4),
    ]
    assert RangeRequest("a", 7, 9).pieces(chunk) == [(7, 9)]  # one short range stays one piece


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 10_000), length=st.integers(1, 20_000), chunk=st.integers(1, 5_000))
def test_pieces_cover_the_range_in_order_and_are_at_most_one_and_a_quarter_chunks(
    start: int, length: int, chunk: int
) -> None:
    pieces = RangeRequest("a", start, start + length).pieces(chunk)
    assert pieces[0][0] == start and pieces[-1][1] == start + length
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all(lo < hi <= lo + chunk + chunk // TAIL_FOLD for lo, hi in pieces)
    assert all(lo % chunk == start % chunk for lo, _ in pieces)  # aligned as the chunks are
    assert len(pieces) == 1 or pieces[-1][1] - pieces[-1][0] >= chunk // TAIL_FOLD


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=20_000), value=st.integers(0, 2**32 - 1), cut=st.integers(0, 20_000))
def test_crc32_is_zlibs_whichever_implementation_computes_it(data: bytes, value: int, cut: int) -> None:
    from uc_checkpoint.format.integrity import crc32

    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, value) == zlib.crc32(data, value)
    view = memoryview(bytearray(data))[cut:]
    assert crc32(view, value) == zlib.crc32(view, value)
    assert crc32(data[cut:], crc32(data[:cut])) == zlib.crc32(data)  # continued, as Digest does


def test_crc32_uses_isa_l_where_it_is_installed() -> None:
    from isal import isal_zlib  # a declared dependency: its absence fails here

    from uc_checkpoint.format import integrity

    assert integrity._crc32 is isal_zlib.crc32  # not a silent fallback to zlib's, ~12x the CPU
