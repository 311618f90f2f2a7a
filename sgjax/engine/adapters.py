"""Multi-LoRA serving (SGLang's --enable-lora): the adapters loaded by name, and the device slots a step reads.

Adapters live on the host once loaded (model/lora.py Adapter); `--max-loras-per-batch` slots on the device hold the
ones running requests use (model/lora.py LoraStacks). A request takes its adapter's slot when it is admitted, and
gives it back when it finishes, is aborted or is retracted; an adapter not in a slot is written into one no running
request uses (the least recently used), and a request whose adapter finds no such slot waits in the queue. Each
request's KV is keyed by its adapter in the radix cache (its `extra_key`): two adapters never share a prefix, and an
adapter loaded again under the same name is another key.

Loading and unloading run on the engine thread between steps (Engine.load_lora_adapter); requests resolve their
adapter's name on the caller's thread (`resolve`), and an adapter unloaded meanwhile still serves the requests that
named it before.
"""

from __future__ import annotations

import itertools
import threading

import jax
import numpy as np

from sgjax.errors import RequestError
from sgjax.model import lora as lora_mod
from sgjax.model.config import ModelConfig

_uses = itertools.count(1)


def parse_lora_paths(items) -> dict[str, str]:
    """SGLang's --lora-paths: `name=path` or a bare path (named after its directory)."""
    out = {}
    for item in items or ():
        name, sep, path = str(item).partition("=")
        if not sep:
            path = name
            name = path.rstrip("/").rsplit("/", 1)[-1]
        if not name or not path:
            raise ValueError(f"--lora-paths: {item!r} is not name=path")
        out[name] = path
    return out


class Adapters:
    def __init__(self, cfg: ModelConfig, args, place=jax.device_put):
        """args: ServerArgs (enable_lora, lora_paths, max_loras_per_batch, max_lora_rank, lora_target_modules);
        place: how an array reaches the step's devices (replicated over a mesh)."""
        self.cfg = cfg
        self.loaded: dict[str, lora_mod.Adapter] = {}
        self._lock = threading.Lock()
        initial = [lora_mod.read_peft(p, cfg, n) for n, p in parse_lora_paths(args.lora_paths).items()]
        targets = args.lora_target_modules or sorted({m for a in initial for m in a.modules}) or list(lora_mod.MODULES)
        if list(targets) == ["all"]:
            targets = list(lora_mod.MODULES)
        unknown = sorted(set(targets) - set(lora_mod.MODULES))
        if unknown:
            raise ValueError(f"--lora-target-modules: {unknown}; LoRA is served on {list(lora_mod.MODULES)}")
        self.targets = tuple(m for m in lora_mod.MODULES if m in targets)
        self.rank = args.max_lora_rank or max((a.rank for a in initial), default=16)
        self.num_slots = args.max_loras_per_batch
        if self.num_slots < 1:
            raise ValueError("--max-loras-per-batch must be at least 1")
        self.stacks = jax.tree.map(
            place, lora_mod.empty_stacks(cfg, self.targets, self.num_slots, self.rank, cfg.dtype)
        )
        self.resident: list[lora_mod.Adapter | None] = [None] * self.num_slots
        self.pins = [0] * self.num_slots
        self.last_use = [0] * self.num_slots
        self.swaps = 0  # adapters written into a slot
        for adapter in initial:
            self.add(adapter)

    # -- the registry (any thread) --------------------------------------------------------------------------
    def add(self, adapter: lora_mod.Adapter) -> None:
        """Serve `adapter` under its name from now on (refused if it does not fit the slots)."""
        if adapter.rank > self.rank:
            raise lora_mod.AdapterError(f"{adapter.path}: rank {adapter.rank} is above --max-lora-rank {self.rank}")
        extra = sorted(set(adapter.modules) - set(self.targets))
        if extra:
            raise lora_mod.AdapterError(
                f"{adapter.path}: targets {extra}, outside --lora-target-modules {list(self.targets)}"
            )
        with self._lock:
            if adapter.name in self.loaded:
                raise lora_mod.AdapterError(f"an adapter named {adapter.name!r} is already loaded")
            self.loaded[adapter.name] = adapter

    def remove(self, name: str) -> None:
        with self._lock:
            if self.loaded.pop(name, None) is None:
                raise lora_mod.AdapterError(f"no adapter named {name!r} is loaded")

    def resolve(self, name) -> lora_mod.Adapter | None:
        """The adapter a request names (None: the base model); an unknown name is a 400 naming lora_path."""
        if name is None or name == "":
            return None
        adapter = self.loaded.get(name) if isinstance(name, str) else None
        if adapter is None:
            raise RequestError(
                f"lora_path: no adapter named {name!r} is loaded (loaded: {sorted(self.loaded)})", "lora_path"
            )
        return adapter

    def names(self) -> list[str]:
        return sorted(self.loaded)

    # -- slots (the engine thread) ----------------------------------------------------------------------------
    def acquire(self, req) -> bool:
        """Give the request its adapter's slot (writing the adapter into a free one if it is in none); False when
        every slot holds an adapter some running request uses (the request waits)."""
        adapter = req.adapter
        if adapter is None:
            req.lora_slot = -1
            return True
        slot = next((i for i, a in enumerate(self.resident) if a is adapter), None)
        if slot is None:
            free = [i for i in range(self.num_slots) if self.pins[i] == 0]
            if not free:
                return False
            slot = min(free, key=lambda i: (self.resident[i] is not None, self.last_use[i]))
            a, b = lora_mod.slot_values(self.stacks, adapter)
            self.stacks = lora_mod.write_slot(self.stacks, np.int32(slot), a, b)
            self.resident[slot] = adapter
            self.swaps += 1
        self.pins[slot] += 1
        self.last_use[slot] = next(_uses)
        req.lora_slot = slot
        return True

    def release(self, req) -> None:
        if req.lora_slot >= 0:
            self.pins[req.lora_slot] -= 1
            req.lora_slot = -1

    def report(self) -> dict:
        return {
            "lora_adapters": self.names(),
            "lora_slots": [None if a is None else a.name for a in self.resident],
            "lora_swaps": self.swaps,
        }


