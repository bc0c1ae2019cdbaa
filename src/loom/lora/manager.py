"""Multi-LoRA serving: adapters in host memory, a pool of device slots, and the layers that add
each token's adapter update to the base projections.

- Every adapter named by ``--lora-paths`` is read once into host memory (``adapter.py``).
- The device holds ``--max-loras-per-batch`` slots. A slot stores one adapter's A and B for every
  layer's packed projections (qkv, o, gate_up, down), zero-padded to the pool's rank, so one
  matmul per slot covers all of a packed module's slices. ``B`` is block-diagonal over the
  slices: rows of q take only the q columns of ``A x``, and so on.
- The scheduler ``acquire``s a slot when it admits a request and ``release``s it when the request
  leaves the running set (finished, aborted, retracted). A request whose adapter has no slot and
  no free or idle one to take waits in the queue. An idle adapter (no running request) keeps its
  slot until the ``lora_eviction_policy`` picks it to make room.
- Before each forward the runner hands the batch's per-token slots to ``set_batch``, which the
  ``lora_backend`` member turns into its batch description once; every wrapped projection then
  adds each token's ``B_s (A_s x)`` through that member (``backends.py``: Triton kernels over
  all adapters at once, or a matmul pair per adapter in torch).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loom import plugins
from loom.lora.adapter import MODULE_SLICES, LoRAAdapter, load_adapter

logger = logging.getLogger(__name__)

# Loom's packed projections and the PEFT modules that are their slices, in output order.
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _slice_sizes(module: nn.Module, packed: str) -> list[int]:
    if packed == "qkv_proj":
        return [module.q_size, module.kv_size, module.kv_size]
    if packed == "gate_up_proj":
        return list(module.output_sizes)
    return [module.output_size]


class LoRALinear(nn.Module):
    """A packed projection plus the running batch's adapter updates."""

    def __init__(self, base: nn.Module, manager: LoRAManager, layer: int, packed: str) -> None:
        super().__init__()
        self.base = base
        self.manager = manager
        self.layer = layer
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        m = self.manager
        if m.active is None:
            return y
        a_buf, b_buf = m.buffers[self.layer][self.packed]
        shape = y.shape
        y2 = m.backend.apply(
            x.reshape(-1, x.shape[-1]),
            y.reshape(-1, shape[-1]),
            a_buf,
            b_buf,
            m.sizes[self.packed][1],
            m.active,
        )
        return y2.reshape(shape)


