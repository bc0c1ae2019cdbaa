"""The experts of a sparse MoE block as one module: all experts' weights stacked, one forward for
the routed tokens.

``FusedMoE`` holds ``w13 [E, 2 * I / tp, H]`` (each expert's gate rows, then its up rows) and
``w2 [E, H, I / tp]``; tensor parallelism splits the intermediate dimension, so each rank's
output is a partial sum, all-reduced as ``RowParallelLinear`` does. Two paths compute
``out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``:

- ``torch``: rows sorted by expert, one matmul pair per active expert. It reads the per-expert
  counts on the host, so it is the CPU path and the reference, not CUDA-graph safe.
- ``triton`` (``triton_moe.py``): an align kernel and one grouped-GEMM launch per projection for
  all experts, no host sync; the path for CUDA tensors (``auto``), and on CPU under
  ``TRITON_INTERPRET=1`` for tests.

Checkpoints name the experts either one matrix per expert (the hub's files, and what
transformers 5's ``save_pretrained`` writes: ``...mlp.experts.{e}.{gate,up,down}_proj.weight``
for Qwen2/3-MoE, ``...block_sparse_moe.experts.{e}.w{1,3,2}.weight`` for Mixtral) or fused (a
transformers-5 model's own ``state_dict()``: ``...mlp.experts.gate_up_proj [E, 2I, H]`` and
``...mlp.experts.down_proj [E, H, I]``). ``checkpoint_mapping`` lists both for a prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed import divide, get_tp_rank, get_tp_size, tp_all_reduce
from loom.layers.fused_ops import use_fused

ExpertsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def fused_experts_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The plain-PyTorch experts: ``hidden [T, H]`` -> ``[T, H]`` (reads counts on the host)."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routed rows (t * k + j) grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    x = hidden[order // top_k]
    y = hidden.new_empty(order.numel(), hidden_size)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(x[start : start + n], w13[e]).chunk(2, dim=-1)
            y[start : start + n] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    per_row = torch.empty_like(y)
    per_row[order] = y
    # weights multiply in fp32 (Mixtral's router leaves them fp32, as HF does), one rounding
    weighted = per_row.view(num_tokens, top_k, hidden_size).float() * topk_weights[..., None]
    return weighted.sum(dim=1).to(hidden.dtype)


def _fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    from loom.layers.moe.triton_moe import fused_experts

    return fused_experts(hidden, w13, w2, topk_weights, topk_ids)


BACKENDS: dict[str, ExpertsFn] = {"torch": fused_experts_torch, "triton": _fused_experts_triton}


def pick_backend(x: torch.Tensor, backend: str = "auto") -> str:
    """``auto``: Triton for CUDA tensors when triton imports, else PyTorch; or the name given."""
    _check_backend(backend)
    if backend == "auto":
        return "triton" if use_fused(x) else "torch"
    return backend


def _check_backend(backend: str) -> None:
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; known: auto, {', '.join(BACKENDS)}")


# One expert's checkpoint matrices -> (parameter, shard id): Qwen-MoE names, then Mixtral's
_EXPERT_LEAVES = (
    ("gate_proj", "w13", "gate"),
    ("up_proj", "w13", "up"),
    ("down_proj", "w2", "down"),
    ("w1", "w13", "gate"),
    ("w3", "w13", "up"),
    ("w2", "w2", "down"),
)
# All experts in one tensor (transformers 5's in-memory layout) -> (parameter, shard id)
_FUSED_LEAVES = (("gate_up_proj", "w13", "gate_up"), ("down_proj", "w2", "down"))


def checkpoint_mapping(
    num_experts: int, ckpt_prefix: str, param_prefix: str | None = None
) -> Iterator[tuple[str, str, int | None, str]]:
    """``(checkpoint name, parameter name, expert_id, shard_id)`` for every name the experts
    under ``ckpt_prefix`` (e.g. ``model.layers.3.mlp.experts``) may have in a checkpoint;
    ``param_prefix`` (default: the same) is the ``FusedMoE``'s own name in the model. A fused
    name has ``expert_id`` None: the tensor holds every expert."""
    dst = ckpt_prefix if param_prefix is None else param_prefix
    for e in range(num_experts):
        for leaf, param, shard in _EXPERT_LEAVES:
            yield f"{ckpt_prefix}.{e}.{leaf}.weight", f"{dst}.{param}", e, shard
    for leaf, param, shard in _FUSED_LEAVES:
        yield f"{ckpt_prefix}.{leaf}", f"{dst}.{param}", None, shard


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}"
        )
    dst.copy_(src)


def _oriented(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A fused expert matrix as ``[rows, cols]``, transposing one stored ``[cols, rows]`` (when
    both fit, i.e. square, the stored layout is taken as ``[rows, cols]``: HF's own)."""
    if w.shape == (rows, cols):
        return w
    if w.shape == (cols, rows):
        return w.t()
    raise ValueError(f"expert matrix {tuple(w.shape)} is neither {(rows, cols)} nor transposed")


