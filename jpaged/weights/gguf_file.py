"""Reading a GGUF file: its metadata and tensor table in one pass, tensor data left on disk.

`read(path)` parses the header (little-endian, versions 2 and 3), every metadata key and the tensor
table; a tensor is read (and dequantized) only when asked for (`GGUFFile.tensor`). Long metadata
arrays (the vocabulary and its merges: more than `LONG_ARRAY` elements) are skipped, kept as their
length alone (`LongArray`), unless their key starts with one of `full_arrays` (the tokenizer asks for
`tokenizer.`): so `read_config` takes milliseconds where gguf-py's `GGUFReader`, which parses every
vocabulary string, takes seconds. gguf-py still dequantizes (`gguf.quants`), and the tests hold this
reader to `GGUFReader` on every tensor type the models use. `q8_0_blocks` hands out a Q8_0 tensor's
int8 values and float16 scales as stored, for int8 models (`jpaged.device.quant`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import struct
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
LONG_ARRAY = 4096  # metadata arrays longer than this are skipped unless asked for in full


@dataclasses.dataclass(frozen=True)
class LongArray:
    """A metadata array that was skipped (the vocabulary and its merges): its element type and length."""

    value_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFFile:
    """A GGUF file's metadata (`metadata`: key -> int, float, bool, str, list or `LongArray`) and tensor
    table (`tensors`: name -> (numpy shape `[out, in]`, ggml type, absolute offset, bytes)). Float32
    values read back as the shortest decimal that rounds to them (1e-06, not 9.99999997e-07), i.e. as
    the config that was converted."""

    path: pathlib.Path
    metadata: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], Any, int, int]]
    data: np.ndarray

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name`, dequantized to float32, row-major (torch layout: `[out, in]`)."""
        import gguf

        shape, qtype, offset, nbytes = self.tensors[name]
        raw = self.data[offset:offset + nbytes]
        if qtype == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape)
        if qtype == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(shape).astype(np.float32)
        w = gguf.quants.dequantize(raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype)), qtype)
        return np.asarray(w, np.float32).reshape(shape)


def q8_0_blocks(gf: GGUFFile, name: str):
    """Tensor `name`'s Q8_0 blocks as they are in the file: (values i8[out, in], scales f16[out, in / 32]),
    copied out of the file's 34-byte blocks (a float16 scale, then 32 int8 values) with no float pass;
    None when the tensor is not Q8_0."""
    import gguf

    shape, qtype, offset, nbytes = gf.tensors[name]
    if qtype != gguf.GGMLQuantizationType.Q8_0:
        return None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = gf.data[offset:offset + nbytes].reshape(*shape[:-1], shape[-1] // block, type_size)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
    return values, scales


def read(path: pathlib.Path, *, full_arrays: tuple[str, ...] = ()) -> GGUFFile:
    """Reads a GGUF file's header, metadata and tensor table; arrays of keys starting with one of
    `full_arrays` are read whatever their length. Raises ValueError (or struct.error, IndexError,
    UnicodeDecodeError) on anything else or on a file cut short."""
    import gguf

    data = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def unpack(fmt):
        nonlocal pos
        values = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def advance(n):
        nonlocal pos
        pos += n
        if pos > len(data):
            raise ValueError("truncated")

    def string():
        n = unpack("<Q")
        advance(n)
        return bytes(data[pos - n:pos]).decode("utf-8")

    def value(vtype, full):
        if vtype == _STRING:
            return string()
        if vtype == _FLOAT32:
            return float(str(np.float32(unpack("<f"))))
        if vtype in _SCALARS:
            return unpack(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = unpack("<I"), unpack("<Q")
        keep = full or count <= LONG_ARRAY
        if etype in _SCALARS:  # one read for the whole array
            size = count * struct.calcsize(_SCALARS[etype])
            advance(size)
            return list(struct.unpack_from(f"<{count}{_SCALARS[etype][1]}", data, pos - size)) if keep \
                else LongArray(etype, count)
        if etype == _STRING and not keep:
            for _ in range(count):
                advance(unpack("<Q"))
            return LongArray(etype, count)
        return [value(etype, full) for _ in range(count)]

    if len(data) < 24 or bytes(data[:4]) != b"GGUF":
        raise ValueError("bad magic")
    pos = 4
    version, tensor_count, kv_count = unpack("<I"), unpack("<Q"), unpack("<Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (or a big-endian file); expected 2 or 3")
    metadata = {}
    for _ in range(kv_count):
        key = string()
        metadata[key] = value(unpack("<I"), key.startswith(full_arrays) if full_arrays else False)
    table, seen = [], set()
    for _ in range(tensor_count):
        name, ndims = string(), unpack("<I")
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        if ndims > 4:  # GGML_MAX_DIMS
            raise ValueError(f"tensor {name} has {ndims} dimensions")
        dims = [unpack("<Q") for _ in range(ndims)]
        table.append((name, tuple(reversed(dims)), unpack("<I"), unpack("<Q")))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment = {alignment!r} is not a power of two")
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, type_id, offset in table:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) * type_size // block
        start = data_start + offset
        if start + nbytes > len(data):
            raise ValueError(f"truncated: tensor {name} ends past the end of the file")
        tensors[name] = (shape, qtype, start, nbytes)
    return GGUFFile(path, metadata, tensors, data)
