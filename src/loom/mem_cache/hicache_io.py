"""Moving KV between the hierarchical cache's tiers: device <-> host copies (``KVTransfer``, on a
side stream on CUDA) and the background thread that writes host backups to the storage tier
(``StorageWriter``), with the tiers' hit counters (``HiCacheStats``)."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from loom.mem_cache.base import HiCacheStorage

logger = logging.getLogger(__name__)


class KVTransfer:
    """Copies KV between device slots of a ``KVPool`` and host tensors."""

    def __init__(self, kv_pool) -> None:
        self.pool = kv_pool
        self.device = kv_pool.k_buffers[0].device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        ks, vs = self.pool.copy_buffers()
        return torch.stack(
            [
                torch.stack([k.index_select(0, idx), v.index_select(0, idx)])
                for k, v in zip(ks, vs, strict=True)
            ]
        )

    def to_host(self, slots: list[int]) -> tuple[torch.Tensor, Any]:
        """A host copy of ``slots`` and an event that completes with it (None on CPU)."""
        if not self.cuda:
            return self._gather(torch.tensor(slots, dtype=torch.int64)), None
        ready = torch.cuda.Event()
        ready.record()  # the KV was written by work queued so far on the compute stream
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            idx = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
            staged = self._gather(idx)
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    def to_device(self, host: torch.Tensor, slots: list[int], pending: Any = None) -> None:
        """Write ``host`` into device ``slots``; later device work waits for it."""
        ks, vs = self.pool.copy_buffers()
        if not self.cuda:
            idx = torch.tensor(slots, dtype=torch.int64)
            for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
                k.index_copy_(0, idx, host[layer, 0].to(k.dtype))
                v.index_copy_(0, idx, host[layer, 1].to(v.dtype))
            return
        with torch.cuda.stream(self.stream):
            if pending is not None:
                self.stream.wait_event(pending)  # the host copy itself may still be arriving
            idx = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
            dev = host.to(self.device, non_blocking=True)
            for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
                k.index_copy_(0, idx, dev[layer, 0])
                v.index_copy_(0, idx, dev[layer, 1])
            done = torch.cuda.Event()
            done.record(self.stream)
        torch.cuda.current_stream().wait_event(done)


@dataclass
class HiCacheStats:
    host_hit_tokens: int = 0  # loaded back from host memory
    storage_hit_tokens: int = 0  # loaded from the storage tier
    backup_tokens: int = 0  # copied device -> host
    storage_write_pages: int = 0
    storage_failures: int = 0


class StorageWriter:
    """Writes host-backed pages to the storage tier in a background thread."""

    def __init__(self, storage: HiCacheStorage, page_size: int, stats: HiCacheStats) -> None:
        self.storage = storage
        self.page_size = page_size
        self.stats = stats
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="loom-hicache-writer", daemon=True)
        self.thread.start()

    def submit(self, keys: list[str], host: torch.Tensor, event: Any) -> None:
        self.q.put((keys, host, event))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                keys, host, event = item
                if event is not None:
                    event.synchronize()
                have = self.storage.exists(keys)
                todo = [i for i, h in enumerate(have) if not h]
                if todo:
                    ps = self.page_size
                    pages = [host[:, :, i * ps : (i + 1) * ps] for i in todo]
                    ok = self.storage.write([keys[i] for i in todo], pages)
                    self.stats.storage_write_pages += sum(ok)
            except Exception as e:  # noqa: BLE001 - a failing store costs hits, never requests
                self.stats.storage_failures += 1
                logger.warning("hicache storage write failed: %s", e)
            finally:
                self.q.task_done()

    def drain(self) -> None:
        self.q.join()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=30)
