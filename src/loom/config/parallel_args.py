"""``ParallelArgs``: tensor parallelism (``--tp-size``) and the hosts its ranks run on."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.config.sections import _arg, _positive


@dataclass(frozen=True)
class ParallelArgs:
    """Tensor parallelism: ranks, hosts and their rendezvous."""

    tp_size: int = field(
        default=1,
        metadata=_arg(
            "Tensor-parallel ranks: the model's layers are split over this many processes "
            "(one scheduler process per rank; NCCL between GPUs, gloo between CPU processes).",
            aliases=("--tensor-parallel-size",),
        ),
    )
    nnodes: int = field(default=1, metadata=_arg("Hosts the tensor-parallel ranks span."))
    node_rank: int = field(
        default=0, metadata=_arg("This host's index among --nnodes (0: the one that serves).")
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata=_arg(
            "HOST:PORT where the ranks meet (torch.distributed's TCP rendezvous); needed with "
            "--nnodes > 1, a free local port otherwise."
        ),
    )
    dist_timeout: int = field(
        default=60,
        metadata=_arg(
            "Seconds a rank waits in one collective before the server stops with an error naming "
            "the ranks (a rank that hangs or died)."
        ),
    )

    def __post_init__(self) -> None:
        _positive(self, "tp_size", "nnodes", "dist_timeout")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} is not a multiple of nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT")