_TARGETS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
            ("mlp", "down_proj"))  # fmt: skip


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers adapters apply to, or a ValueError naming what the model lacks: each
    layer's attention and dense MLP projections (Loom's own implementations of dense
    architectures have them; mixture-of-experts layers and the transformers fallback do not)."""
    name = type(model).__name__
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"LoRA adapters need Loom's own implementation of the model; {name} has no decoder "
            "layers Loom can wrap (--model-impl transformers does not serve adapters)"
        )
    for i, layer in enumerate(layers):
        for parent, packed in _TARGETS:
            if not hasattr(getattr(layer, parent, None), packed):
                raise ValueError(
                    f"LoRA adapters are not supported on {name}: layer {i} has no "
                    f"{parent}.{packed} (adapters apply to dense attention and MLP projections)"
                )
    return list(layers)


class LoRAManager:
    def __init__(self, model: nn.Module, args, device: torch.device, dtype: torch.dtype) -> None:
        """``args``: the LoRA section of the server arguments (``LoRAArgs``)."""
        from loom.distributed import get_tp_size
        from loom.lora.adapter import parse_lora_paths

        if get_tp_size() > 1:
            raise ValueError("LoRA serving with tensor parallelism is not supported yet")
        self.device, self.dtype = device, dtype
        self.num_slots = args.max_loras_per_batch  # (LoRAArgs checked it is >= 1)
        self.adapters: dict[str, LoRAAdapter] = {
            name: load_adapter(name, path)
            for name, path in parse_lora_paths(args.lora_paths).items()
        }
        ranks = [a.rank for a in self.adapters.values()]
        self.max_rank = args.max_lora_rank or max(ranks, default=16)
        layers = _lora_layers(model)
        self.num_layers = len(layers)
        # wrap each layer's packed projections
        self.sizes: dict[str, tuple[int, list[int]]] = {}
        for i, layer in enumerate(layers):
            for packed, parent in (
                ("qkv_proj", layer.self_attn),
                ("o_proj", layer.self_attn),
                ("gate_up_proj", layer.mlp),
                ("down_proj", layer.mlp),
            ):
                base = getattr(parent, packed)
                self.sizes[packed] = (base.input_size, _slice_sizes(base, packed))
                setattr(parent, packed, LoRALinear(base, self, i, packed))
        for adapter in self.adapters.values():
            self._check(adapter)
        r = self.max_rank
        self.buffers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(self.num_layers):
            per = {}
            for packed, (n_in, outs) in self.sizes.items():
                k = len(outs) * r
                per[packed] = (
                    torch.zeros(self.num_slots, k, n_in, device=device, dtype=dtype),
                    torch.zeros(self.num_slots, sum(outs), k, device=device, dtype=dtype),
                )
            self.buffers.append(per)
        self.slot_names: list[str | None] = [None] * self.num_slots
        self.refs: dict[str, int] = {}
        self.policy = plugins.resolve("lora_eviction_policy", args.lora_eviction_policy)()
        self.backend = plugins.resolve("lora_backend", args.lora_backend)()
        self.active = None  # the lora_backend's description of the batch, or None: base model only
        self.num_slot_loads = 0

    # ---- adapters -------------------------------------------------------------------------

    def _check(self, adapter: LoRAAdapter) -> None:
        """The adapter must fit the model's shapes and the pool's rank."""
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank "
                f"{self.max_rank}"
            )
        for (layer, module), (a, b) in adapter.weights.items():
            if layer >= self.num_layers:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} has weights for layer {layer}; the model has "
                    f"{self.num_layers} layers"
                )
            packed, j = MODULE_SLICES[module]
            n_in, outs = self.sizes[packed]
            if a.shape[1] != n_in or b.shape[0] != outs[j]:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r}: layer {layer} {module} is "
                    f"{b.shape[0]}x{a.shape[1]}, the model's is {outs[j]}x{n_in}"
                )

    def add(self, name: str, path: str) -> None:
        """Register an adapter while serving (checked as at start-up; the pool's rank is
        fixed, so a larger rank is refused)."""
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path)
        self._check(adapter)
        self.adapters[name] = adapter

    def remove(self, name: str) -> None:
        """Forget an adapter no request holds, freeing its slot."""
        if self.refs.get(name):
            raise RuntimeError(f"LoRA adapter {name!r} is held by running requests")
        del self.adapters[name]
        self.refs.pop(name, None)
        if name in self.slot_names:
            self.slot_names[self.slot_names.index(name)] = None
            self.policy.remove(name)

    def cache_namespace(self, name: str, extra_key: str | None) -> str:
        """The prefix-cache namespace of a request on adapter ``name``: the adapter's content
        digest (not its name: the hierarchical cache's storage outlives the process, and a name
        may come back with other weights), then the request's own key."""
        key = f"lora:{self.adapters[name].digest}"
        return key if extra_key is None else f"{key}\x00{extra_key}"

    def has(self, name: str) -> bool:
        return name in self.adapters

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    # ---- slots ----------------------------------------------------------------------------

    def slot_of(self, name: str) -> int:
        return self.slot_names.index(name)

    def acquire(self, name: str) -> bool:
        """Count one more running request on ``name``, bringing it into a slot if needed: a free
        slot, else an idle adapter's (the eviction policy's pick). False when every slot holds
        an adapter in use: the request waits."""
        if name in self.slot_names:
            self.refs[name] = self.refs.get(name, 0) + 1
            self.policy.mark_used(name)
            return True
        if None in self.slot_names:
            slot = self.slot_names.index(None)
        else:
            idle = [n for n in self.slot_names if n is not None and not self.refs.get(n)]
            if not idle:
                return False
            victim = self.policy.select_victim(idle)
            if victim not in idle:
                raise RuntimeError(f"lora eviction policy chose {victim!r}, not one of {idle}")
            slot = self.slot_names.index(victim)
            self.policy.remove(victim)
            self.refs.pop(victim, None)
        self._load(slot, self.adapters[name])
        self.slot_names[slot] = name
        self.refs[name] = 1
        self.policy.mark_used(name)
        return True

    def release(self, name: str) -> None:
        left = self.refs.get(name, 0) - 1
        if left < 0:
            raise RuntimeError(f"LoRA adapter {name!r} released more often than acquired")
        self.refs[name] = left

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write the adapter into ``slot``: each module's A rows and B block at its slice's
        place, zeros elsewhere (padding to the pool's rank, untargeted modules)."""
        r = self.max_rank
        for layer in range(self.num_layers):
            for packed, (a_buf, b_buf) in self.buffers[layer].items():
                a_buf[slot].zero_()
                b_buf[slot].zero_()
                outs = self.sizes[packed][1]
                for j, module in enumerate(PACKED[packed]):
                    w = adapter.weights.get((layer, module))
                    if w is None:
                        continue
                    a, b = w
                    k = a.shape[0]
                    row = sum(outs[:j])
                    a_buf[slot, j * r : j * r + k].copy_(a)
                    b_buf[slot, row : row + outs[j], j * r : j * r + k].copy_(b)
        self.num_slot_loads += 1
        logger.info("LoRA adapter %r loaded into slot %d", adapter.name, slot)

    # ---- batches --------------------------------------------------------------------------

    def set_batch(self, slots: list[int], counts: list[int] | None = None) -> None:
        """Each request's slot (-1: no adapter) for a forward whose tokens are the requests'
        ``counts`` tokens in order (None: one token each). All -1: the base model only."""
        if max(slots, default=-1) < 0:
            self.active = None
            return
        per_token = (
            list(slots)
            if counts is None
            else [s for s, n in zip(slots, counts, strict=True) for _ in range(n)]
        )
        self.active = self.backend.prepare(per_token, self.device)

    def clear_batch(self) -> None:
        self.active = None
