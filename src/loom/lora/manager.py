"""Multi-LoRA serving: the adapters the scheduler knows, a pool of device slots, and the layers
that add each token's adapter update to the base projections.

- Adapters are known by id (``registry.LoRARef``). The ``--lora-paths`` ones are read at start
  (they size the pool: its rank, and its target modules unless ``--lora-target-modules`` says);
  the others are read on the loader's thread when loaded while serving (``loader.py``), and
  kept in host memory as slot rows up to ``--max-loaded-loras``.
- The device holds ``--max-loras-per-batch`` slots, each one flat row of ``pool.PoolLayout``:
  every layer's targeted packed projections' A and B.
- The scheduler ``acquire``s a slot when it admits a request and ``release``s it when the request
  leaves the running set (finished, aborted, retracted). A request whose adapter is on its way
  (from disk, or being copied into its slot) waits while the others run; one whose adapter finds
  every slot held by adapters in use waits until one is idle. An idle adapter keeps its slot
  until the ``lora_eviction_policy`` picks it to make room; a pinned one keeps it for good.
- Before each forward the runner hands the batch's per-token slots to ``set_batch``, which the
  ``lora_backend`` member turns into its batch description once; every wrapped projection then
  adds each token's ``B_s (A_s x)`` through that member (``backends.py``: Triton kernels over
  all adapters at once, or a matmul pair per adapter in torch).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from loom import plugins
from loom.distributed import tp_all_reduce
from loom.lora.adapter import MODULE_SLICES, LoRAAdapter
from loom.lora.loader import LoRAOverlapLoader
from loom.lora.pool import PACKED, PoolLayout
from loom.lora.registry import LoRARef, parse_lora_paths
from loom.lora.shard import ModuleShard, module_shard

logger = logging.getLogger(__name__)


class LoRALinear(nn.Module):
    """A packed projection plus the running batch's adapter updates. A row-parallel projection
    split over ranks adds its update to the partial sums before their all-reduce
    (``shard.py``)."""

    def __init__(self, base: nn.Module, manager: LoRAManager, layer: int, packed: str) -> None:
        super().__init__()
        self.base = base
        self.manager = manager
        self.layer = layer
        self.packed = packed
        self.reduce = (
            manager.shards[packed].row_parallel and base.tp_size > 1 and base.reduce_results
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.manager
        if m.active is None:
            return self.base(x)
        base = self.base
        y = base.matmul(x, None) if self.reduce else base(x)
        a_buf, b_buf = m.buffers[self.layer][self.packed]
        shape = y.shape
        y = m.backend.apply(
            x.reshape(-1, x.shape[-1]),
            y.reshape(-1, shape[-1]),
            a_buf,
            b_buf,
            m.sizes[self.packed][1],
            m.active,
        ).reshape(shape)
        if self.reduce:
            y = tp_all_reduce(y)
            if base.bias is not None:
                y = y + base.bias
        return y


_TARGETS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
            ("mlp", "down_proj"))  # fmt: skip


def _lora_layers(model: nn.Module, packed_targets: list[str]) -> list[nn.Module]:
    """The decoder layers adapters apply to, or a ValueError naming what the model lacks: each
    layer's targeted attention and dense MLP projections (Loom's own implementations of dense
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
            if packed in packed_targets and not hasattr(getattr(layer, parent, None), packed):
                raise ValueError(
                    f"LoRA adapters are not supported on {name}: layer {i} has no "
                    f"{parent}.{packed} (adapters apply to dense attention and MLP projections)"
                )
    return list(layers)


def target_modules(flag, adapters: list[LoRAAdapter]) -> set[str]:
    """The PEFT modules the pool serves: ``--lora-target-modules`` (PEFT names, Loom's packed
    names, or ``all``), else every module a start-up adapter targets, else all of them."""
    if flag:
        out: set[str] = set()
        for name in flag:
            if name == "all":
                out |= set(MODULE_SLICES)
            elif name in PACKED:
                out |= set(PACKED[name])
            elif name in MODULE_SLICES:
                out.add(name)
            else:
                known = ", ".join([*MODULE_SLICES, *PACKED, "all"])
                raise ValueError(f"--lora-target-modules: unknown module {name!r}; known: {known}")
        return out
    if adapters:
        return set().union(*(a.target_modules for a in adapters))
    return set(MODULE_SLICES)


