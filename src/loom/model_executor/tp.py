"""Tensor parallelism's processes: rank 0 is the scheduler's own ``ModelRunner``; every other rank
is a worker process holding its shards of the same model (its own KV pool and request-to-token
table, of the same shapes) that runs exactly the forwards rank 0 runs.

Rank 0 schedules, samples and keeps the caches alone. Before each call that runs the model
(``forward_extend``, ``forward_decode``, ``update_weights_from_disk``) it sends the call to the
workers (``TPLeader.send``): the host arguments pickled over the control group, then its tensors
(the previous step's samples still on the device, and for an extend the batch's rows of the
request-to-token table, which only rank 0's cache manager writes) broadcast over the data group.
Each worker applies the rows, makes the same call on its runner and drops the logits, which
``compute_logits`` has already gathered on every rank. So every rank runs the same kernels, CUDA
graphs included, in the same order.

Workers start as fresh interpreters (``subprocess``: the scheduler process may be a daemon,
which ``multiprocessing`` does not let have children) that die with their parent. A worker that
exits is noticed by rank 0's loop (``TPLeader.check``) and stops the server naming the rank; one
that hangs stops it when rank 0's next collective times out (``--dist-timeout``).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from loom.config import ServerArgs

logger = logging.getLogger(__name__)

CLOSE = "close"
PING = "ping"


@dataclass(frozen=True)
class _TensorRef:
    """A tensor argument's place in a sent call: it follows over the data group."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def local_ranks(args: ServerArgs) -> range:
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spawn_workers(args: ServerArgs, init_addr: str) -> dict[int, subprocess.Popen]:
    """This host's worker ranks (all but rank 0), each a fresh ``python`` running
    :func:`worker_main`."""
    procs = {}
    for rank in local_ranks(args):
        if rank == 0:
            continue
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys, pickle; from loom.model_executor.tp import "
             "worker_main; worker_main(*pickle.load(sys.stdin.buffer))"],
            stdin=subprocess.PIPE,
        )  # fmt: skip
        proc.stdin.write(pickle.dumps((args, rank, init_addr)))
        proc.stdin.close()
        procs[rank] = proc
    return procs


def check_tp_args(args: ServerArgs) -> None:
    """Refuse, naming them, the features whose state lives outside the model calls rank 0
    sends (each would need its own hand-over to the workers)."""
    refused = {"--enable-hierarchical-cache": args.enable_hierarchical_cache}
    named = [flag for flag, on in refused.items() if on]
    if named:
        raise ValueError(f"--tp-size {args.tp_size} does not support {', '.join(named)} yet")


def _fingerprint(args: ServerArgs) -> dict[str, Any]:
    """What every rank must agree on: all arguments but the HTTP front's and the host's own."""
    from loom.config.server_args import SECTIONS

    own = {"node_rank"}
    keep = [attr for attr in SECTIONS if attr != "http_args"]
    out: dict[str, Any] = {}
    for attr in keep:
        out.update({k: v for k, v in vars(getattr(args, attr)).items() if k not in own})
    return out


def check_agreement(args: ServerArgs) -> None:
    """Every rank compares its arguments with rank 0's; all raise, naming the ranks and the
    arguments that differ, when any does (a host started with another model or flags)."""
    import torch.distributed as dist

    from loom.distributed import ctrl_group

    mine = _fingerprint(args)
    every: list[Any] = [None] * args.tp_size
    dist.all_gather_object(every, mine, group=ctrl_group())
    first = every[0]
    differ = {
        r: sorted(k for k in set(first) | set(fp) if first.get(k) != fp.get(k))
        for r, fp in enumerate(every)
    }
    named = "; ".join(f"rank {r}: {', '.join(keys)}" for r, keys in differ.items() if keys)
    if named:
        raise ValueError(f"tensor-parallel ranks disagree with rank 0 on {named}")


def run_node(args: ServerArgs) -> int:
    """A host other than the first (``--node-rank`` > 0): its ranks only, until rank 0 closes
    them; the exit status is the worst of theirs."""
    procs = spawn_workers(args, args.dist_init_addr)
    print(
        f"Loom: tensor-parallel ranks {list(local_ranks(args))} of {args.tp_size} meet rank 0 "
        f"at {args.dist_init_addr}",
        flush=True,
    )
    codes = [p.wait() for p in procs.values()]
    return max((abs(c) for c in codes), default=0)


