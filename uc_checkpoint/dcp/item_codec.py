"""DCP's per-tensor item format (one ``torch.save`` archive per item), written and read fast.

A DCP data file holds each tensor item as a complete ``torch.save`` zip archive, so stock readers
can ``torch.load`` it. Each ``torch.save`` and ``torch.load`` costs the same pickling and zip
bookkeeping whatever the tensor's size, so for a checkpoint of many small tensors that fixed cost is
most of the time (``benchmarks/test_item_codec_speed.py`` measures it; the per-tensor cost of a
whole save and load: docs/benchmarks.md, "Scale").

:class:`ItemCodec` produces and parses the same archives without going through pickle for every
item. For each (dtype, shape) it asks ``torch.save`` once for the archive of a zero tensor (the
*template*); an item is then the template with the tensor's bytes in the storage record and that
record's CRC-32 rewritten in the two places a zip file keeps it. Nothing is assumed about torch's
layout that is not checked: a template is used only after an item built from it has been loaded back
by ``torch.load`` bit for bit; a saved item is decoded directly only when everything before its
storage record (including the pickled tensor description, ``data.pkl``) equals the template byte for
byte and the record's CRC-32 matches; anything else (large tensors, views with offsets, complex or
quantized tensors, archives from other writers or torch versions) goes through ``torch.save`` /
``torch.load`` as before. Those larger items are written by torch's own zip writer with its
per-record CRC-32 switched off (:func:`uc_checkpoint.dcp.compat.save_without_zip_crc`): torch.load
never checks it, our manifest's block CRC-32s cover every byte, and computing it over every tensor
byte costs CPU for nothing. The output stays a valid ``torch.save`` archive that DCP's
``FileSystemReader`` loads.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import mmap
import struct
import zipfile
from dataclasses import dataclass
from typing import IO, Any, NamedTuple, cast

import torch

from uc_checkpoint.dcp.compat import save_without_zip_crc
from uc_checkpoint.errors import ItemChecksumError
from uc_checkpoint.format.integrity import crc32

logger = logging.getLogger(__name__)

#: Tensors up to this many bytes take the template path; above it the per-item cost of torch.save
#: is small next to copying the data, and torch's own writer handles alignment and ZIP64.
MAX_FAST_BYTES = 256 << 10
#: Templates and heads kept per process, each for one (dtype, shape): a few hundred bytes each
#: (the archive around the tensor, not the tensor). Every save and load of a job asks for the same
#: ones, and building one takes a torch.save and a torch.load.
CACHED_LAYOUTS = 4096


@dataclass(frozen=True)
class _Template:
    """torch.save's archive of a tensor of one dtype and shape, but for its tensor bytes: an item is
    ``head + <tensor bytes> + tail`` with the tensor bytes' CRC-32 at ``crc_offsets``."""

    head: bytes  # everything before the storage record
    nbytes: int  # the storage record (the tensor's bytes)
    tail: bytes  # everything after it
    crc_offsets: tuple[int, ...]  # the storage record's CRC-32 fields, the central directory's first

    @property
    def data_start(self) -> int:
        return len(self.head)

    @property
    def data_end(self) -> int:
        return len(self.head) + self.nbytes

    @property
    def size(self) -> int:
        """Bytes of an item built from this template."""
        return self.data_end + len(self.tail)

    def matches(self, view: memoryview) -> bool:
        """Whether the item archive ``view`` is this template's shape: its length, and every byte
        before the tensor's (the pickled tensor description included)."""
        return len(view) == self.size and view[: self.data_start] == self.head


class _Record(NamedTuple):
    """One record of a zip archive, and where its bytes and CRC-32 fields lie (offsets into it)."""

    info: zipfile.ZipInfo  # its central-directory entry as zipfile read it: name, sizes, compression
    start: int  # its bytes are [start, start + info.compress_size)
    local_crc: int  # the CRC-32 field of its local header
    descriptor_crc: int | None  # that of the data descriptor after its bytes, if it has one
    central_crc: int  # that of its central-directory entry


#: General-purpose flag bit 3: the record's CRC-32 and sizes follow its bytes, in a data descriptor.
_HAS_DESCRIPTOR = 0x08