class LoRAManager:
    def __init__(self, model: nn.Module, args, device: torch.device, dtype: torch.dtype) -> None:
        """``args``: the LoRA section of the server arguments (``LoRAArgs``). The start-up
        adapters are read here, on the calling thread: they size the pool (rank, targets)."""
        from loom.lora.adapter import load_adapter

        self.device, self.dtype = device, dtype
        self.num_slots = args.max_loras_per_batch  # (LoRAArgs checked it is >= 1)
        startup = parse_lora_paths(args.lora_paths)
        adapters = [load_adapter(r.lora_name, r.lora_path) for r in startup]
        self.max_rank = args.max_lora_rank or max((a.rank for a in adapters), default=16)
        self.targets = target_modules(args.lora_target_modules, adapters)
        packed_targets = [p for p in PACKED if any(m in self.targets for m in PACKED[p])]
        layers = _lora_layers(model, packed_targets)
        self.num_layers = len(layers)
        self.shards: dict[str, ModuleShard] = {}
        for parent_name, packed in _TARGETS:
            if packed in packed_targets:
                self.shards[packed] = module_shard(
                    getattr(getattr(layers[0], parent_name), packed), packed
                )
        for i, layer in enumerate(layers):
            for parent_name, packed in _TARGETS:
                if packed in packed_targets:
                    parent = getattr(layer, parent_name)
                    setattr(parent, packed, LoRALinear(getattr(parent, packed), self, i, packed))
        self.layout = PoolLayout(self.num_layers, self.shards, self.max_rank)
        self.sizes = self.layout.sizes  # this rank's (input size, slice output sizes)
        self.pool = torch.zeros(self.num_slots, self.layout.numel, device=device, dtype=dtype)
        self.buffers = self.layout.views(self.pool)
        self.loader = LoRAOverlapLoader(
            self.layout,
            self._check,
            device,
            dtype,
            args.max_loaded_loras,
            args.lora_eviction_policy,
        )
        self.infos: dict[str, LoRARef] = {}  # lora_id -> reference, for every registered adapter
        self.digests: dict[str, str] = {}  # lora_id -> the checkpoint's digest when registered
        self.slot_ids: list[str | None] = [None] * self.num_slots
        self.refs: dict[str, int] = {}  # lora_id -> running requests
        self.policy = plugins.resolve("lora_eviction_policy", args.lora_eviction_policy)()
        self.backend = plugins.resolve("lora_backend", args.lora_backend)()
        self.active = None  # the lora_backend's description of the batch, or None: base model only
        self.failed: dict[str, str] = {}  # lora_id -> why its last read from disk failed
        self.num_slot_loads = 0
        # rank 0 of several: hands slot writes to the other ranks (``tp.LoRAMirror``)
        self.mirror = None
        self._mirror_reads: dict = {}  # another rank's: lora_id -> its read in flight
        for ref, adapter in zip(startup, adapters, strict=True):
            self._check(adapter)
            self._register(
                ref, adapter.digest, self.layout.host_row(adapter, dtype, self.loader.pin)
            )
        self.loader.num_disk_reads = len(adapters)

    # ---- adapters -------------------------------------------------------------------------

    def _check(self, adapter: LoRAAdapter) -> None:
        """The adapter must fit the model's shapes, the pool's rank and its target modules."""
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank "
                f"{self.max_rank}"
            )
        outside = sorted(adapter.target_modules - self.targets)
        if outside:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} targets {', '.join(outside)}, outside the "
                f"adapter pool's modules ({', '.join(sorted(self.targets))}); start the server "
                "with --lora-target-modules naming them"
            )
        for (layer, module), (a, b) in adapter.weights.items():
            if layer >= self.num_layers:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} has weights for layer {layer}; the model has "
                    f"{self.num_layers} layers"
                )
            packed, j = MODULE_SLICES[module]
            n_in, outs = self.shards[packed].full_in, self.shards[packed].full_outs
            if a.shape[1] != n_in or b.shape[0] != outs[j]:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r}: layer {layer} {module} is "
                    f"{b.shape[0]}x{a.shape[1]}, the model's is {outs[j]}x{n_in}"
                )

    def _check_pin(self, ref: LoRARef) -> None:
        pinned = sum(r.pinned for r in self.infos.values()) + ref.pinned
        if ref.pinned and pinned > self.num_slots - 1:
            raise ValueError(
                f"LoRA adapter {ref.lora_name!r} cannot be pinned: at most "
                f"--max-loras-per-batch - 1 = {self.num_slots - 1} adapters may be pinned, so "
                "one slot stays for the others"
            )

    def _register(self, ref: LoRARef, digest: str, row: torch.Tensor) -> None:
        self._check_pin(ref)
        self.infos[ref.lora_id] = ref
        self.digests[ref.lora_id] = digest
        self.loader.keep(ref.lora_id, row)
        if ref.pinned:
            self._place(ref.lora_id)

    def start_load(self, ref: LoRARef, message_id: str) -> str | None:
        """Begin loading an adapter while serving: read on the loader's thread, registered by
        ``poll``, which answers ``message_id``. The error now, if it cannot start."""
        if ref.lora_id in self.infos or self.loader.reading(ref.lora_id):
            return f"LoRA adapter {ref.lora_name!r} is already loaded"
        try:
            self._check_pin(ref)
        except ValueError as e:
            return str(e)
        self._submit(ref, message_id)
        return None

    def _submit(self, ref: LoRARef, purpose) -> None:
        self.loader.submit(ref, purpose)
        if self.mirror is not None:
            self.mirror.read(ref)

    def poll(self) -> list[tuple[str, str | None]]:
        """Take the finished disk reads: register loaded adapters, put re-read ones back on the
        host. Returns (message id, error or None) for each finished load message."""
        replies = []
        for read in self.loader.poll():
            lora_id = read.ref.lora_id
            if read.purpose is not None:  # a load message
                error = read.error
                if error is None:
                    try:
                        self._register(read.ref, read.adapter.digest, read.row)
                    except ValueError as e:
                        error = str(e)
                replies.append((read.purpose, error))
                continue
            if lora_id not in self.infos:
                continue  # unloaded while it was read
            error = read.error
            if error is None and read.adapter.digest != self.digests[lora_id]:
                error = f"its files at {read.ref.lora_path!r} changed since it was loaded"
            if error is None:
                self.loader.keep(lora_id, read.row)
            else:
                self.failed[lora_id] = (
                    f"LoRA adapter {read.ref.lora_name!r} could not be read again: {error}"
                )
                self.loader.wanted.discard(lora_id)
        return replies

    def remove(self, lora_id: str) -> None:
        """Forget an adapter no request holds, freeing its slot."""
        if self.refs.get(lora_id):
            raise RuntimeError(f"LoRA adapter {self.infos[lora_id].lora_name!r} is in use")
        del self.infos[lora_id]
        self.digests.pop(lora_id, None)
        self.refs.pop(lora_id, None)
        self.failed.pop(lora_id, None)
        self.loader.drop(lora_id)
        self.loader.wanted.discard(lora_id)
        if self.mirror is not None:
            self.mirror.drop(lora_id)
        if lora_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(lora_id)] = None
            self.policy.remove(lora_id)

    def cache_namespace(self, lora_id: str, extra_key: str | None) -> str:
        """The prefix-cache namespace of a request on adapter ``lora_id``: the adapter's content
        digest (not its name: the hierarchical cache's storage outlives the process, and a name
        may come back with other weights), then the request's own key."""
        key = f"lora:{self.digests[lora_id]}"
        return key if extra_key is None else f"{key}\x00{extra_key}"

    def has(self, lora_id: str) -> bool:
        return lora_id in self.infos

    @property
    def names(self) -> list[str]:
        return sorted(r.lora_name for r in self.infos.values())

    def in_use(self, name: str) -> int:
        """Running requests on the adapter called ``name``."""
        return sum(n for i, n in self.refs.items() if self.infos[i].lora_name == name)

    # ---- slots ----------------------------------------------------------------------------

    def slot_of(self, lora_id: str) -> int:
        return self.slot_ids.index(lora_id)

    def _free_slot(self) -> int | None:
        """A slot to load into: an empty one, else an idle unpinned adapter's (the eviction
        policy's pick); None when every slot is busy, pinned or still being written."""
        ready = [s for s in range(self.num_slots) if s not in self.loader.copying]
        for s in ready:
            if self.slot_ids[s] is None:
                return s
        idle = [
            self.slot_ids[s]
            for s in ready
            if not self.refs.get(self.slot_ids[s]) and not self.infos[self.slot_ids[s]].pinned
        ]
        if not idle:
            return None
        victim = self.policy.select_victim(idle)
        if victim not in idle:
            raise RuntimeError(f"lora eviction policy chose {victim!r}, not one of {idle}")
        self.policy.remove(victim)
        self.refs.pop(victim, None)
        return self.slot_ids.index(victim)

    def _place(self, lora_id: str) -> bool | None:
        """Start writing an adapter into a slot: True when it is there (no CUDA), False while
        it is on its way, None when no slot can take it or its row must come from disk."""
        row = self.loader.host.get(lora_id)
        if row is None:
            if not self.loader.reading(lora_id):
                self._submit(self.infos[lora_id], None)
            self.loader.wanted.add(lora_id)
            return False
        slot = self._free_slot()
        if slot is None:
            return None
        self.slot_ids[slot] = lora_id
        self.num_slot_loads += 1
        logger.info("LoRA adapter %r loading into slot %d", self.infos[lora_id].lora_name, slot)
        if self.mirror is not None:
            self.mirror.write(slot, self.infos[lora_id], self.digests[lora_id])
        if self.infos[lora_id].pinned:
            self.loader.drop(lora_id)  # its slot is its home from now on
        return self.loader.copy_to_slot(self.pool, slot, row)

    def acquire(self, lora_id: str) -> str:
        """Count one more running request on the adapter if it is in a ready slot: ``"ready"``.
        ``"loading"``: it is on its way (from disk, or into its slot): ask again later.
        ``"busy"``: every slot is held by adapters in use. Raises ValueError when the adapter
        could not be read again from disk."""
        if lora_id in self.failed:
            raise ValueError(self.failed.pop(lora_id))
        if lora_id not in self.slot_ids:
            placed = self._place(lora_id)
            if placed is None:
                return "busy"
            if not placed:
                return "loading"
        if not self.loader.slot_ready(self.slot_of(lora_id)):
            return "loading"
        self.refs[lora_id] = self.refs.get(lora_id, 0) + 1
        self.policy.mark_used(lora_id)
        if lora_id in self.loader.host:
            self.loader.policy.mark_used(lora_id)
        return "ready"

    def release(self, lora_id: str) -> None:
        left = self.refs.get(lora_id, 0) - 1
        if left < 0:
            raise RuntimeError(f"LoRA adapter {lora_id!r} released more often than acquired")
        self.refs[lora_id] = left

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

    @contextlib.contextmanager
    def warmup_adapter(self):
        """A throwaway adapter of zeros in a free slot, for the start-up warm-up's requests (at
        most ``num_slots - 1`` adapters are pinned, so a slot is free before serving starts);
        yields its ref, and leaves no trace."""
        slot = self.slot_ids.index(None)
        ref = LoRARef("loom-warmup", "", False, "loom-warmup")
        self.infos[ref.lora_id], self.digests[ref.lora_id] = ref, "warmup"
        self.slot_ids[slot] = ref.lora_id
        self.pool[slot].zero_()
        if self.mirror is not None:
            self.mirror.zero(slot)
        try:
            yield ref
        finally:
            self.slot_ids[slot] = None
            for table in (self.infos, self.digests, self.refs):
                table.pop(ref.lora_id, None)
            self.policy.remove(ref.lora_id)

    # ---- another tensor-parallel rank's side of rank 0's slot writes ------------------------
    # Rank 0 schedules; these mirror its reads and slot writes on a worker rank, in the order
    # rank 0 sends them, so each slot holds this rank's shard of rank 0's adapter before the
    # forward that uses it. A start-up adapter is already in the host tier (every rank reads
    # ``--lora-paths`` the same way at start).

    def mirror_read(self, ref: LoRARef) -> None:
        """Start reading an adapter rank 0 reads, so its slot write finds it ready."""
        if ref.lora_id not in self.loader.host and ref.lora_id not in self._mirror_reads:
            self._mirror_reads[ref.lora_id] = self.loader.read_async(ref)

    def mirror_write(self, slot: int, ref: LoRARef, digest: str) -> None:
        """Write this rank's shard of adapter ``ref`` into ``slot``; its files must hold what
        rank 0 read (``digest``), else this rank fails and the server stops."""
        row = self.loader.host.get(ref.lora_id)
        if row is None:
            pending = self._mirror_reads.pop(ref.lora_id, None)
            adapter, row = pending.result() if pending is not None else self.loader.read(ref)
            if adapter.digest != digest:
                raise RuntimeError(
                    f"LoRA adapter {ref.lora_name!r}: the files at {ref.lora_path!r} differ from "
                    "those rank 0 read (changed since, or another copy on this host)"
                )
            self.loader.keep(ref.lora_id, row)
        self.slot_ids[slot] = ref.lora_id
        self.pool[slot].copy_(row)

    def mirror_drop(self, lora_id: str) -> None:
        self.loader.drop(lora_id)
        self._mirror_reads.pop(lora_id, None)

    def mirror_zero(self, slot: int) -> None:
        self.pool[slot].zero_()

    def close(self) -> None:
        self.loader.close()