class TPLeader:
    """Rank 0's end: sends each model call to the workers and watches this host's ones."""

    def __init__(self, args: ServerArgs, device: torch.device) -> None:
        from loom.distributed import close_distributed, init_distributed

        self.size = args.tp_size
        self.timeout = args.dist_timeout
        init_addr = args.dist_init_addr or _free_addr()
        self.procs = spawn_workers(args, init_addr)
        try:
            init_distributed(
                0, self.size, init_addr, device, args.dist_timeout, len(local_ranks(args))
            )
            check_agreement(args)
        except BaseException:
            self._stop_procs()
            close_distributed()
            raise
        self.closed = False
        self.failed = False  # a call did not reach every rank: close kills them at once
        self.last_send = time.monotonic()

    def check(self) -> None:
        """Raise naming the ranks of this host whose process has exited; while no call went
        out for a third of ``--dist-timeout``, ping every rank (a worker waits for calls no
        longer than that, and a rank that hangs is found idle too)."""
        self._raise_exited()
        if not self.closed and time.monotonic() - self.last_send > self.timeout / 3:
            self.send(PING, {})

    def _raise_exited(self) -> None:
        dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
        if dead and not self.closed:
            raise RuntimeError(
                "tensor-parallel rank(s) exited: "
                + ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(dead.items()))
            )

    def explain(self, error: RuntimeError) -> RuntimeError:
        """A failed step's error naming the ranks: those of this host that exited, or else that
        one of ranks 1..N-1 hung past ``--dist-timeout`` or died (a collective does not say
        which)."""
        if "tensor-parallel" in str(error):
            return error
        # A killed rank's sockets close before its process can be reaped: the collective can
        # fail first, so the exit is looked for a moment longer.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self._raise_exited()
            except RuntimeError as dead:
                return RuntimeError(f"{dead}: {error}")
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return RuntimeError(
            f"a tensor-parallel collective failed: one of ranks 1..{self.size - 1} hung past "
            f"--dist-timeout {self.timeout} s or died: {error}"
        )

    def send(self, method: str, kwargs: dict[str, Any]) -> None:
        import torch.distributed as dist

        from loom.distributed import ctrl_group

        tensors: list[torch.Tensor] = []

        def strip(v):
            if isinstance(v, torch.Tensor):
                tensors.append(v.contiguous())
                return _TensorRef(tuple(v.shape), v.dtype)
            if isinstance(v, tuple):
                return tuple(strip(x) for x in v)
            return v

        call = (method, {k: strip(v) for k, v in kwargs.items()})
        self.last_send = time.monotonic()
        try:
            dist.broadcast_object_list([call], src=0, group=ctrl_group())
            for t in tensors:
                dist.broadcast(t, src=0)
        except Exception as e:
            self.failed = True
            self.check()
            raise RuntimeError(
                f"sending {method} to the tensor-parallel ranks failed: one of ranks "
                f"1..{self.size - 1} hung past --dist-timeout {self.timeout} s or died: {e}"
            ) from e

    def attach(self, runner) -> None:
        """Hand the runner's state that lives outside the model calls to the workers: the LoRA
        slots' writes."""
        if runner.lora_manager is not None:
            runner.lora_manager.mirror = LoRAMirror(self)

    def close(self) -> None:
        """Stop the workers (a close call, then a kill after 10 s) and leave the group."""
        from loom.distributed import close_distributed

        if self.closed:
            return
        self.closed = True
        try:
            if not self.failed and all(p.poll() is None for p in self.procs.values()):
                self.send(CLOSE, {})
        except Exception as e:  # noqa: BLE001 - closing anyway
            logger.warning("closing the tensor-parallel ranks: %s", e)
        self._stop_procs(wait=0.0 if self.failed else 10.0)
        close_distributed()

    def _stop_procs(self, wait: float = 10.0) -> None:
        for p in self.procs.values():
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class LoRAMirror:
    """Rank 0's LoRA manager's reads and slot writes, sent to the workers' managers in the
    order they happen (``LoRAManager.mirror_*``): an adapter's read starts on every rank at once,
    and a slot write reaches a worker before any forward that reads the slot."""

    def __init__(self, leader: TPLeader) -> None:
        self.leader = leader

    def read(self, ref) -> None:
        self.leader.send("lora_manager.mirror_read", {"ref": ref})

    def write(self, slot: int, ref, digest: str) -> None:
        self.leader.send("lora_manager.mirror_write", {"slot": slot, "ref": ref, "digest": digest})

    def drop(self, lora_id: str) -> None:
        self.leader.send("lora_manager.mirror_drop", {"lora_id": lora_id})

    def zero(self, slot: int) -> None:
        self.leader.send("lora_manager.mirror_zero", {"slot": slot})


def _receive(v, device: torch.device):
    import torch.distributed as dist

    if isinstance(v, _TensorRef):
        t = torch.empty(v.shape, dtype=v.dtype, device=device)
        dist.broadcast(t, src=0)
        return t
    if isinstance(v, tuple):
        return tuple(_receive(x, device) for x in v)
    return v


def serve_calls(runner) -> None:
    """A worker's loop: receive rank 0's calls and make them on ``runner`` (a dotted method:
    on that attribute of it) until ``close``."""
    import torch.distributed as dist

    from loom.distributed import ctrl_group

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctrl_group())
        method, kwargs = box[0]
        if method == CLOSE:
            return
        if method == PING:
            continue
        kwargs = {k: _receive(v, runner.device) for k, v in kwargs.items()}
        target = runner
        for name in method.split("."):
            target = getattr(target, name)
        try:
            target(**kwargs)
        except ValueError as e:
            # a weight update that any rank refused (the ranks agree before copying): the old
            # weights serve on every rank; anything else ends this rank, and rank 0 stops the
            # server
            if method != "update_weights_from_disk":
                raise
            logger.warning("weight update refused: %s", e)


def worker_main(args: ServerArgs, rank: int, init_addr: str) -> None:
    """A worker rank's process: join the group, build the runner as rank 0 does (its weights'
    shards, a KV pool and table of the same shapes), then serve rank 0's calls."""
    from loom.distributed import close_distributed, init_distributed
    from loom.mem_cache.memory_pool import ReqToTokenPool
    from loom.model_executor.model_runner import ModelRunner, resolve_device
    from loom.process import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the ranks stop
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"[tp rank {rank} %(process)d] %(levelname)s %(name)s: %(message)s",
    )
    device = resolve_device(args.device)
    init_distributed(
        rank, args.tp_size, init_addr, device, args.dist_timeout, len(local_ranks(args))
    )
    try:
        check_agreement(args)
        runner = ModelRunner(args)
        context = runner.model_config.context_len
        runner.bind(ReqToTokenPool(runner.max_running_requests + 1, context, runner.device))
        serve_calls(runner)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    close_distributed()
