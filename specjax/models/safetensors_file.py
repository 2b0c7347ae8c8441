"""Hugging Face checkpoints' safetensors shards, read one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype,
shape, data_offsets: [begin, end]}} plus an optional "__metadata__"), then the tensors'
bytes, offsets counted from the end of the header. A sharded checkpoint adds
`model.safetensors.index.json`, whose "weight_map" names each tensor's shard.

Each tensor is read with one positioned read into a buffer of its own: the process holds
at most the tensor being converted, never a mapping of the whole shard (touched pages of
a memory map count in the process's resident memory until it is closed, and a 70B
model's shards are 5 GB each). bfloat16 comes out as `ml_dtypes.bfloat16`, which numpy
and jax both take, so no framework is needed to read a checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from specjax.errors import SpecjaxError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def write(path: str | Path, layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
          tensor: Callable[[str], np.ndarray]) -> None:
  """A safetensors file of the tensors `layout` names ({name: (shape, dtype)}), each made
  by `tensor(name)` only when its turn comes, so a file larger than memory can be written
  (the load benchmark's checkpoints)."""
  header, at = {}, 0
  for name, (shape, dtype) in layout.items():
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [at, at + n]}
    at += n
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, (shape, dtype) in layout.items():
      a = np.ascontiguousarray(tensor(name), dtype)
      if a.shape != tuple(shape):
        raise ValueError(f"tensor {name} is {a.shape}, the layout says {tuple(shape)}")
      f.write(a.tobytes())


class CheckpointFolderError(SpecjaxError, ValueError):
  """A checkpoint folder whose safetensors files are missing, damaged or inconsistent."""


class SafetensorsFile:
  """The tensor index of one safetensors file (`names`, `shape`, `dtype`); `read(name)`
  returns that tensor as a numpy array of its own."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    try:
      size = self.path.stat().st_size
      with self.path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if not 2 <= n <= min(_MAX_HEADER, size - 8):
          raise ValueError(f"a header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as err:
      raise CheckpointFolderError(f"{self.path} is not a readable safetensors file ({err})") from None
    self._start = 8 + n
    header.pop("__metadata__", None)
    self._entries = {}
    for name, e in header.items():
      begin, end = e["data_offsets"]
      dtype = _DTYPES.get(e["dtype"])
      if dtype is None:
        raise CheckpointFolderError(f"{self.path}: tensor {name} has dtype {e['dtype']}, not one "
                              f"of {', '.join(_DTYPES)}")
      shape = tuple(int(d) for d in e["shape"])
      if end - begin != int(np.prod(shape)) * np.dtype(dtype).itemsize or \
          self._start + end > size:
        raise CheckpointFolderError(f"{self.path}: tensor {name}'s bytes [{begin}, {end}) do not "
                              f"hold shape {shape} of {e['dtype']} inside the file (truncated "
                              f"or damaged: download it again)")
      self._entries[name] = (np.dtype(dtype), shape, begin)

  @property
  def names(self) -> list[str]:
    return list(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name][1]

  def dtype(self, name: str) -> np.dtype:
    return self._entries[name][0]

  def read(self, name: str) -> np.ndarray:
    dtype, shape, begin = self._entries[name]
    out = np.empty(shape, dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with self.path.open("rb", buffering=0) as f:
      fd, at, done = f.fileno(), self._start + begin, 0
      while done < len(view):
        got = os.preadv(fd, [view[done:]], at + done)
        if got <= 0:
          raise CheckpointFolderError(f"{self.path}: tensor {name} ends past the file")
        done += got
    return out


class Checkpoint:
  """Every tensor of a checkpoint folder, by name, over its shards: the index's weight
  map when there is one (each listed shard must be there), else `model.safetensors` or
  the folder's one set of `*.safetensors` files."""

  def __init__(self, folder: str | Path):
    self.folder = Path(folder)
    index = self.folder / INDEX
    if index.exists():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (ValueError, KeyError) as err:
        raise CheckpointFolderError(f"{index} is not a safetensors index ({err})") from None
      shards = sorted(set(weight_map.values()))
      missing = [s for s in shards if not (self.folder / s).is_file()]
      if missing:
        raise CheckpointFolderError(
            f"{self.folder}: shard {missing[0]} (of {len(shards)} the index lists) is missing"
            f"{f' with {len(missing) - 1} more' if len(missing) > 1 else ''}: download the "
            f"checkpoint again (a hub id fetches what is missing)")
    else:
      files = [self.folder / SINGLE] if (self.folder / SINGLE).is_file() else sorted(
          self.folder.glob("*.safetensors"))
      if not files:
        bins = sorted(p.name for p in self.folder.glob("*.bin"))
        raise CheckpointFolderError(
            f"{self.folder} holds no safetensors weights"
            + (f" (only PyTorch pickles: {', '.join(bins[:2])}; save them as safetensors "
               f"with transformers' save_pretrained)" if bins else ""))
      shards, weight_map = [f.name for f in files], None
    self.files = {s: SafetensorsFile(self.folder / s) for s in shards}
    self._where = {}
    for shard, f in self.files.items():
      for name in f.names:
        if weight_map is None or weight_map.get(name) == shard:
          self._where[name] = f
    if weight_map is not None:
      lost = sorted(n for n in weight_map if n not in self._where)
      if lost:
        raise CheckpointFolderError(f"{self.folder}: tensor {lost[0]} is not in {weight_map[lost[0]]}"
                              f", where the index puts it (a shard of another checkpoint?)")

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> Iterator[str]:
    return iter(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._file(name).shape(name)

  def read(self, name: str) -> np.ndarray:
    return self._file(name).read(name)

  @property
  def nbytes(self) -> int:
    return sum(f.path.stat().st_size for f in self.files.values())

  def _file(self, name: str) -> SafetensorsFile:
    if name not in self._where:
      raise CheckpointFolderError(f"{self.folder}: no tensor {name} in the checkpoint")
    return self._where[name]
