"""``uc-checkpoint export`` and ``export_checkpoint`` on a real checkpoint saved by 2 ranks under
torchrun with FSDP2 (every tensor in chunks over both ranks' files, some of uneven size): outputs
read with the formats' own loaders (``safetensors.torch.load_file``, index-based loading as
``transformers`` does it, ``torch.load``) equal DCP's stock load of the same checkpoint tensor by
tensor; to a local path and to S3 (moto server); ``--dtype``, ``--key``, ``--strip-prefix``; a
SIGKILLed export publishes nothing a loader takes and a rerun succeeds; an existing export is
refused without ``--overwrite`` and replaced with it; one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.conftest import REPO, SCRIPTS, torchrun
from tests.support.s3_fixtures import s3_client
from uc_checkpoint import UCVolumeWriter, export_checkpoint
from uc_checkpoint.errors import CheckpointExistsError, CheckpointNotFoundError, VolumeError
from uc_checkpoint.ops.export import parse_size, plan_export

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoint (``path``), DCP's stock load of all its tensors (``reference``: flattened
    key -> full tensor) and rank 0's gathered full model state (``full``)."""
    root = tmp_path_factory.mktemp("export")
    path, full_path = root / "ckpt", root / "full.pt"
    proc = torchrun(SCRIPTS / "export_fsdp_save.py", str(path), str(full_path), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    metadata = FileSystemReader(path).read_metadata()
    tensors = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    # Reassembly is real: every model tensor is stored as chunks from both ranks.
    assert all(len(md.chunks) == 2 for k, md in tensors.items() if k.startswith("model."))
    reference = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in tensors.items()}
    dcp.load(reference, storage_reader=FileSystemReader(path), no_dist=True)
    return {"path": path, "reference": reference, "full": torch.load(full_path, weights_only=True)}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("uc-checkpoint", path=str(Path(sys.executable).parent))
    assert exe
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def load_by_index(folder: Path, index_name: str) -> dict[str, torch.Tensor]:
    """Load a sharded export as ``transformers`` does: read the index, load each shard it names,
    check every name came from the shard the index says."""
    index = json.loads((folder / index_name).read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        if shard.endswith(".safetensors"):
            part = load_file(folder / shard)
        else:
            part = torch.load(folder / shard, weights_only=True)
        assert {index["weight_map"][n] for n in part} == {shard}
        out.update(part)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def assert_tensors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def model_reference(saved: dict, prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in saved["reference"].items() if k.startswith(prefix)}


def test_sharded_safetensors_with_key(saved: dict, tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "out"
    proc = cli("export", str(saved["path"]), str(dest), "--format", "safetensors", "--key", "model",
               "--max-shard-size", "4KiB", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    files = sorted(p.name for p in dest.iterdir())
    assert summary["entry"] == "model.safetensors.index.json" and files == sorted(summary["files"])
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and all(f"-of-{len(shards):05d}-{summary['export_id']}." in f for f in shards)
    assert summary["tensors"] == len(model_reference(saved)) and summary["skipped"] == []
    assert summary["dtype"] is None and summary["dtypes"] == {"float32": summary["tensors"]}
    exported = load_by_index(dest, "model.safetensors.index.json")
    assert_tensors_equal(exported, model_reference(saved))
    assert_tensors_equal(exported, saved["full"])  # the gathered model, an independent reference
    # Each shard is a complete safetensors file of its own, within the size asked for unless it
    # holds one larger tensor.
    for shard in shards:
        part = load_file(dest / shard)
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 4096
    assert not [p for p in staging.rglob("*") if p.is_file()]


def test_single_files_of_the_whole_checkpoint(saved: dict, tmp_path: Path, staging: Path) -> None:
    """No --key: every tensor (model, optimizer state, the ddp copy) in one file; the non-tensor
    items are skipped and listed."""
    st = export_checkpoint(saved["path"], tmp_path / "st", format="safetensors")
    assert st.files == ["model.safetensors"] and [p.name for p in (tmp_path / "st").iterdir()] == ["model.safetensors"]
    assert_tensors_equal(load_file(tmp_path / "st" / "model.safetensors"), saved["reference"])
    assert "step" in st.skipped and "note" in st.skipped and any(k.startswith("optim.param_groups") for k in st.skipped)
    seen: list[tuple[int, int]] = []
    pt = export_checkpoint(saved["path"], tmp_path / "pt", format="torch", progress=lambda d, t: seen.append((d, t)))
    assert pt.entry == "pytorch_model.bin" and seen[-1] == (pt.tensor_bytes, pt.tensor_bytes)
    assert_tensors_equal(torch.load(tmp_path / "pt" / "pytorch_model.bin", weights_only=True), saved["reference"])


def test_sharded_torch_format(saved: dict, tmp_path: Path, staging: Path) -> None:
    summary = export_checkpoint(saved["path"], tmp_path / "pt", format="torch", key="optim", max_shard_bytes=8192)
    assert summary.entry == "pytorch_model.bin.index.json" and len(summary.files) > 3
    assert_tensors_equal(
        load_by_index(tmp_path / "pt", "pytorch_model.bin.index.json"), model_reference(saved, "optim.")
    )


def test_dtype_key_and_strip_prefix(saved: dict, tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "bf16"
    proc = cli("export", str(saved["path"]), str(dest), "--format", "safetensors", "--key", "ddp",
               "--strip-prefix", "module.", "--dtype", "bfloat16", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["dtype"] == "bfloat16" and summary["dtypes"] == {"bfloat16": summary["tensors"]}
    want = {k: v.to(torch.bfloat16) for k, v in model_reference(saved).items()}
    assert_tensors_equal(load_file(dest / "model.safetensors"), want)
    # --dtype converts floating-point tensors only: integer tensors keep theirs.
    small = tmp_path / "small"
    dcp.save({"w": torch.randn(5, 3), "ids": torch.arange(9)}, storage_writer=UCVolumeWriter(small), no_dist=True)
    converted = export_checkpoint(small, tmp_path / "f16", format="torch", dtype=torch.float16)
    assert converted.dtypes == {"float16": 1, "int64": 1}
    got = torch.load(tmp_path / "f16" / "pytorch_model.bin", weights_only=True)
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], torch.arange(9))
    assert got["w"].dtype == torch.float16
    with pytest.raises(ValueError, match="int64"):
        plan_export(FileSystemReader(small).read_metadata(), dtype="int64")


def test_to_s3(saved: dict, tmp_path: Path, staging: Path, s3_server: str, s3_bucket: str) -> None:
    dest = f"s3://{s3_bucket}/serving/net"
    proc = cli("export", str(saved["path"]), dest, "--format", "safetensors", "--key", "model",
               "--max-shard-size", "8KiB", "--json", env={"AWS_ENDPOINT_URL": s3_server})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    client = s3_client(s3_server)
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="serving/net/")["Contents"]
    assert sorted(o["Key"].rsplit("/", 1)[1] for o in listed) == sorted(summary["files"])
    local = tmp_path / "download"
    local.mkdir()
    for name in summary["files"]:
        client.download_file(s3_bucket, f"serving/net/{name}", str(local / name))
    assert_tensors_equal(load_by_index(local, "model.safetensors.index.json"), model_reference(saved))
    # Again: refused without --overwrite, on S3 as locally.
    again = cli("export", str(saved["path"]), dest, "--format", "safetensors", env={"AWS_ENDPOINT_URL": s3_server})
    assert again.returncode == 2 and "model.safetensors.index.json exists" in again.stderr


def test_existing_export_refused_then_replaced(saved: dict, tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "config.json").write_text("{}")  # a file of the model's, left alone
    first = export_checkpoint(saved["path"], dest, format="safetensors", key="model", max_shard_bytes=4096)
    refused = cli("export", str(saved["path"]), str(dest), "--format", "safetensors", "--key", "model")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert f"{dest / 'model.safetensors.index.json'} exists" in refused.stderr and "--overwrite" in refused.stderr
    with pytest.raises(CheckpointExistsError):
        export_checkpoint(saved["path"], dest, format="safetensors", key="model")
    # Replaced by a sharded bf16 export: the old shards go once the new index is published.
    second = export_checkpoint(
        saved["path"], dest, format="safetensors", key="model", dtype="bfloat16", max_shard_bytes=8192, overwrite=True
    )
    assert second.replaced and set(second.removed) == set(first.files) - {first.entry}
    assert sorted(p.name for p in dest.iterdir()) == sorted([*second.files, "config.json"])
    want = {k: v.to(torch.bfloat16) for k, v in model_reference(saved).items()}
    assert_tensors_equal(load_by_index(dest, "model.safetensors.index.json"), want)
    # Replaced by a one-file export: model.safetensors appears, then the index and shards go.
    third = export_checkpoint(saved["path"], dest, format="safetensors", key="model", overwrite=True)
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert set(third.removed) == set(second.files)
    assert_tensors_equal(load_file(dest / "model.safetensors"), model_reference(saved))


def test_killed_export_publishes_nothing_and_a_rerun_succeeds(saved: dict, tmp_path: Path, staging: Path) -> None:
    """The export is SIGKILLed as soon as its first shard is on the volume (one tensor per shard,
    so dozens of shards remain): no index, no one-file name; the shards it left are not what any
    loader opens, and the next export publishes and removes them."""
    dest = tmp_path / "out"
    dest.mkdir()
    exe = shutil.which("uc-checkpoint", path=str(Path(sys.executable).parent))
    assert exe
    proc = subprocess.Popen(
        [exe, "export", str(saved["path"]), str(dest), "--format", "safetensors", "--max-shard-size", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(p.suffix == ".safetensors" for p in dest.iterdir()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in dest.iterdir())
    assert left and "model.safetensors.index.json" not in left and "model.safetensors" not in left
    total = int(next(n for n in left if n.endswith(".safetensors")).split("-of-")[1][:5])
    assert len(left) < total, left  # killed partway
    rerun = cli("export", str(saved["path"]), str(dest), "--format", "safetensors", "--key", "model", "--json")
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert set(summary["removed"]) == {n for n in left if n.endswith(".safetensors")}
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    assert_tensors_equal(load_file(dest / "model.safetensors"), model_reference(saved))


def test_one_line_errors(saved: dict, tmp_path: Path, staging: Path) -> None:
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    (empty / "__0_0.distcp").write_bytes(b"x")
    proc = cli("export", str(empty), str(tmp_path / "out"), "--format", "safetensors")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(empty) in proc.stderr and "uc-checkpoint export: error:" in proc.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointNotFoundError, match=str(empty)):
        export_checkpoint(empty, tmp_path / "out", format="torch")
    bad_key = cli("export", str(saved["path"]), str(tmp_path / "out"), "--format", "torch", "--key", "nope")
    assert bad_key.returncode == 2 and "'nope'" in bad_key.stderr and "'model'" in bad_key.stderr
    bad_size = cli("export", str(saved["path"]), str(tmp_path / "out"), "--format", "torch", "--max-shard-size", "2XB")
    assert bad_size.returncode == 2 and "'2XB'" in bad_size.stderr
    bad_dtype = cli("export", str(saved["path"]), str(tmp_path / "out"), "--format", "torch", "--dtype", "int8")
    assert bad_dtype.returncode == 2 and "'int8'" in bad_dtype.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    to_file = cli("export", str(saved["path"]), str(a_file), "--format", "torch")
    assert to_file.returncode == 2 and "export destination: " in to_file.stderr and str(a_file) in to_file.stderr
    inside = cli("export", str(saved["path"]), str(saved["path"] / "exported"), "--format", "torch")
    assert inside.returncode == 2 and "is inside the checkpoint" in inside.stderr, inside.stderr
    assert not (saved["path"] / "exported").exists()


def one_tensor_checkpoint(path: Path) -> None:
    """A checkpoint of one process: one tensor and one item that is not a tensor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process assumed
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "step": 7}, storage_writer=UCVolumeWriter(path))


def test_destination_reaching_the_checkpoint_through_a_symlink_is_refused(tmp_path: Path, staging: Path) -> None:
    """Whether a link leads into the checkpoint or the checkpoint lies under the destination, the
    export stops naming both locations and writes nothing; the checkpoint stays as it was."""
    run = tmp_path / "run"
    ckpt = run / "step_00000007"
    one_tensor_checkpoint(ckpt)
    before = sorted((p.name, p.stat().st_size) for p in ckpt.iterdir())
    (tmp_path / "to-ckpt").symlink_to(ckpt)
    (tmp_path / "to-run").symlink_to(run)
    cases = {
        tmp_path / "to-ckpt": "is inside the checkpoint",  # the checkpoint itself
        tmp_path / "to-ckpt" / "exported": "is inside the checkpoint",
        tmp_path / "to-run": "is inside the export destination",  # holds the checkpoint
    }
    for dest, refusal in cases.items():
        with pytest.raises(VolumeError, match=refusal) as refused:
            export_checkpoint(ckpt, dest, format="torch")
        assert str(dest) in str(refused.value) and f"real paths {os.path.realpath(dest)} and {ckpt}" in str(
            refused.value
        )
    dest = tmp_path / "to-ckpt" / "exported"
    proc = cli("export", str(ckpt), str(dest), "--format", "safetensors")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"export destination {dest} is inside the checkpoint {ckpt}" in proc.stderr, proc.stderr
    assert sorted((p.name, p.stat().st_size) for p in ckpt.iterdir()) == before
    assert sorted(p.name for p in run.iterdir()) == [ckpt.name]


def test_destination_reaching_the_checkpoint_through_a_bind_mount_is_refused(tmp_path: Path, staging: Path) -> None:
    """A second mount of the run's directory (``mount --bind``, as a FUSE or NFS path beside the
    local one would be) has real paths of its own: the device and inode numbers tell."""
    run = tmp_path / "run"
    ckpt = run / "step_00000007"
    one_tensor_checkpoint(ckpt)
    before = sorted((p.name, p.stat().st_size) for p in ckpt.iterdir())
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "--bind", str(run), str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {proc.stderr.strip()}")
    try:
        cases = {
            mnt / ckpt.name / "served": "is the checkpoint .* or inside it, reached through another mount",
            mnt / ckpt.name: "is the checkpoint .* or inside it, reached through another mount",
            mnt: "is inside the export destination .* reached through another mount",
        }
        for dest, refusal in cases.items():
            with pytest.raises(VolumeError, match=refusal):
                export_checkpoint(ckpt, dest, format="torch")
        assert sorted((p.name, p.stat().st_size) for p in ckpt.iterdir()) == before
        assert sorted(p.name for p in run.iterdir()) == [ckpt.name]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_summary_counts_in_the_singular(tmp_path: Path, staging: Path) -> None:
    ckpt = tmp_path / "ckpt"
    one_tensor_checkpoint(ckpt)
    proc = cli("export", str(ckpt), str(tmp_path / "out"), "--format", "safetensors")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("exported 1 tensor (48 B) to ") and " in 1 file: model.safetensors " in proc.stdout
    assert "not exported (1 item that is not a tensor): step" in proc.stdout, proc.stdout
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], torch.arange(12.0).reshape(3, 4))


def test_missing_safetensors_names_the_extra(saved: dict, tmp_path: Path) -> None:
    """Without the safetensors package (hidden from a fresh interpreter), a one-line error naming
    the extra to install."""
    code = (
        "import sys; sys.modules['safetensors'] = None; sys.modules['safetensors.torch'] = None\n"
        "from uc_checkpoint.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    args = [sys.executable, "-c", code, "export", str(saved["path"]), str(tmp_path / "o"), "--format", "safetensors"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "uc-checkpoint[export]" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("5GB") == 5 * 10**9 and parse_size("1.5KiB") == 1536
    assert parse_size("4096") == 4096 and parse_size(7) == 7
    for bad in ("", "GB", "-1MB", "0", "3 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)
