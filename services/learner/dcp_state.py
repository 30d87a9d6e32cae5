"""Adapter weights and AdamW moments as torch.distributed.checkpoint (DCP) stores them, so
a checkpoint written at one world size loads at any other.

Every rank writes its own shards of each LoRA parameter and of its AdamW state into one
directory (`dcp.save`, collective), keyed by parameter name: `adapter/<name>` and
`optimizer/<name>/<exp_avg|exp_avg_sq|step>`. DCP's `.metadata` records each tensor's
global shape and which file holds which chunk, so `dcp.load` fills whatever shards the
loading ranks hold (FSDP2 DTensors, or whole tensors in one process) from whatever shards
were written. With one process there is no process group: DCP runs `no_dist`.

torch's own `get_optimizer_state_dict` is not used: for an adapter that never took a step
(an empty AdamW state) it runs a zero-gradient `step()` first, which starts the step count
that AdamW's bias correction reads, so the resumed adapter would not train as the saved one.

A checkpoint directory is data, never code. DCP's `.metadata` is a pickle, so it is read
through `DataOnlyUnpickler`, which builds only DCP's metadata classes, torch sizes, dtypes,
layouts and paths and refuses every other global (`os.system` and the like) by name. Bytes
entries (`BytesStorageMetadata`) are refused too: DCP reads them with
`torch.load(weights_only=False)`. Tensors themselves are read with `weights_only=True`.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.fsdp import FSDPModule

from services.learner import fsdp

METADATA = ".metadata"
ADAPTER = "adapter/"
OPTIMIZER = "optimizer/"

_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
"""The globals a DCP `.metadata` of tensors names (torch 2.13's FileSystemWriter)."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint's metadata names something a checkpoint of tensors never holds."""


class DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own classes and torch's dtypes, and nothing else."""

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"{self.where} names {module}.{name}, which a checkpoint of adapter and optimizer "
            "tensors never holds: it is not loaded (a checkpoint is data, never code). Resume "
            "from a checkpoint this learner wrote, or delete this one"
        )


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata at `path` (a `.metadata` file), read as data only."""
    with open(path, "rb") as f:
        metadata = DataOnlyUnpickler(f, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpoint(f"{path}: entry {fqn!r} is not a tensor")
    for info in (metadata.storage_data or {}).values():
        rel = info.relative_path
        if os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise UnsafeCheckpoint(f"{path} points outside its directory: {rel!r}")
    return metadata


class DataOnlyReader(FileSystemReader):
    """DCP's file reader, its metadata read by `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        assert kwargs.get("rank") is None, "per-rank metadata files are not written here"
        metadata = read_metadata(Path(self.path) / METADATA)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def named_parameters(policy: Any, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters with their names, in its optimizer's order. FSDP2 leaves
    its root unit's parameters gathered after a forward without backward (the policy's
    own check at start); they are resharded first, so the names are the shards' again."""
    for module in policy.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    params = policy.parameters(adapter)
    by_id = {id(p): n for n, p in policy.model.named_parameters()}
    return [(by_id[id(p)], p) for p in params]


def _distributed() -> bool:
    return fsdp.rank_and_size()[1] > 1


def save(policy: Any, folder: str, adapters: list[str]) -> None:
    """Write `adapters`' weights and AdamW moments under `folder`: collective, every rank
    its own shards (call it through `PolicyHandle.call`). Files are fsynced as written."""
    tensors: dict[str, Any] = {}
    for a in adapters:
        state = policy.optimizers[a].state
        for name, param in named_parameters(policy, a):
            tensors[ADAPTER + name] = param.detach()
            for key, value in state.get(param, {}).items():
                assert isinstance(value, torch.Tensor), f"AdamW state {key} is not a tensor"
                tensors[f"{OPTIMIZER}{name}/{key}"] = value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(
            tensors,
            storage_writer=FileSystemWriter(folder, sync_files=True),
            no_dist=not _distributed(),
        )


def load(
    policy: Any, folder: str, adapters: list[str], param_groups: dict[str, list[dict[str, Any]]]
) -> None:
    """Fill `adapters`' weights and AdamW state from `folder`, whatever world size wrote it:
    collective, every rank reads its own shards (call it through `PolicyHandle.call`).
    `param_groups`: each adapter's AdamW hyperparameters as its `state_dict` gives them."""
    reader = DataOnlyReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    tensors: dict[str, Any] = {}
    moments: dict[str, dict[int, dict[str, str]]] = {}
    for a in adapters:
        moments[a] = {}
        for i, (name, param) in enumerate(named_parameters(policy, a)):
            key = ADAPTER + name
            if key not in saved:
                raise ValueError(
                    f"checkpoint {Path(folder).parent} has no weights for {name}: it was "
                    "written for other adapters or another lora spec; resume with the run's "
                    "own spec"
                )
            tensors[key] = param.detach()
            prefix = f"{OPTIMIZER}{name}/"
            for fqn, entry in saved.items():
                if not fqn.startswith(prefix):
                    continue
                assert isinstance(entry, TensorStorageMetadata)
                dtype = entry.properties.dtype
                if entry.size == param.shape:  # a moment: sharded as its parameter is
                    tensors[fqn] = torch.zeros_like(param.detach(), dtype=dtype)
                else:  # AdamW's step count, whole on every rank
                    tensors[fqn] = torch.zeros(entry.size, dtype=dtype)
                moments[a].setdefault(i, {})[fqn[len(prefix) :]] = fqn
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=not _distributed())
    for a in adapters:
        state = {
            i: {k: tensors[fqn] for k, fqn in per_param.items()}
            for i, per_param in moments[a].items()
        }
        policy.optimizers[a].load_state_dict({"state": state, "param_groups": param_groups[a]})