class FusedMoE(nn.Module):
    """``num_experts`` SiLU-gated expert MLPs (``hidden_size`` -> ``intermediate_size`` ->
    ``hidden_size``; ``intermediate_size`` is the full, unsharded width) in two stacked
    parameters.

    ``forward(hidden [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H]``; the routing
    comes from ``loom.layers.moe.router``. ``backend`` (``auto``, ``torch``, ``triton``) picks
    the path; ``forward(..., backend=...)`` overrides it per call. With ``reduce_results``
    the output is all-reduced over the tensor-parallel group (a model that adds a shared
    expert first may reduce once itself).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        reduce_results: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.reduce_results = reduce_results
        _check_backend(backend)  # an unknown name fails here, not mid-forward
        self.backend = backend
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size)
        inter = self.intermediate_size_per_partition
        # Uninitialised on purpose: a loader (or the dummy loader) overwrites every element.
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size), False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter), False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def checkpoint_mapping(
        self, ckpt_prefix: str, param_prefix: str | None = None
    ) -> Iterator[tuple[str, str, int | None, str]]:
        """See ``checkpoint_mapping`` (module level); ``num_experts`` is this layer's."""
        return checkpoint_mapping(self.num_experts, ckpt_prefix, param_prefix)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """Copy this rank's slice of a full checkpoint tensor into ``param``.

        ``shard_id``: ``gate`` / ``up`` (an expert's ``[I, H]`` matrix, into ``w13``),
        ``down`` (``[H, I]``, into ``w2``), or ``gate_up`` (``[2I, H]``: gate rows, then up).
        ``expert_id`` None means ``loaded`` holds every expert (``[E, ...]``, each matrix as
        above or transposed); ``shard_id`` None then means the fused matrix of ``param``.
        """
        if shard_id is None:
            shard_id = "gate_up" if param is self.w13 else "down"
        want = self.w2 if shard_id == "down" else self.w13
        if param is not want:
            raise ValueError(f"shard {shard_id!r} does not belong to this parameter")
        if expert_id is not None:
            self._load_expert(param, loaded, shard_id, expert_id)
            return
        if loaded.shape[0] != self.num_experts:
            raise ValueError(f"fused experts tensor {tuple(loaded.shape)}: want {self.num_experts}")
        full, hidden = self.intermediate_size, self.hidden_size
        for e in range(self.num_experts):
            if shard_id == "down":
                w = _oriented(loaded[e], hidden, full)
            elif shard_id == "gate_up":
                w = _oriented(loaded[e], 2 * full, hidden)
            else:
                w = _oriented(loaded[e], full, hidden)
            self._load_expert(param, w, shard_id, e)

    def _load_expert(
        self, param: nn.Parameter, w: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        inter, rank = self.intermediate_size_per_partition, self.tp_rank
        dst = param.data[expert_id]
        if shard_id == "down":
            _copy(dst, w.narrow(1, rank * inter, inter))
        elif shard_id in ("gate", "up"):
            part = dst.narrow(0, 0 if shard_id == "gate" else inter, inter)
            _copy(part, w.narrow(0, rank * inter, inter))
        elif shard_id == "gate_up":
            full = self.intermediate_size
            if w.shape[0] != 2 * full:
                raise ValueError(f"gate_up matrix {tuple(w.shape)}: want {2 * full} rows")
            for i in range(2):  # gate rows, then up rows, each sliced for this rank
                _copy(dst.narrow(0, i * inter, inter), w.narrow(0, i * full + rank * inter, inter))
        else:
            raise ValueError(f"unknown shard id {shard_id!r}: gate, up, gate_up or down")

    def forward(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        backend: str | None = None,
    ) -> torch.Tensor:
        name = pick_backend(hidden, backend or self.backend)
        out = BACKENDS[name](hidden, self.w13, self.w2, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tp_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, tp_size={self.tp_size}, "
            f"backend={self.backend}"
        )
