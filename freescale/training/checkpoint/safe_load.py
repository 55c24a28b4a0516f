"""Reading a checkpoint without running code from it.

A checkpoint folder is files anyone who can write there may have replaced, and Python's full
unpickler calls whatever a file names (a ``__reduce__`` payload runs on resume). So nothing of a
checkpoint goes through it:

* a rank's own file (``rank_<r>.pt``) holds plain data only -- tensors, numbers, strings, None, and
  lists, tuples and dicts of them (``check_plain``, when saving) -- and is read by torch's
  weights-only unpickler with nothing added to its allow-list (``read_own_state``);
* DCP's metadata (``.metadata``, a plain pickle) is read by an unpickler that builds DCP's own
  metadata classes and nothing else (``SafeReader``);
* DCP's non-tensor entries (the dense optimizer's hyperparameters, each saved with ``torch.save``)
  are read by the weights-only unpickler (``SafePlanner``); DCP reads tensors that way already.

A file that names anything else is refused in one line (``InputError``, exit 2) naming the file and
what it names, without building any of it.
"""
from __future__ import annotations

import collections
import io
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from freescale.runtime.errors import InputError, one_line

PLAIN_SCALARS = (bool, int, float, str, type(None))
PLAIN_MAPPINGS = (dict, collections.OrderedDict)
PLAIN_SEQUENCES = (list, tuple)
# Globals a plain rank file names: tensors (rebuilt from their storages), OrderedDicts.
PLAIN_GLOBALS = ("torch._utils._rebuild_tensor_v2", "collections.OrderedDict")
# What an older FreeScale saved in a rank's own file: the user feature tables' fused optimizer state
# as ShardedTensors, whose pickle needs getattr (an enum member) and cannot be read safely.
OLDER_FREESCALE = "torch.distributed._shard."
# DCP's metadata file: its dataclasses, the dtypes and layouts of its tensors, the checkpoint's path.
DCP_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}


# ------------------------------------------------------------------ a rank's own file


