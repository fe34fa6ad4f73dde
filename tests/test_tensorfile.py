"""autotp's safetensors reader and writer against the safetensors package."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import autotp.weights.tensorfile as tf
from autotp.errors import ConfigError
from autotp.layout import Shard, shard_tensor
from autotp.weights.materialize import slice_ranges

TENSORS = {
    "matrix": torch.randn(37, 130),
    "cube": torch.randn(6, 12, 7).to(torch.bfloat16),
    "ints": torch.arange(10),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
    "flags": torch.tensor([True, False, True]),
}


@pytest.fixture()
def path(tmp_path: Path) -> Path:
    save_file(TENSORS, str(tmp_path / "x.safetensors"))
    return tmp_path / "x.safetensors"


@pytest.mark.parametrize("run_direct,block", [(64 * 2**10, 16 * 2**20), (8, 100), (2**30, 64)])
def test_slices_equal_narrow(path: Path, monkeypatch: pytest.MonkeyPatch, run_direct: int,
                             block: int) -> None:
    """Contiguous, long strided and short strided runs (through a small staging buffer)."""
    monkeypatch.setattr(tf, "RUN_DIRECT", run_direct)
    monkeypatch.setattr(tf, "BLOCK_BYTES", block)
    with tf.SafetensorsFile(path) as file:
        for name, tensor in TENSORS.items():
            assert torch.equal(file.read(name), tensor), name
            for dim in range(tensor.dim()):
                size = tensor.shape[dim]
                for start, stop in [(0, size), (size // 3, size - size // 4), (size, size)]:
                    got = file.read_range(name, dim, start, stop)
                    assert torch.equal(got, tensor.narrow(dim, start, stop - start)), \
                        (name, dim, start, stop)


@pytest.mark.parametrize("layout", [Shard(0), Shard(1), Shard(1, 2)])
def test_slice_ranges_are_shard_tensor(path: Path, layout: Shard) -> None:
    full = TENSORS["cube"].float()
    with tf.SafetensorsFile(path) as file:
        for rank in range(2):
            parts = [file.read_range("cube", layout.dim, a, b)
                     for a, b in slice_ranges(full.shape[layout.dim], layout, rank, 2)]
            got = torch.cat(parts, dim=layout.dim).float()
            assert torch.equal(got, shard_tensor(full, layout, rank, 2))


def test_written_files_load_in_safetensors(tmp_path: Path) -> None:
    specs = [tf.Spec(k, v.dtype, tuple(v.shape)) for k, v in TENSORS.items()]
    groups = tf.plan_files(specs, 600)
    assert len(groups) > 1 and [s for g in groups for s in g] == specs
    for i, group in enumerate(groups):
        tf.write_file(tmp_path / f"{i}.safetensors", group, lambda s: TENSORS[s.name])
    back: dict[str, torch.Tensor] = {}
    for i in range(len(groups)):
        back.update(load_file(str(tmp_path / f"{i}.safetensors")))
    assert back.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert torch.equal(back[name], tensor), name


def test_bad_files_are_clear_errors(tmp_path: Path, path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="not a safetensors file"):
        tf.SafetensorsFile(tmp_path / "junk.safetensors")
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(ConfigError, match="truncated"):
        tf.SafetensorsFile(tmp_path / "cut.safetensors")
    with pytest.raises(ConfigError, match="does not exist"):
        tf.TensorFiles(tmp_path / "missing")
    assert tf.parse_bytes("5GB") == 5 * 10**9 and tf.parse_bytes("2MiB") == 2 * 2**20
    with pytest.raises(ConfigError, match="max_shard_size"):
        tf.parse_bytes("lots")
