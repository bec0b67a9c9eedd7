"""Helpers for tests of DCP's stream extensions (compression, user transforms) on our writer and
reader: the extensions under test, and a resharded partial read driven through a reader's hooks."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

__all__ = ["EXTENSION_CASES", "FailingOnRead", "Rot13Example", "ZStandard", "partial_read", "registry"]


class FailingOnRead(StreamTransformExtension):
    """Stores items as they are; reading them back raises (a transform whose stored bytes are
    damaged, e.g. a decompressor's error)."""

    @staticmethod
    def registry_name() -> str:
        return "stream.test-failing"

    @staticmethod
    def from_descriptor(version: str) -> FailingOnRead:
        return FailingOnRead()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: Any) -> Any:
        return output

    def transform_from(self, input: Any) -> Any:  # noqa: A002 - DCP's parameter name
        class Broken(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                raise OSError("bad frame")

        return Broken()


def registry() -> ExtensionRegistry:
    """DCP's default registry (ZStandard) plus the test extensions."""
    out = ExtensionRegistry()
    out.register(Rot13Example)
    out.register(FailingOnRead)
    return out


#: id -> factory of a writer's ``_extensions``: compression, a user transform.
EXTENSION_CASES = {
    "zstd": lambda: [ZStandard()],
    "rot13": lambda: [Rot13Example()],
}


class _Planner:
    """The planner hooks a reader calls, filling one target tensor (a local chunk)."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.committed = 0

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        out = self.target
        for dim, (start, length) in enumerate(zip(req.dest_offsets, req.lengths)):
            out = out.narrow(dim, start, length)
        return out

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed += 1

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:  # pragma: no cover - tensors only
        raise AssertionError("no bytes items in a partial tensor read")


def partial_read(reader: StorageReader, fqn: str, rows: tuple[int, int]) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the saved 2-d tensor ``fqn``, read as DCP would read a smaller local
    chunk of a resharded load (``create_read_items_for_chunk_list``), through ``reader``'s hooks."""
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    md = metadata.state_dict_metadata[fqn]
    assert isinstance(md, TensorStorageMetadata)
    lo, hi = rows
    cols = md.size[1]
    chunk = ChunkStorageMetadata(offsets=torch.Size([lo, 0]), sizes=torch.Size([hi - lo, cols]))
    items = create_read_items_for_chunk_list(fqn, md, [chunk])
    assert items and all(any(item.storage_offsets) or item.lengths[0] < md.size[0] for item in items)
    planner = _Planner(torch.full((hi - lo, cols), -1.0, dtype=md.properties.dtype))
    plan = LoadPlan(items)
    plan = reader.prepare_global_plan([reader.prepare_local_plan(plan)])[0]
    reader.read_data(plan, planner).wait()  # type: ignore[arg-type]
    assert planner.committed == len(items)
    return planner.target