def check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` naming the first entry of ``value`` that is not plain data (a bug: a
    ``Stateful`` whose state a resume could not read back safely)."""
    if type(value) is torch.Tensor or type(value) in PLAIN_SCALARS:  # exact types: a subclass pickles its own class
        return
    if type(value) in PLAIN_MAPPINGS:
        for key, item in value.items():
            if type(key) not in PLAIN_SCALARS:
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not plain data")
            check_plain(item, f"{where}.{key}")
        return
    if type(value) in PLAIN_SEQUENCES:
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, not plain data "
                    "(tensors, numbers, strings, None, and lists, tuples and dicts of them): a resume "
                    "could not read it back without running code from the file")


def read_own_state(path: Path) -> dict[str, Any]:
    """A rank's own file, read by the weights-only unpickler; one line when it holds anything but plain data."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        names = foreign_globals(_pickle_of(path.read_bytes()), PLAIN_GLOBALS)
        raise (_older_freescale(path, names) or _replaced(str(path), path.parent, names)) from None
    except (RuntimeError, EOFError) as exc:  # not a torch file at all: cut short, or overwritten
        raise _unreadable(path, exc) from None


def _older_freescale(path: Path, names: list[str]) -> InputError | None:
    """The one line for a rank file an older FreeScale wrote (its ShardedTensors); None for any other."""
    older = sorted((name for name in names if name.startswith(OLDER_FREESCALE)),
                   key=lambda name: not name.endswith(".ShardedTensor"))
    if not older or not all(name.startswith("torch.") or name == "builtins.getattr" for name in names):
        return None
    # The same line on every rank (the launcher prints it once): each rank's file is as old.
    return InputError(f"checkpoint {path.parent} was written by an older FreeScale: its rank_<r>.pt files hold "
                      f"{older[0]} (the user feature tables' optimizer state), which cannot be loaded safely; "
                      "finish that run with the FreeScale that wrote it, or start over in another checkpoint.folder")


def _replaced(what: str, folder: Path, names: list[str]) -> InputError:
    """The one line for a file (or a DCP entry, ``what``) of checkpoint ``folder`` that names ``names``."""
    return InputError(f"{what} names {_listed(names)}, which no FreeScale checkpoint holds: refused without "
                      f"loading it (was the file replaced?); remove {folder} to resume from the checkpoint "
                      "before it, or use another checkpoint.folder")


def _unreadable(path: Path, exc: BaseException) -> InputError:
    return InputError(f"{path} cannot be read ({one_line(exc).split('. ')[0][:160]}): remove {path.parent} to "
                      "resume from the checkpoint before it, or use another checkpoint.folder")


def _listed(names: list[str]) -> str:
    if not names:  # a pickle too broken to name anything
        return "something the weights-only unpickler refuses"
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


# ------------------------------------------------------------------ what a pickle names


def _pickle_of(data: bytes) -> bytes:
    """The pickle inside a file ``torch.save`` wrote (a zip holding ``<name>/data.pkl``), or the file itself."""
    if not zipfile.is_zipfile(io.BytesIO(data)):
        return data
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        inner = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
        return archive.read(inner[0]) if inner else b""


def foreign_globals(data: bytes, allowed: tuple[str, ...] = ()) -> list[str]:
    """The classes and functions a pickle names (``module.name``), in order, once each, less ``allowed``
    and torch's dtypes and storages. Read from the opcodes alone (``pickletools``): nothing is built."""
    names: list[str] = []
    pushed: list[Any] = []  # what each opcode pushed, for STACK_GLOBAL's two operands
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                names.append(arg.replace(" ", "."))
            elif name == "STACK_GLOBAL" and len(pushed) >= 2:
                names.append(f"{pushed[-2]}.{pushed[-1]}")
            if name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = pushed[-1] if pushed else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(int(arg)))
            else:
                pushed.append(arg if "UNICODE" in name or "STRING" in name else None)
    except (ValueError, IndexError, KeyError):  # not a whole pickle: name what came before
        pass
    found = dict.fromkeys(name.replace("__builtin__.", "builtins.") for name in names)
    return [name for name in found if name not in allowed and not _torch_plain(name)]


def _torch_plain(name: str) -> bool:
    """A dtype (``torch.float32``) or a storage class (``torch.FloatStorage``): the plain tensor's parts."""
    module, _, attribute = name.rpartition(".")
    return module == "torch" and (attribute.endswith("Storage") or isinstance(getattr(torch, attribute, None),
                                                                              torch.dtype))


# ------------------------------------------------------------------ DCP


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and _torch_plain(f"torch.{name}")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(folder: Path) -> Metadata:
    """A DCP checkpoint's metadata (``.metadata``) through ``_MetadataUnpickler``; one line when it names
    anything else."""
    path = folder / ".metadata"
    data = path.read_bytes()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        allowed = tuple(f"{module}.{name}" for module, name in DCP_METADATA_GLOBALS)
        raise _replaced(str(path), folder, foreign_globals(data, allowed)) from None
    except (EOFError, ValueError, TypeError, AttributeError) as exc:  # cut short, or built from wrong arguments
        raise _unreadable(path, exc) from None
    if not isinstance(metadata, Metadata):
        raise InputError(f"{path} holds a {type(metadata).__name__}, not DCP's metadata: remove {folder} to "
                         "resume from the checkpoint before it, or use another checkpoint.folder")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader over metadata ``read_dcp_metadata`` read when it was made: a refusal is this
    rank's, before DCP's collective load starts (inside it, DCP would take it for missing metadata)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.metadata = read_dcp_metadata(folder)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError(f"{self.path}: FreeScale's checkpoints have no per-rank metadata")
        # As FileSystemReader.read_metadata leaves it.
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with the weights-only unpickler (DCP's own uses the
    full one). ``folder``: the checkpoint, for the refusal's line."""

    def __init__(self, folder: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.folder = folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.getvalue()
        try:
            loaded = torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError:
            raise _replaced(f"checkpoint {self.folder}'s entry {read_item.dest_index.fqn}", self.folder,
                            foreign_globals(_pickle_of(data), PLAIN_GLOBALS)) from None
        # DCP's own code puts the value where its flattened key says, unpickling with the full
        # unpickler: it gets the value as pickled here, from what the safe read built.
        resaved = io.BytesIO()
        torch.save(loaded, resaved)
        resaved.seek(0)
        super().load_bytes(read_item, resaved)
