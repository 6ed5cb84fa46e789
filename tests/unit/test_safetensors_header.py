from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from loragate.adapters.intake.safetensors_header import SafetensorsError, read_safetensors_header
from tests.adapter_fixtures import save_tensors, write_safetensors


def _raw_file(path: Path, header: object, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_header_of_a_file_written_by_safetensors_lists_names_dtypes_shapes_offsets(
    tmp_path: Path,
) -> None:
    import torch

    path = save_tensors(
        tmp_path / "a.safetensors",
        {
            "x.lora_A.weight": torch.zeros(4, 16),
            "x.lora_B.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
        },
    )
    header = read_safetensors_header(path)
    assert header.metadata == {"format": "pt"}
    assert header.shapes() == {"x.lora_A.weight": (4, 16), "x.lora_B.weight": (8, 4)}
    a, b = header.tensors["x.lora_A.weight"], header.tensors["x.lora_B.weight"]
    assert (a.dtype, b.dtype) == ("F32", "BF16")
    assert a.nbytes == 4 * 16 * 4 and b.nbytes == 8 * 4 * 2
    assert sorted([(a.start, a.end), (b.start, b.end)])[0][0] == 0
    assert header.file_size == path.stat().st_size == 8 + header.header_bytes + a.nbytes + b.nbytes


def test_truncated_file_is_refused_with_sizes_in_the_message(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", (4, 4))})
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(
        SafetensorsError, match=r"truncated.*need 64 data bytes but the file holds 54"
    ):
        read_safetensors_header(path)


def test_file_with_trailing_garbage_is_refused(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", (2, 2))})
    path.write_bytes(path.read_bytes() + b"extra")
    with pytest.raises(SafetensorsError, match="padded"):
        read_safetensors_header(path)


def test_header_length_beyond_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(SafetensorsError, match="header claims 10000 bytes"):
        read_safetensors_header(path)


def test_file_shorter_than_the_length_prefix_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(SafetensorsError, match="truncated"):
        read_safetensors_header(path)


def test_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "a.safetensors", b"{not json")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        read_safetensors_header(path)


def test_header_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "a.safetensors", [1, 2])
    with pytest.raises(SafetensorsError, match="not a JSON object"):
        read_safetensors_header(path)


def test_unknown_dtype_is_refused(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}
    path = _raw_file(tmp_path / "a.safetensors", header, bytes(16))
    with pytest.raises(SafetensorsError, match="unknown dtype 'F128'"):
        read_safetensors_header(path)


def test_shape_that_does_not_match_its_byte_range_is_refused(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}
    path = _raw_file(tmp_path / "a.safetensors", header, bytes(12))
    with pytest.raises(SafetensorsError, match="needs 16 bytes but data_offsets span 12"):
        read_safetensors_header(path)


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = _raw_file(tmp_path / "a.safetensors", header, bytes(12))
    with pytest.raises(SafetensorsError, match="starts at byte 4"):
        read_safetensors_header(path)


def test_negative_or_non_integer_offsets_are_refused(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}
    path = _raw_file(tmp_path / "a.safetensors", header)
    with pytest.raises(SafetensorsError, match="invalid data_offsets"):
        read_safetensors_header(path)


def test_file_with_no_tensors_is_well_formed(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "a.safetensors", {"__metadata__": {"format": "pt"}})
    header = read_safetensors_header(path)
    assert header.tensors == {}
    assert header.metadata == {"format": "pt"}


def test_one_version_of_a_file_is_read_once_and_a_new_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection, conversion and validation each ask for an adapter's header: one read."""
    header = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    path = _raw_file(tmp_path / "a.safetensors", header, b"\0" * 8)
    opened: list[Path] = []
    real_open = Path.open

    def counting_open(self: Path, *args: object, **kwargs: object) -> object:
        if args[:1] == ("rb",):
            opened.append(self)
        return real_open(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(Path, "open", counting_open)
    first = read_safetensors_header(path)
    assert read_safetensors_header(path) is first
    assert opened == [path]
    # A new version of the file (here a longer one, as a re-export would be) is read anew.
    bigger = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    replacement = _raw_file(tmp_path / "b.safetensors", bigger, b"\0" * 16)
    replacement.replace(path)
    assert read_safetensors_header(path).shapes() == {"w": (4,)}
    assert opened == [path, path]
