"""Read a safetensors file's header without torch or numpy.

A safetensors file is an 8-byte little-endian header length, a JSON header that maps each
tensor name to its dtype, shape and byte range in the data section, then the data section.
Reading only the header is enough to check that a file is complete and that its tensors
have the shapes an engine expects, which lets the gateway vet an adapter without torch.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A header is a few hundred bytes per tensor; 100 MiB is the limit the safetensors library uses.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class SafetensorsError(ValueError):
    """The file is not a complete, well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    header_bytes: int
    file_size: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse and check the header of the safetensors file at ``path``.

    Raises ``SafetensorsError`` when the file is truncated, padded, or its header is not
    valid JSON describing tensors that fit the data section exactly. Read once per version of
    a file: detection, conversion and validation of one adapter all ask for it, and a file
    with the same inode, size and modification time is not read again.
    """
    try:
        stat = path.stat()
    except OSError as exc:
        raise SafetensorsError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return _read(path, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read(path: Path, inode: int, file_size: int, mtime_ns: int) -> SafetensorsHeader:
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(
                    f"{path} is truncated ({file_size} bytes): not a safetensors file; "
                    "download or export it again"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len == 0 or header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise SafetensorsError(
                    f"{path} is truncated or corrupt: its header claims {header_len} bytes but "
                    f"the file has {file_size}; download or export it again"
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise SafetensorsError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # also a number past Python's digit limit
        raise SafetensorsError(
            f"{path} is corrupt: its header is not valid JSON ({exc}); download or export it again"
        ) from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path} is corrupt: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path} is corrupt: __metadata__ is not a JSON object")
    tensors = {name: _tensor_info(path, name, entry) for name, entry in header.items()}
    _check_contiguous(path, tensors)
    data_size = file_size - 8 - header_len
    end = max((info.end for info in tensors.values()), default=0)
    if end != data_size:
        problem = "truncated" if end > data_size else "padded with extra bytes"
        raise SafetensorsError(
            f"{path} is {problem}: its tensors need {end} data bytes but the file holds "
            f"{data_size} (file size {file_size}); download or export it again"
        )
    return SafetensorsHeader(
        path=path,
        tensors=tensors,
        metadata={str(k): str(v) for k, v in metadata.items()},
        header_bytes=header_len,
        file_size=file_size,
    )


def _tensor_info(path: Path, name: str, entry: Any) -> TensorInfo:
    where = f"{path} is corrupt: tensor {name!r}"
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where} has no dtype/shape/data_offsets record")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise SafetensorsError(f"{where} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(f"{where} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SafetensorsError(f"{where} has invalid data_offsets {offsets!r}")
    count = 1
    for dim in shape:
        count *= dim
    if count * DTYPE_SIZES[dtype] != offsets[1] - offsets[0]:
        raise SafetensorsError(
            f"{where}: shape {shape} of {dtype} needs {count * DTYPE_SIZES[dtype]} bytes "
            f"but data_offsets span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), start=offsets[0], end=offsets[1])


def _check_contiguous(path: Path, tensors: dict[str, TensorInfo]) -> None:
    # The format lays tensors end to end; a gap or an overlap means a damaged header.
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != position:
            raise SafetensorsError(
                f"{path} is corrupt: tensor {info.name!r} starts at byte {info.start} of the "
                f"data section, expected {position}"
            )
        position = info.end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