def check_lora_args(args, cfg: ModelConfig, run_cfg: ModelConfig) -> bool:
    """Whether the engine serves adapters (--enable-lora or --lora-paths), refusing by name what it cannot serve them
    with."""
    if not (args.enable_lora or args.lora_paths):
        for name in ("max_lora_rank", "lora_target_modules", "max_loaded_loras"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --enable-lora")
        return False
    if args.speculative_algorithm:
        raise ValueError("--enable-lora with --speculative-algorithm is not supported (drafts would need adapters)")
    if args.nnodes > 1:
        raise ValueError("--enable-lora across hosts (--nnodes > 1) is not supported")
    if cfg.is_moe:
        raise ValueError(f"--enable-lora: {cfg.architecture} is a mixture of experts; LoRA is served on dense models")
    if run_cfg.num_kv_heads != cfg.num_kv_heads:
        raise ValueError(
            f"--enable-lora with --tp-size above the model's {cfg.num_kv_heads} KV heads (replicated heads) "
            "is not supported"
        )
    return True


class LoraControl:
    """The Engine's LoRA methods (SGLang's names); the state they read (adapters, args, model_config) is the
    Engine's (engine/engine.py)."""

    adapters: Adapters | None = None

    def _start_lora(self, args, cfg: ModelConfig, run_cfg: ModelConfig, place) -> None:
        if check_lora_args(args, cfg, run_cfg):
            self.adapters = Adapters(cfg, args, place)
            self.runner.enable_lora(self.adapters)
            self.scheduler.adapters = self.adapters

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Serve the HF PEFT adapter at `lora_path` under `lora_name` from now on (read on the caller's thread)."""
        adapters = self._lora("lora_name")
        limit = self.args.max_loaded_loras
        if limit is not None and len(adapters.loaded) >= limit:
            raise RequestError(f"lora_name: {limit} adapters are loaded (--max-loaded-loras)", "lora_name")
        try:
            adapters.add(lora_mod.read_peft(lora_path, self.model_config, lora_name))
        except (OSError, ValueError) as e:
            raise RequestError(f"lora_path: {e}", "lora_path") from e
        return self.lora_adapters()

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Stop serving `lora_name` (requests that named it before finish with it)."""
        try:
            self._lora("lora_name").remove(lora_name)
        except lora_mod.AdapterError as e:
            raise RequestError(f"lora_name: {e}", "lora_name") from e
        return self.lora_adapters()

    def lora_adapters(self) -> dict[str, str]:
        """The adapters served: name -> path."""
        adapters = self._lora("lora_name")
        return {name: adapters.loaded[name].path for name in adapters.names()}

    def _lora(self, field: str) -> Adapters:
        if self.adapters is None:
            raise RequestError(f"{field}: this engine serves no LoRA adapters (start it with --enable-lora)", field)
        return self.adapters