def _layout_of(raw: Any) -> list[_Record] | None:
    """The records of the zip archive ``raw`` (bytes, or an mmap read in place), in the central
    directory's order; None when ``zipfile`` cannot read it, when it is a ZIP64 archive (4 GiB or
    more: never templated, so left to ``torch.load``), or when a record's headers are not where the
    central directory says."""
    if len(raw) >= 0xFFFFFFFF:
        return None
    try:
        # An mmap is read in place: it has the seek, tell and read zipfile needs.
        stream = cast(IO[bytes], raw) if isinstance(raw, mmap.mmap) else io.BytesIO(raw)
        with zipfile.ZipFile(stream) as archive:
            infos, central = archive.infolist(), archive.start_dir
    except (zipfile.BadZipFile, NotImplementedError, ValueError):
        return None
    records = []
    for info in infos:
        local = info.header_offset
        if (
            raw[central : central + 4] != b"PK\x01\x02"
            or raw[local : local + 4] != b"PK\x03\x04"
            or max(central + 46, local + 30) > len(raw)
            or struct.unpack_from("<I", raw, central + 16)[0] != info.CRC
        ):
            return None
        # The local header's name and extra field can differ in length from the central entry's.
        name_len, extra_len = struct.unpack_from("<HH", raw, local + 26)
        start = local + 30 + name_len + extra_len
        descriptor = None
        if info.flag_bits & _HAS_DESCRIPTOR:
            end = start + info.compress_size
            descriptor = end + 4 if raw[end : end + 4] == b"PK\x07\x08" else end  # its signature is optional
            if descriptor + 4 > len(raw):
                return None
        records.append(_Record(info, start, local + 14, descriptor, central + 16))
        # The next entry follows this one's name, extra field and comment.
        central += 46 + sum(struct.unpack_from("<HHH", raw, central + 28))
    return records


def _storage_record(records: list[_Record], nbytes: int) -> _Record | None:
    """The one storage record (``<archive>/data/0``) of a single-tensor torch.save archive whose
    tensor has ``nbytes`` bytes; None when there is another storage (not a plain tensor) or the
    record is missing, repeated, compressed or of another size (then the archive is not templated)."""
    found = None
    for record in records:
        info, name = record.info, record.info.orig_filename
        if name.endswith("/data/0"):
            stored = info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size == nbytes
            if found is not None or not stored:
                return None
            found = record
        elif "/data/" in name and not name.endswith("/.data/serialization_id"):
            return None
    return found


@dataclass(frozen=True)
class _Head:
    """What precedes the storage record in a single-tensor archive of one dtype and shape: enough
    to recognise such an archive and find its tensor bytes (the record itself is not kept)."""

    raw: bytes  # the archive's bytes before its storage record
    data_end: int  # the storage record is raw-length .. data_end
    crc_offsets: tuple[int, ...]  # CRC-32 fields inside ``raw`` (they differ between writers)

    def matches(self, view: memoryview) -> bool:
        start = len(self.raw)
        if len(view) < self.data_end:
            return False
        if not self.crc_offsets:
            return view[:start] == self.raw
        # Compare around the CRC fields: stock torch.save records a CRC-32 there, we write 0.
        pos = 0
        for at in self.crc_offsets:
            if view[pos:at] != self.raw[pos:at]:
                return False
            pos = at + 4
        return view[pos:start] == self.raw[pos:start]


