"""Many LoRA adapters over one frozen base model, for the transformers engine's batches.

PEFT's mixed-adapter forward does, in every adapted linear layer and for every
adapter of the batch, a row gather, two matmuls, a scale and a scatter, plus its
Python bookkeeping; on small models that per-layer work costs more than the
matmuls (`bench/inference.py` measures mixed adapters against the base model). Here each
adapted `nn.Linear` is wrapped once, the engine orders a batch's rows by adapter
(`route`), and each adapter's delta is two matmuls on a contiguous slice of the
rows, added in place, with the LoRA scale folded into B at load. When the
adapters of a batch share one rank and one row count, the deltas of all of them
are two batched matmuls (`bmm`, `baddbmm_`) per layer.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass
class Plan:
    """A batch's rows by adapter: `groups` are (adapter, first row, end row), with None
    for rows of the bare base model; `rows` is the row count they cover."""

    groups: list[tuple[str | None, int, int]]
    uniform: tuple[str, ...] | None
    """The adapters in row order when every row has one, each the same number of rows."""


@dataclass
class Routing:
    """The plan of the forward under way, shared by every wrapped layer."""

    plan: Plan | None = None


def plan_for(adapters: list[str | None]) -> Plan:
    """Group consecutive rows of one adapter (sorted rows make one group per adapter)."""
    groups: list[tuple[str | None, int, int]] = []
    for i, name in enumerate(adapters):
        if groups and groups[-1][0] == name:
            groups[-1] = (name, groups[-1][1], i + 1)
        else:
            groups.append((name, i, i + 1))
    sizes = {stop - start for _, start, stop in groups}
    names = [name for name, _, _ in groups]
    uniform = None
    if len(sizes) == 1 and None not in names and len(set(names)) == len(names):
        uniform = tuple(n for n in names if n is not None)
    return Plan(groups, uniform)


@dataclass
class _Weights:
    a: torch.Tensor
    """[in, rank]: A transposed."""
    b: torch.Tensor
    """[rank, out]: B transposed, times alpha / rank."""


class LoRALinear(nn.Module):
    """A frozen linear layer plus, per row group of the routed batch, its adapter's delta."""

    def __init__(self, base: nn.Linear, routing: Routing):
        super().__init__()
        self.base = base
        self.routing = routing
        self.adapters: dict[str, _Weights] = {}
        self._stacked: tuple[tuple[str, ...], torch.Tensor, torch.Tensor] | None = None
        """The uniform plan's adapters and their A and B stacked, kept across decode steps."""

    def set_adapter(self, name: str, weights: _Weights) -> None:
        self.adapters[name] = weights
        self._stacked = None

    def drop_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        self._stacked = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan = self.routing.plan
        if plan is None or not self.adapters:
            return y
        rows = x.shape[0]
        flat_x = x.reshape(rows, -1, x.shape[-1])
        flat_y = y.view(rows, -1, y.shape[-1])
        if plan.uniform is not None and all(n in self.adapters for n in plan.uniform):
            a, b = self._stack(plan.uniform)
            if a is not None and b is not None:
                groups = len(plan.uniform)
                xs = flat_x.reshape(groups, -1, flat_x.shape[-1])
                flat_y.view(groups, -1, flat_y.shape[-1]).baddbmm_(torch.bmm(xs, a), b)
                return y
        for name, start, stop in plan.groups:
            w = self.adapters.get(name) if name is not None else None
            if w is None:
                continue
            xs = flat_x[start:stop].reshape(-1, flat_x.shape[-1])
            flat_y[start:stop].view(-1, flat_y.shape[-1]).addmm_(xs @ w.a, w.b)
        return y

    def _stack(self, names: tuple[str, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self._stacked is None or self._stacked[0] != names:
            ranks = {self.adapters[n].a.shape[1] for n in names}
            if len(ranks) != 1:
                return None, None
            a = torch.stack([self.adapters[n].a for n in names])
            b = torch.stack([self.adapters[n].b for n in names])
            self._stacked = (names, a, b)
        return self._stacked[1], self._stacked[2]


@dataclass
class MultiLoRA:
    """The adapters loaded into `model` (its adapted linears are wrapped in place)."""

    model: nn.Module
    routing: Routing = field(default_factory=Routing)
    layers: dict[str, LoRALinear] = field(default_factory=dict)
    """Module path -> its wrapper, once some adapter adapts it."""
    loaded: dict[str, list[str]] = field(default_factory=dict)
    """Adapter -> the module paths it adapts."""

    def load(
        self,
        name: str,
        rank: int,
        alpha: float,
        target_modules: list[str],
        state_dict: dict[str, torch.Tensor],
    ) -> None:
        """Add adapter `name` from PEFT-format weights; ValueError (nothing loaded) when
        a weight names no linear layer of the model, a target it was not made for, or
        has a shape that does not fit."""
        if name in self.loaded:
            raise ValueError(f"adapter {name} is already loaded")
        pairs = self._pairs(state_dict, target_modules)
        weights = {path: self._weights(path, a, b, rank, alpha) for path, (a, b) in pairs.items()}
        for path, w in weights.items():
            self._wrap(path).set_adapter(name, w)
        self.loaded[name] = list(weights)

    def unload(self, name: str) -> None:
        for path in self.loaded.pop(name):
            self.layers[path].drop_adapter(name)

    @contextlib.contextmanager
    def route(self, adapters: list[str | None]) -> Iterator[None]:
        """Forwards inside use row i's adapter `adapters[i]` (None: the base model alone)."""
        unknown = {n for n in adapters if n is not None and n not in self.loaded}
        if unknown:
            raise KeyError(f"adapter {sorted(unknown)[0]} is not loaded")
        self.routing.plan = plan_for(adapters)
        try:
            yield
        finally:
            self.routing.plan = None

    def _pairs(
        self, state_dict: dict[str, torch.Tensor], target_modules: list[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        unexpected = []
        for key, tensor in state_dict.items():
            m = _KEY.match(key)
            module = self._linear(m.group("module")) if m else None
            if m is None or module is None or not _targeted(m.group("module"), target_modules):
                unexpected.append(key)
                continue
            parts.setdefault(m.group("module"), {})[m.group("part")] = tensor
        if unexpected:
            raise ValueError(f"unexpected weights {unexpected[:3]}")
        half = [p for p, ab in parts.items() if len(ab) != 2]
        if half:
            raise ValueError(f"layer {half[0]} has only one of lora_A and lora_B")
        return {path: (ab["A"], ab["B"]) for path, ab in parts.items()}

    def _weights(
        self, path: str, a: torch.Tensor, b: torch.Tensor, rank: int, alpha: float
    ) -> _Weights:
        base = self._linear(path)
        assert base is not None
        if tuple(a.shape) != (rank, base.in_features) or tuple(b.shape) != (
            base.out_features,
            rank,
        ):
            raise ValueError(
                f"layer {path}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"rank {rank} over {base.in_features} -> {base.out_features}"
            )
        dtype, device = base.weight.dtype, base.weight.device
        scale = alpha / rank
        return _Weights(
            a=a.detach().to(device=device, dtype=dtype).t().contiguous(),
            b=(b.detach().double() * scale).to(device=device, dtype=dtype).t().contiguous(),
        )

    def _linear(self, path: str) -> nn.Linear | None:
        if path in self.layers:
            return self.layers[path].base
        try:
            module = self.model.get_submodule(path)
        except AttributeError:
            return None
        return module if isinstance(module, nn.Linear) else None

    def _wrap(self, path: str) -> LoRALinear:
        if path not in self.layers:
            parent_path, _, leaf = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            wrapper = LoRALinear(getattr(parent, leaf), self.routing)
            setattr(parent, leaf, wrapper)
            self.layers[path] = wrapper
        return self.layers[path]


def _targeted(path: str, target_modules: list[str]) -> bool:
    """PEFT's rule for a list of names: a module is targeted when its path is one of them
    or ends with `.` + one of them."""
    return any(path == t or path.endswith(f".{t}") for t in target_modules)
