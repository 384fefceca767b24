"""Load one full-weights file into a live (possibly ZeRO-3 partitioned) DeepSpeed model.

Protocol (every rank runs it; only rank 0 opens the file):
1. rank 0 opens the file lazily (safetensors ``safe_open`` / ``torch.load(mmap=True, weights_only=True)``),
   expands tied aliases recorded by ``dsckpt consolidate``, and checks keys and shapes against the
   model; the verdict is broadcast so every rank fails the same way.
2. module by module: ``GatheredParameters(module.parameters(recurse=False), modifier_rank=0)``;
   rank 0 copies values in; DeepSpeed re-partitions on exit.  Stages 0-2 need no gathering, and
   rank 0's values are broadcast.  Persistent buffers are broadcast from rank 0.
3. the optimizer's fp32 masters are set from the file: ``refresh_fp32_params()`` for fp32 models;
   for 16-bit models each parameter's fp32 value is broadcast and set with
   ``safe_set_full_fp32_param`` so masters keep full precision.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CorruptFileError, StateDictMismatchError
from . import engine as eng

MAX_LISTED = 5


class WeightsFile:
    """Lazy name -> tensor access to .safetensors, a sharded index folder, or a torch .pt/.bin."""

    def __init__(self, path: str | Path, strip_prefixes: tuple[str, ...] = ()):
        self.path = Path(path)
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        self._torch: dict[str, torch.Tensor] | None = None
        aliases: dict[str, str] = {}
        try:
            if self.path.is_dir() or self.path.name.endswith(".index.json"):
                index = self.path if self.path.is_file() else next(self.path.glob("*.index.json"), None)
                if index is None:
                    raise CorruptFileError(f"{self.path}: folder holds no *.index.json")
                from ..safetensors_file import read_index

                meta, self._where = read_index(index)
                self._dir = index.parent
                aliases = json.loads(meta.get("dsckpt.aliases", "{}"))
            elif self.path.suffix == ".safetensors":
                from ..safetensors_file import read_header

                header, _ = read_header(self.path)  # validates before safetensors touches it
                self._where = {k: self.path.name for k in header if k != "__metadata__"}
                self._dir = self.path.parent
                aliases = json.loads(header.get("__metadata__", {}).get("dsckpt.aliases", "{}"))
            else:
                obj = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
                if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
                    obj = obj["state_dict"]
                if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                    raise CorruptFileError(f"{self.path}: not a state dict of tensors")
                self._torch = obj
        except (OSError, RuntimeError, ValueError) as exc:
            raise CorruptFileError(f"{self.path}: cannot read weights ({exc})") from None
        names = list(self._torch) if self._torch is not None else list(self._where)
        self.aliases = {a: s for a, s in aliases.items() if a not in names}
        self.source = {self._strip(n, strip_prefixes): n for n in names + list(self.aliases)}

    @staticmethod
    def _strip(name: str, prefixes: tuple[str, ...]) -> str:
        for p in prefixes:
            if name.startswith(p):
                return name[len(p):]
        return name

    def keys(self) -> list[str]:
        return list(self.source)

    def get(self, key: str) -> torch.Tensor:
        name = self.source[key]
        name = self.aliases.get(name, name)
        if self._torch is not None:
            return self._torch[name]
        return self._handle(name).get_tensor(name)

    def shape(self, key: str) -> tuple[int, ...]:
        name = self.aliases.get(self.source[key], self.source[key])
        if self._torch is not None:
            return tuple(self._torch[name].shape)
        return tuple(self._handle(name).get_slice(name).get_shape())  # header only, no data

    def _handle(self, name: str):
        shard = self._where[name]
        if shard not in self._handles:
            from safetensors import safe_open

            self._handles[shard] = safe_open(str(self._dir / shard), framework="pt")
        return self._handles[shard]


def expected_entries(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every name a full state dict of ``module`` holds (tied names too), with its full shape."""
    out = {}
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in mod.named_parameters(recurse=False):
            out[prefix + name] = tuple(getattr(p, "ds_shape", p.shape))
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[prefix + name] = tuple(b.shape)
    return out


def check_keys(expected: dict[str, tuple[int, ...]], src: WeightsFile, strict: bool) -> list[str]:
    """The problems a strict load must refuse: missing, unexpected, mis-shaped keys."""
    have = set(src.keys())
    missing = sorted(set(expected) - have)
    unexpected = sorted(have - set(expected))
    mismatched = [f"{k}: file {list(src.shape(k))} vs model {list(expected[k])}"
                  for k in expected if k in have and tuple(src.shape(k)) != expected[k]]
    problems = []
    for label, items in (("missing keys", missing if strict else []), ("unexpected keys", unexpected if strict else []),
                         ("shape mismatches", mismatched)):
        if items:
            more = f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
            problems.append(f"{len(items)} {label}: {', '.join(items[:MAX_LISTED])}{more}")
    return problems


def _broadcast_object(obj: Any) -> Any:
    if eng.world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_full_weights(engine, path: str | Path, *, strict: bool = True, strip_prefixes: tuple[str, ...] = (),
                      progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Load ``path`` into ``engine.module`` following the protocol above; returns counts."""
    import deepspeed

    module = engine.module
    expected = expected_entries(module)
    src = WeightsFile(path, strip_prefixes) if eng.rank() == 0 else None
    problems = _broadcast_object(check_keys(expected, src, strict) if src else None)
    if problems:
        raise StateDictMismatchError(f"{path}: does not fit the model - " + "; ".join(problems),
                                     hint="use --no-strict to skip missing/unexpected keys, --strip-prefix for wrapper prefixes")
    loaded = 0
    have = _broadcast_object(set(src.keys()) if src else None)
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = [(prefix + n, p) for n, p in mod.named_parameters(recurse=False) if prefix + n in have]
        if params:
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                for name, p in params:
                    if eng.rank() == 0:
                        with torch.no_grad():
                            p.data.copy_(src.get(name).to(p.dtype).view(p.shape))
                    if not hasattr(p, "ds_id") and eng.world_size() > 1:
                        dist.broadcast(p.data, 0)  # stages 0-2: replicate rank 0's values
                    loaded += 1
        for n, b in mod.named_buffers(recurse=False):
            name = prefix + n
            if b is None or n in mod._non_persistent_buffers_set or name not in have:
                continue
            if eng.rank() == 0:
                b.data.copy_(src.get(name).to(b.dtype).view(b.shape))
            if eng.world_size() > 1:
                dist.broadcast(b.data, 0)  # GatheredParameters does not cover buffers
            loaded += 1
        if progress:
            progress(1)
    _set_fp32_masters(engine, src, have)
    return {"loaded": loaded, "expected": len(expected)}


def _set_fp32_masters(engine, src: WeightsFile | None, have: set[str]) -> None:
    """Make the optimizer's fp32 masters hold the file's values (else step() reverts the load)."""
    opt = engine.optimizer
    if opt is None:
        return
    sixteen_bit = any(p.dtype in (torch.float16, torch.bfloat16) for p in engine.module.parameters())
    if sixteen_bit:
        from deepspeed.utils import safe_set_full_fp32_param

        for name, p in engine.module.named_parameters():
            if not p.requires_grad or name not in have:
                continue
            full = src.get(name).to(torch.float32).reshape(getattr(p, "ds_shape", p.shape)).contiguous() if src else \
                torch.empty(tuple(getattr(p, "ds_shape", p.shape)), dtype=torch.float32)
            if eng.world_size() > 1:
                dist.broadcast(full, 0)
            safe_set_full_fp32_param(p, full)
    elif hasattr(opt, "refresh_fp32_params"):
        opt.refresh_fp32_params()
