"""Moving LoRA adapters between learner and inference: safetensors bytes in chunks.

The first `AdapterChunk` carries the manifest (base model, rank, alpha, target
modules, sha256 and size of the payload); the rest carry the payload in order.
gRPC refuses unary messages over 4 MiB, so adapters always travel as a stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from marl.protocol.v1 import common_pb2, inference_pb2

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 1 << 20


def serialize(state_dict: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()})


def deserialize(payload: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(payload)


def make_manifest(
    name: str,
    version: int,
    base_model: str,
    rank: int,
    alpha: float,
    target_modules: list[str],
    payload: bytes,
    keep_versions: int = 0,
    owner: str = "",
    run_id: str = "",
    fence: int = 0,
) -> common_pb2.AdapterManifest:
    """`keep_versions`: how many versions of this adapter the replica keeps (see
    `AdapterManifest.keep_versions`); 0 leaves it to the replica. `owner`: the user whose
    run trained it (`AdapterManifest.owner`). `run_id`, `fence`: the run whose learner
    pushes it and the fencing token of that learner's lease."""
    return common_pb2.AdapterManifest(
        ref=common_pb2.AdapterRef(name=name, version=version),
        base_model=base_model,
        rank=rank,
        alpha=alpha,
        target_modules=sorted(target_modules),
        sha256=hashlib.sha256(payload).hexdigest(),
        size_bytes=len(payload),
        format="safetensors",
        keep_versions=keep_versions,
        owner=owner,
        run_id=run_id,
        fence=fence,
    )


def chunks(
    manifest: common_pb2.AdapterManifest, payload: bytes, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[inference_pb2.AdapterChunk]:
    yield inference_pb2.AdapterChunk(manifest=manifest)
    for i in range(0, len(payload), chunk_bytes):
        yield inference_pb2.AdapterChunk(data=payload[i : i + chunk_bytes])
