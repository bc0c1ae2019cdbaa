"""The overlapped adapter loader (the seed's LoRAOverlapLoader) and the host tier.

- Disk to host runs on a background thread: the checkpoint is read, checked against the model,
  hashed and laid out as one slot row (``pool.PoolLayout.host_row``; page-locked on CUDA).
  The scheduler loop only collects finished reads (``poll``), so a load never stalls it.
- The host tier holds at most ``max_loaded`` rows (None: every registered adapter). A new row
  past the cap evicts one by the ``lora_eviction_policy``, preferring rows no waiting request
  asked for; an evicted adapter is read again from disk when a request needs it, and must
  still have the digest it was registered with.
- Host to device is one copy per adapter from the pinned row into its slot's row, on a side
  stream that first waits for the work already queued on the compute stream (an in-flight
  step may still read the slot's previous adapter). An event marks the copy's end; the slot's
  requests are admitted only once it has passed, while the rest of the batch runs. Without
  CUDA the copy is synchronous.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from loom import plugins
from loom.lora.adapter import LoRAAdapter, load_adapter
from loom.lora.pool import PoolLayout
from loom.lora.registry import LoRARef

logger = logging.getLogger(__name__)


def _one_thread() -> None:
    """The reader's torch ops run on its own thread alone: with an OpenMP team of its own, every
    forward of the scheduler's thread afterwards ran 1.5x slower on the 2-core CPU machine
    (SmolLM2, 128-token prefill: 119 ms before the first read, 174 ms after)."""
    torch.set_num_threads(1)


@dataclass
class Read:
    """A finished disk read: the adapter's facts and its host row, or why it failed."""

    ref: LoRARef
    purpose: object  # what asked: a load message's id, or None for a host-tier miss
    adapter: LoRAAdapter | None = None
    row: torch.Tensor | None = None
    error: str | None = None


class LoRAOverlapLoader:
    def __init__(
        self,
        layout: PoolLayout,
        check: Callable[[LoRAAdapter], None],
        device: torch.device,
        dtype: torch.dtype,
        max_loaded: int | None,
        policy: str,
    ) -> None:
        self.layout, self.check, self.device, self.dtype = layout, check, device, dtype
        self.max_loaded = max_loaded
        self.pin = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}  # lora_id -> host row
        self.policy = plugins.resolve("lora_eviction_policy", policy)()
        self.wanted: set[str] = set()  # ids a waiting request asked for while not on the host
        self._threads = ThreadPoolExecutor(
            1, thread_name_prefix="loom-lora-read", initializer=_one_thread
        )
        self._reads: list[tuple[Future, LoRARef, object]] = []
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # slot -> (event, row): copies in flight (the row stays alive until the copy ends)
        self.copying: dict[int, tuple[torch.cuda.Event, torch.Tensor]] = {}
        self.num_disk_reads = 0

    # ---- disk to host ---------------------------------------------------------------------

    def read(self, ref: LoRARef) -> tuple[LoRAAdapter, torch.Tensor]:
        """Read, check and lay out an adapter (on the reader thread)."""
        adapter = load_adapter(ref.lora_name, ref.lora_path)
        self.check(adapter)
        self.num_disk_reads += 1
        return adapter, self.layout.host_row(adapter, self.dtype, self.pin)

    def read_async(self, ref: LoRARef) -> Future:
        """``read`` on the background thread."""
        return self._threads.submit(self.read, ref)

    def submit(self, ref: LoRARef, purpose: object) -> None:
        """Start reading ``ref`` on the background thread; ``poll`` returns it when done."""
        self._reads.append((self.read_async(ref), ref, purpose))

    def reading(self, lora_id: str) -> bool:
        return any(ref.lora_id == lora_id for _, ref, _ in self._reads)

    @property
    def busy(self) -> bool:
        return bool(self._reads)

    def poll(self) -> list[Read]:
        """The reads finished since the last call, in the order they were submitted."""
        done: list[Read] = []
        while self._reads and self._reads[0][0].done():
            fut, ref, purpose = self._reads.pop(0)
            try:
                adapter, row = fut.result()
                done.append(Read(ref, purpose, adapter, row))
            except ValueError as e:
                done.append(Read(ref, purpose, error=str(e)))
            except Exception as e:  # noqa: BLE001 - a failed read ends only its own load
                logger.exception("reading LoRA adapter %r failed", ref.lora_name)
                error = f"LoRA adapter {ref.lora_name!r}: {type(e).__name__}: {e}"
                done.append(Read(ref, purpose, error=error))
        return done

    def keep(self, lora_id: str, row: torch.Tensor) -> None:
        """Put a row in the host tier, evicting past ``max_loaded``."""
        self.host[lora_id] = row
        self.wanted.discard(lora_id)
        self.policy.mark_used(lora_id)
        while self.max_loaded is not None and len(self.host) > self.max_loaded:
            others = [i for i in self.host if i != lora_id]
            unwanted = [i for i in others if i not in self.wanted]
            candidates = unwanted or others
            if not candidates:
                break
            victim = self.policy.select_victim(candidates)
            if victim not in candidates:
                raise RuntimeError(f"lora eviction policy chose {victim!r}, not a candidate")
            self.drop(victim)
            logger.info("LoRA adapter %s left host memory (--max-loaded-loras)", victim)

    def drop(self, lora_id: str) -> None:
        if self.host.pop(lora_id, None) is not None:
            self.policy.remove(lora_id)

    # ---- host to device -------------------------------------------------------------------

    def copy_to_slot(self, pool: torch.Tensor, slot: int, row: torch.Tensor) -> bool:
        """Copy a host row into ``pool[slot]``; True when it is already there (no CUDA)."""
        if self._stream is None:
            pool[slot].copy_(row)
            return True
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            pool[slot].copy_(row, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self.copying[slot] = (event, row)
        return False

    def slot_ready(self, slot: int) -> bool:
        """Whether no copy into ``slot`` is in flight."""
        pending = self.copying.get(slot)
        if pending is None:
            return True
        if not pending[0].query():
            return False
        del self.copying[slot]
        return True

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
