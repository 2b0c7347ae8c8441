"""The GGUF container, read directly: its metadata and views of its tensors over one mmap.

gguf-py's `GGUFReader` builds numpy views of every array element while it parses: over
Gemma 3's 262 144 vocabulary strings that was about 25 s of a first load (py-spy, two
cores), and the check of an assembled split file parsed Qwen's 151 665 again. Here the
header is walked with `struct`, numeric arrays come out of `np.frombuffer` whole, and the
tensors stay views of the file. gguf-py still dequantises them (`gguf.quants`).

Layout (GGUF v2 and v3, little-endian): magic, version u32, tensor count u64, metadata
count u64; metadata as (key, type u32, value); tensor infos as (name, n_dims u32,
dims u64 x n_dims innermost first, ggml type u32, offset u64); the data after the header,
aligned to `general.alignment` (32 by default).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Unquantised ggml types gguf-py hands over as typed values; the others as bytes per row.
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64}


class GGUFParseError(ValueError):
  """The bytes do not follow the GGUF layout."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  shape: tuple[int, ...]  # GGUF's order: innermost dimension first
  tensor_type: int  # a `gguf.GGMLQuantizationType` value
  data_offset: int  # from the start of the file
  n_bytes: int
  data: np.ndarray  # a view of the file: typed values, or each row's bytes when quantised


class GGUFFile:
  """`fields` (key -> str, number, bool or list) and `tensors` (`TensorInfo`s, in file
  order) of the GGUF file at `path`; raises `GGUFParseError` on a damaged layout."""

  def __init__(self, path: str | Path):
    with open(path, "rb") as f:
      self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    self._at = 0
    try:
      self._parse()
    except (struct.error, UnicodeDecodeError, OverflowError, ValueError) as err:
      raise GGUFParseError(f"byte {self._at}: {err}") from err

  def _parse(self) -> None:
    if self._map[:4] != b"GGUF":
      raise GGUFParseError("no GGUF magic")
    self._at = 4
    version = self._scalar(4)
    if version not in (2, 3):
      raise GGUFParseError(f"GGUF version {version} (2 and 3 are read)")
    n_tensors, n_fields = self._scalar(10), self._scalar(10)
    self.fields = {}
    for _ in range(n_fields):
      key = self._string()
      self.fields[key] = self._value(self._scalar(4))
    infos = [self._tensor_info() for _ in range(n_tensors)]
    align = int(self.fields.get("general.alignment", 32))
    start = -(-self._at // align) * align
    self.tensors = [self._tensor(start, *info) for info in infos]
    if len({t.name for t in self.tensors}) != len(self.tensors):
      raise GGUFParseError("duplicate tensor names")

  def _scalar(self, kind: int):
    (value,) = struct.unpack_from(_SCALAR[kind], self._map, self._at)
    self._at += struct.calcsize(_SCALAR[kind])
    return value

  def _string(self) -> str:
    n = self._scalar(10)
    if self._at + n > len(self._map):
      raise GGUFParseError(f"a string of {n} bytes runs past the end of the file")
    text = self._map[self._at : self._at + n].decode("utf-8")
    self._at += n
    return text

  def _value(self, kind: int):
    if kind == _STRING:
      return self._string()
    if kind != _ARRAY:
      if kind not in _SCALAR:
        raise GGUFParseError(f"unknown metadata type {kind}")
      return self._scalar(kind)
    item, n = self._scalar(4), self._scalar(10)
    if item == _STRING:
      return [self._string() for _ in range(n)]
    if item not in _SCALAR:
      raise GGUFParseError(f"unknown array element type {item}")
    dtype = np.dtype(_SCALAR[item])
    values = np.frombuffer(self._map, dtype, n, self._at)
    self._at += n * dtype.itemsize
    return values.tolist()

  def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
    name = self._string()
    dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
    return name, dims, self._scalar(4), self._scalar(10)

  def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int,
              offset: int) -> TensorInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(kind)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(dims))
    n_bytes = n * block_bytes // block
    at = start + offset
    if at + n_bytes > len(self._map):
      raise GGUFParseError(f"tensor {name} reaches byte {at + n_bytes} of {len(self._map)}")
    rows = tuple(reversed(dims))
    if kind in _TYPED:
      data = np.frombuffer(self._map, _TYPED[kind], n, at).reshape(rows)
    else:  # each row's blocks as bytes, as `gguf.quants.dequantize` takes them
      data = np.frombuffer(self._map, np.uint8, n_bytes, at).reshape(
          rows[:-1] + (rows[-1] // block * block_bytes,))
    return TensorInfo(name, dims, qtype, at, n_bytes, data)
