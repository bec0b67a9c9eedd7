"""PartChecksums: which UploadPart requests get a part CRC-32 from the staged file's digest, and
which are left to botocore."""

from __future__ import annotations

import base64
import threading
from typing import Any

from uc_checkpoint.volumes.s3_client import PartChecksums

PARTS = [(0x11111111, 10), (0x22222222, 10), (0x33333333, 3)]


def _params(number: int, length: int, **kw: Any) -> dict[str, Any]:
    return {"Bucket": "b", "Key": "k", "PartNumber": number, "Body": b"x" * length, "ChecksumAlgorithm": "CRC32", **kw}


def _crc(params: dict[str, Any]) -> int | None:
    sent = params.get("ChecksumCRC32")
    return None if sent is None else int.from_bytes(base64.b64decode(sent), "big")


def test_each_announced_part_gets_its_own_crc_and_only_while_announced() -> None:
    registry = PartChecksums()
    with registry.announced("b", "k", PARTS):
        got = []
        for number, (_, length) in enumerate(PARTS, 1):
            params = _params(number, length)
            registry.on_upload_part(params)
            got.append(_crc(params))
        assert got == [crc for crc, _ in PARTS]
    after = _params(1, 10)
    registry.on_upload_part(after)
    assert "ChecksumCRC32" not in after


def test_parts_it_cannot_vouch_for_are_left_to_botocore() -> None:
    registry = PartChecksums()
    with registry.announced("b", "k", PARTS):
        for params in (
            _params(1, 9),  # another length than announced: other part boundaries
            _params(4, 3),  # a part number past the announced ones
            _params(0, 10),
            {**_params(1, 10), "Key": "other"},
            {**_params(1, 10), "Bucket": "other"},
            {k: v for k, v in _params(1, 10).items() if k != "ChecksumAlgorithm"},  # no CRC-32 asked for
            _params(1, 10, ChecksumAlgorithm="SHA256"),
            {k: v for k, v in _params(1, 10).items() if k != "Body"},
        ):
            registry.on_upload_part(params)
            assert "ChecksumCRC32" not in params, params
        given = _params(1, 10, ChecksumCRC32="AAAAAA==")  # the caller's own is kept
        registry.on_upload_part(given)
        assert given["ChecksumCRC32"] == "AAAAAA=="


def test_two_uploads_of_one_key_at_once_give_no_crc_and_either_ending_keeps_the_other() -> None:
    registry = PartChecksums()
    other = [(0x44444444, 10)]
    first = registry.announced("b", "k", PARTS)
    first.__enter__()
    with registry.announced("b", "k", other):
        params = _params(1, 10)
        registry.on_upload_part(params)
        assert "ChecksumCRC32" not in params  # which upload's part this is cannot be told
        first.__exit__(None, None, None)
        params = _params(1, 10)
        registry.on_upload_part(params)
        assert _crc(params) == 0x44444444
    params = _params(1, 10)
    registry.on_upload_part(params)
    assert "ChecksumCRC32" not in params


def test_announcements_from_many_threads_leave_nothing_behind() -> None:
    registry = PartChecksums()

    def work(i: int) -> None:
        for _ in range(200):
            with registry.announced("b", f"k{i % 3}", PARTS):
                registry.on_upload_part({**_params(1, 10), "Key": f"k{i % 3}"})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in ("k0", "k1", "k2"):
        params = {**_params(1, 10), "Key": key}
        registry.on_upload_part(params)
        assert "ChecksumCRC32" not in params
