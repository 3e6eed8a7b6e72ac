"""The files of a Hugging Face checkpoint directory: finding each tensor's
safetensors file, reading slices of it, and writing new files one tensor at a time."""

import contextlib
import json
import os
import pathlib
import struct
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

# Registers bfloat16 with numpy, so that safetensors' numpy reader can return it.
import ml_dtypes
import numpy as np

from .._errors import PretrainedError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# safetensors' dtype names of the floating dtypes a model may be stored in.
DTYPE_NAMES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
}


def safetensors_module() -> ModuleType:
    """`safetensors`, imported only when a checkpoint is read, so `import eqxpar` needs it not."""
    try:
        import safetensors
    except ImportError as e:
        raise PretrainedError(
            "eqxpar.models.from_pretrained needs the `safetensors` package, which is not installed. "
            "Install it with `pip install eqxpar[pretrained]` (or `pip install safetensors`)."
        ) from e
    return safetensors


def read_config(directory: pathlib.Path) -> dict[str, Any]:
    """`config.json` of `directory` as a dict, with errors naming the file."""
    if not directory.is_dir():
        raise PretrainedError(
            f"from_pretrained: {str(directory)!r} is not a directory. Pass the directory that holds "
            "config.json and model.safetensors (a Hugging Face checkpoint, e.g. one downloaded with "
            "`huggingface-cli download`)."
        )
    path = directory / CONFIG
    if not path.is_file():
        raise PretrainedError(
            f"from_pretrained: {str(path)!r} does not exist. A Hugging Face checkpoint directory holds "
            "config.json next to its weights; pass that directory."
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PretrainedError(f"from_pretrained: cannot read {str(path)!r} as JSON ({e}).") from e
    if not isinstance(config, dict):
        raise PretrainedError(
            f"from_pretrained: {str(path)!r} holds {type(config).__name__}, not a JSON object."
        )
    return config


class TensorFiles:
    """The tensors of a checkpoint directory, each opened lazily in its safetensors
    file: `shape(name)`, `dtype(name)`, `read(name, index)`; nothing is read whole."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self._headers: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
        if (directory / INDEX).is_file():
            try:
                index = json.loads((directory / INDEX).read_text())
                weight_map = dict(index["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise PretrainedError(
                    f"from_pretrained: cannot read {str(directory / INDEX)!r} ({e!r}); expected a JSON "
                    'object with a "weight_map" of tensor name -> safetensors file.'
                ) from e
            self.file_of = {name: str(file) for name, file in weight_map.items()}
        elif (directory / SINGLE).is_file():
            self.file_of = {name: SINGLE for name in self._header_of(SINGLE)}
        else:
            pickles = [name for name in _PICKLES if (directory / name).is_file()]
            if pickles:
                raise PretrainedError(
                    f"from_pretrained: {str(directory)!r} holds {pickles[0]} but no model.safetensors. "
                    "eqxpar reads only safetensors: a .bin file is a Python pickle, and unpickling runs "
                    "whatever code it contains. Convert it to safetensors once, in an environment you "
                    "trust (transformers: `AutoModelForCausalLM.from_pretrained(dir).save_pretrained("
                    "dir, safe_serialization=True)`), or download the model's safetensors files."
                )
            raise PretrainedError(
                f"from_pretrained: {str(directory)!r} has neither {SINGLE} nor {INDEX}. Pass a Hugging "
                "Face checkpoint directory with safetensors weights."
            )

    def _path(self, file: str) -> pathlib.Path:
        path = self.directory / file
        if not path.is_file():
            raise PretrainedError(
                f"from_pretrained: {str(path)!r} does not exist, but {INDEX} names it. Download the "
                "checkpoint's missing shard (every file the index lists)."
            )
        return path

    @contextlib.contextmanager
    def _open_file(self, file: str) -> Iterator[Any]:
        """One safetensors file, memory-mapped while the block is open. Each read opens
        its file again and unmaps it after: the pages a read touches (a column block
        touches every page of its tensor) are then resident for that read only, so a
        process's peak memory is its own blocks plus one tensor, not the files."""
        path = self._path(file)
        safetensors = safetensors_module()
        try:
            handle = safetensors.safe_open(str(path), framework="numpy")
        except Exception as e:  # safetensors raises its own error types for bad files
            raise PretrainedError(
                f"from_pretrained: {str(path)!r} is not a readable safetensors file ({e}). It may be "
                "truncated (an interrupted download): download it again."
            ) from e
        with handle as opened:
            yield opened

    def _header_of(self, file: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """The shape and dtype of every tensor in `file`, read from its header once."""
        if file not in self._headers:
            with self._open_file(file) as opened:
                slices = {name: opened.get_slice(name) for name in opened.keys()}
                self._headers[file] = {
                    name: (tuple(part.get_shape()), part.get_dtype()) for name, part in slices.items()
                }
        return self._headers[file]

    def names(self) -> set[str]:
        return set(self.file_of)

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.file_of:
            raise PretrainedError(
                f"from_pretrained: tensor {name!r} is missing from {str(self.directory)!r} "
                f"(its safetensors files hold {len(self.file_of)} tensors, not this one). The "
                "checkpoint does not match its config.json, or a shard is incomplete."
            )
        header = self._header_of(self.file_of[name])
        if name not in header:
            raise PretrainedError(
                f"from_pretrained: tensor {name!r} is not in {self.file_of[name]!r} although the index "
                "says so. Download the checkpoint again."
            )
        return header[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header(name)[0]

    def dtype_name(self, name: str) -> str:
        return self._header(name)[1]

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` (one slice per dimension) of tensor `name`, read from disk."""
        self._header(name)
        try:
            with self._open_file(self.file_of[name]) as opened:
                # A copy: the block must outlive the mapping, which closes here.
                return np.array(opened.get_slice(name)[index], copy=True)
        except PretrainedError:
            raise
        except Exception as e:
            raise PretrainedError(
                f"from_pretrained: cannot read tensor {name!r} from "
                f"{str(self.directory / self.file_of[name])!r} ({e}). The file may be truncated: "
                "download it again."
            ) from e


def write_safetensors(
    path: pathlib.Path, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]], fetch
) -> None:
    """Write a safetensors file of `tensors` (name, shape, dtype), calling
    `fetch(name) -> np.ndarray` for one tensor at a time: the header is written
    first from the shapes, so no more than one tensor is ever held."""
    tensors = list(tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # The format aligns the data to 8 bytes by padding the header with spaces.
    encoded += b" " * (-len(encoded) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape, dtype in tensors:
            array = np.ascontiguousarray(fetch(name), dtype=np.dtype(dtype).newbyteorder("<"))
            if array.shape != tuple(shape):
                raise PretrainedError(
                    f"save_pretrained: tensor {name!r} came out as {array.shape}, not {shape}."
                )
            f.write(array.tobytes())
    # Renamed only when complete: a crash leaves no file that looks whole.
    os.replace(tmp, path)