class _SparseSink:
    """A write-only stream that keeps what is written and where, and lets ``seek`` skip bytes
    (torch's ``skip_data`` seeks over each storage record)."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, bytes]] = []
        self.pos = 0
        self.size = 0

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.parts.append((self.pos, chunk))
        self.pos += len(chunk)
        self.size = max(self.size, self.pos)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset + (self.pos if whence == io.SEEK_CUR else self.size if whence == io.SEEK_END else 0)
        self.size = max(self.size, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def _plain_target(t: torch.Tensor) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_quantized
        and not t.is_complex()
        and not t.is_conj()
        and not t.is_neg()
    )


def _fast_eligible(t: torch.Tensor) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_complex()
        and not t.is_conj()
        and not t.is_neg()
        and 0 < t.numel() * t.element_size() <= MAX_FAST_BYTES
    )


def _fill(template: _Template, t: torch.Tensor) -> bytearray:
    """The item archive of ``t`` (a plain contiguous CPU tensor of the template's dtype and shape)."""
    out = bytearray(template.size)
    data = _raw_bytes(t)
    start, end = template.data_start, template.data_end
    out[:start] = template.head
    out[start:end] = data
    out[end:] = template.tail
    crc = crc32(data)
    for offset in template.crc_offsets:
        struct.pack_into("<I", out, offset, crc)
    return out


@functools.lru_cache(maxsize=CACHED_LAYOUTS)
def _template_for(dtype: torch.dtype, shape: tuple[int, ...]) -> _Template | None:
    """The template of a ``dtype`` tensor of ``shape``, or None where the fast path must not be used."""
    zero = torch.zeros(shape, dtype=dtype)
    nbytes = zero.numel() * zero.element_size()
    buf = io.BytesIO()
    torch.save(zero, buf)
    raw = buf.getvalue()
    records = _layout_of(raw)
    record = None if records is None else _storage_record(records, nbytes)
    if record is None:
        logger.debug("no fast item template for %s %s: unexpected archive layout", dtype, shape)
        return None
    start, end = record.start, record.start + nbytes
    # The CRC-32 in the central directory, and in the data descriptor if there is one (then the
    # local header's is not used) or else in the local header.
    after = record.descriptor_crc if record.descriptor_crc is not None else record.local_crc
    template = _Template(raw[:start], nbytes, raw[end:], (record.central_crc, after))
    # Trust the template only once torch.load reads back, bit for bit, an item built from it.
    # Bytes that differ from their neighbours (0/1 for bool, whose other byte values are not
    # booleans), built in uint8 so a probe costs no more memory than the tensor.
    period = 2 if dtype == torch.bool else 251
    probe = torch.arange(period, dtype=torch.uint8).repeat(-(-nbytes // period))[:nbytes]
    sample = probe.view(dtype).reshape(shape)
    try:
        back = torch.load(io.BytesIO(_fill(template, sample)), map_location="cpu", weights_only=True)
        ok = (
            type(back) is torch.Tensor
            and back.dtype == dtype
            and tuple(back.shape) == shape
            and bytes(_raw_bytes(back.contiguous())) == bytes(_raw_bytes(sample))
        )
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this template
        logger.debug("no fast item template for %s %s: %s", dtype, shape, exc)
        return None
    return template if ok else None


@functools.lru_cache(maxsize=CACHED_LAYOUTS)
def _head_for(dtype: torch.dtype, shape: tuple[int, ...]) -> _Head | None:
    """What precedes the storage record in the archive of a ``dtype`` tensor of ``shape``, or None
    where it cannot be found that way."""
    sample = torch.empty(shape, dtype=dtype)  # never written: its bytes are not part of a head
    nbytes = sample.numel() * sample.element_size()
    sink = _SparseSink()
    try:
        # torch's skip_data (2.6+) seeks over the storage record instead of writing it.
        from torch.serialization import skip_data

        with skip_data():
            save_without_zip_crc(sample, sink)
    except (ImportError, RuntimeError, TypeError) as exc:
        logger.debug("no fast item head for %s %s: %s", dtype, shape, exc)
        return None
    # The archive laid out in lazily zeroed memory: only its header and directory pages are
    # touched, the storage record in between never is.
    with mmap.mmap(-1, max(sink.size, 1)) as raw:
        for pos, part in sink.parts:
            raw[pos : pos + len(part)] = part
        records = _layout_of(raw)
        record = None if records is None else _storage_record(records, nbytes)
        if records is None or record is None:
            logger.debug("no fast item head for %s %s: unexpected archive layout", dtype, shape)
            return None
        start = record.start
        # Every CRC-32 field before the tensor bytes: torch's writer leaves them 0 when it skips
        # CRCs, other writers fill them, so a head is compared around them.
        fields = (at for r in records for at in (r.local_crc, r.descriptor_crc) if at is not None and at + 4 <= start)
        return _Head(raw[:start], start + nbytes, tuple(sorted(fields)))


class ItemCodec:
    """Encodes tensor items as ``torch.save`` archives and decodes them, fast for small tensors.

    One codec per save or load (thread-safe; the counters are approximate under threads). The
    templates and heads it uses are built on first use and kept for the process (at most
    :data:`CACHED_LAYOUTS` of each, least recently used dropped first): they depend only on the
    dtype, the shape and torch. Source of the idea: a zip archive's stored (uncompressed) records
    can be patched in place when their length does not change, as long as the CRC-32 fields follow.
    """

    def __init__(self) -> None:
        #: Tensor items written, and how many of them through a template; items decoded fast.
        self.encoded = 0
        self.fast_encoded = 0
        self.fast_decoded = 0

    # ---- encoding ---------------------------------------------------------------------------
    def write(self, t: torch.Tensor, stream: Any) -> None:
        """Write ``t`` to ``stream`` as one ``torch.save`` archive (what DCP's writer stores per
        tensor item). ``t`` must be on the CPU."""
        self.encoded += 1
        if _fast_eligible(t):
            plain = t.detach().contiguous()  # a view's values; its storage offset does not matter
            template = _template_for(plain.dtype, tuple(plain.shape))
            if template is not None:
                stream.write(_fill(template, plain))
                self.fast_encoded += 1
                return
        save_without_zip_crc(t, stream)

    # ---- decoding ---------------------------------------------------------------------------
    def decode_into(self, data: memoryview | bytes, target: torch.Tensor) -> bool:
        """Copy the tensor of the item archive ``data`` straight into ``target`` (one copy, where
        ``torch.load`` and ``copy_`` make two and allocate a tensor in between). True when done;
        False when ``target`` is not a plain contiguous CPU tensor or ``data`` is not the archive
        ``torch.save`` makes of a tensor of ``target``'s dtype and shape, byte for byte up to its
        tensor bytes (then nothing was written: use :meth:`decode` or ``torch.load``).

        The archive's own CRC-32 is not checked here; callers use this only where the manifest's
        block checksums already covered ``data``.
        """
        if not _plain_target(target):
            return False
        nbytes = target.numel() * target.element_size()
        view = memoryview(data).cast("B")
        if nbytes <= MAX_FAST_BYTES:
            # A small tensor through its template: a memcpy into the target, where decode and
            # copy_ allocate a tensor and run torch's copy (OpenMP threads that wait for a busy core).
            template = _template_for(target.dtype, tuple(target.shape)) if nbytes else None
            if template is None or not template.matches(view):
                return False
            _raw_bytes(target)[:] = view[template.data_start : template.data_end]
        else:
            head = _head_for(target.dtype, tuple(target.shape))
            if head is None or not head.matches(view):
                return False
            _raw_bytes(target)[:] = view[len(head.raw) : head.data_end]
        self.fast_decoded += 1
        return True

    def tensor_span(self, target: torch.Tensor) -> tuple[int, int, memoryview] | None:
        """Where the tensor's bytes lie in the item archive of a tensor of ``target``'s dtype and
        shape, as :meth:`decode_into` reads it: ``(start, end, into)`` with ``[start, end)`` byte
        offsets in the archive and ``into`` the bytes of ``target`` (a writable view of its memory),
        so that a reader can receive those bytes straight into the tensor. None where
        :meth:`decode_into` would not apply (same conditions). Check the archive's other bytes
        with :meth:`received_into` once they have arrived."""
        if not _plain_target(target) or target.numel() * target.element_size() <= MAX_FAST_BYTES:
            return None
        head = _head_for(target.dtype, tuple(target.shape))
        if head is None:
            return None
        return len(head.raw), head.data_end, _raw_bytes(target)

    def received_into(self, data: memoryview | bytes, target: torch.Tensor) -> bool:
        """Whether ``data``, an item archive whose tensor bytes (:meth:`tensor_span`) were received
        straight into ``target``, is the archive of such a tensor: its bytes before them match, as
        :meth:`decode_into` requires (the bytes at the tensor's span in ``data`` are not looked at).
        True: ``target`` holds the item. False: it does not (reassemble the archive and decode)."""
        head = _head_for(target.dtype, tuple(target.shape))
        if head is None or not head.matches(memoryview(data).cast("B")):
            return False
        self.fast_decoded += 1
        return True

    def decode(self, data: memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The tensor in one item archive ``data`` that should hold a ``dtype`` tensor of ``shape``
        (the chunk's saved shape), as a new tensor that does not share ``data``'s memory; None when
        the archive is not one the fast path reads (then ``torch.load`` it).

        Raises:
            ItemChecksumError: the archive matches the template but its tensor bytes fail the CRC-32
                the archive records for them.
        """
        view = memoryview(data).cast("B")
        nbytes = math.prod(shape) * dtype.itemsize
        if 0 < nbytes <= MAX_FAST_BYTES and not dtype.is_complex:
            template = _template_for(dtype, shape)
            if template is not None and template.matches(view):
                recorded = struct.unpack_from("<I", view, template.crc_offsets[0])[0]
                if recorded == 0:  # written with torch's crc32 computation switched off: let torch read it
                    return None
                actual = crc32(view[template.data_start : template.data_end])
                if recorded != actual:
                    raise ItemChecksumError(f"tensor bytes fail their crc32: {actual:08x}, recorded {recorded:08x}")
                out = torch.empty(shape, dtype=dtype)  # aligned, and independent of the read buffer
                _raw_bytes(out)[:] = view[template.data_start : template.data_end]
                self.fast_decoded += 1
                return out
        return None
