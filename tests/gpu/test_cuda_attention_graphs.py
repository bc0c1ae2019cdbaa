"""Decode CUDA graphs over attention layers with sliding windows and logit soft caps, without a
model: a captured graph replays each layer's window and cap (constants of the layer) over the
batch copied into the runner's buffers, as eager torch_native computes them. Skipped without
CUDA (CI has none); run on the H200 as docs/benchmarks.md says."""

from __future__ import annotations

import pytest
import torch

from loom import plugins

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8, 2, 64, 64
# (window, cap) per layer: Gemma-2-like local and global layers, and a window past every context
LAYERS = [(16, 0.0), (0, 30.0), (16, 30.0), (4096, 0.0)]


class _Layers:
    """Attention layers over one KV pool; each token's q/k/v per layer are fixed random rows
    picked by its input id, so a graph reads nothing but the runner's static batch."""

    def __init__(self, name: str, dev: torch.device) -> None:
        from loom.layers.attention.base import AttentionContext
        from loom.layers.attention.layer import Attention
        from loom.mem_cache.memory_pool import KVPool, ReqToTokenPool

        gen = torch.Generator().manual_seed(0)
        width = len(LAYERS) * (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.emb = torch.randn(VOCAB, width, generator=gen).to(dev, torch.bfloat16)
        self.pool = KVPool(4096, 1, len(LAYERS), KV_HEADS, HEAD_DIM, torch.bfloat16, dev)
        self.table = ReqToTokenPool(8, 2048, dev)
        self.layers = [
            Attention(i, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, window, cap)
            for i, (window, cap) in enumerate(LAYERS)
        ]
        ctx = AttentionContext(
            HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, dev, self.pool, self.table,
            frozenset({"sliding_window", "logit_cap"}),
        )  # fmt: skip
        self.backend = plugins.resolve("attention_backend", name)(ctx)

    def attach(self, batch, backend=None):
        batch.req_to_token_pool, batch.kv_pool = self.table, self.pool
        batch.attn_backend = backend or self.backend
        return batch

    def forward(self, batch, plan: bool = True, backend=None) -> torch.Tensor:
        backend = backend or self.backend
        self.attach(batch, backend)
        if plan:
            backend.init_forward_metadata(batch)
        rows = self.emb[batch.input_ids].split(
            [n * HEAD_DIM for _ in LAYERS for n in (HEADS, KV_HEADS, KV_HEADS)], dim=1
        )
        outs = [
            layer(rows[3 * i], rows[3 * i + 1], rows[3 * i + 2], batch)
            for i, layer in enumerate(self.layers)
        ]
        return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", ["triton", "flash_attention", "flashinfer"])
def test_decode_graphs_replay_windows_and_caps(name):
    from loom.forward_batch import ForwardBatch, ForwardMode
    from loom.model_executor.cuda_graph_runner import CudaGraphRunner

    dev = torch.device("cuda")
    cls = plugins.resolve("attention_backend", name)
    if not cls.is_supported(dev):
        pytest.skip(f"{name} is not supported here")
    if not {"sliding_window", "logit_cap"} <= cls.features:
        pytest.skip(f"{name} does not declare sliding windows and logit caps")
    m = _Layers(name, dev)
    oracle = plugins.resolve("attention_backend", "torch_native")(m.backend.ctx)
    gen = torch.Generator().manual_seed(1)
    # requests with contexts shorter and far longer than the windows, their KV on shuffled slots
    contexts = [5, 300, 1500]
    rows, perm, used = [], torch.randperm(4000, generator=gen) + 1, 0
    for n in contexts:
        row = m.table.alloc()
        m.table.req_to_token[row, : n + 8] = perm[used : used + n + 8].to(dev)
        used += n + 8
        rows.append(row)
    for layer in range(len(LAYERS)):
        k_buf, v_buf = m.pool.get_kv(layer)
        k_buf.copy_(torch.randn(k_buf.shape, generator=gen).to(k_buf))
        v_buf.copy_(torch.randn(v_buf.shape, generator=gen).to(v_buf))
    with torch.inference_mode():
        runner = CudaGraphRunner(m.forward, m.attach, m.backend, dev, 2048, 4)
        assert runner.buckets == [1, 2, 4]
        # three steps of the three requests (bucket 4, a padding row), then two alone (bucket 2)
        for step, batch_rows in enumerate([[0, 1, 2], [0, 1, 2], [0, 1, 2], [2, 1]]):
            pos = [contexts[r] + step for r in batch_rows]
            ids = torch.randint(0, VOCAB, (len(batch_rows),), generator=gen).tolist()
            req = [rows[r] for r in batch_rows]
            loc = [
                int(m.table.req_to_token[rows[r], p]) for r, p in zip(batch_rows, pos, strict=True)
            ]
            seq = [p + 1 for p in pos]
            packed = torch.tensor([ids, pos, seq, req, loc], dtype=torch.int64, device=dev)
            got = runner.replay(packed, seq_lens_cpu=seq).float()
            batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                batch_size=len(ids),
                input_ids=packed[0],
                positions=packed[1],
                out_cache_loc=packed[4],
                req_pool_indices=packed[3],
                seq_lens=packed[2],
                seq_lens_cpu=seq,
            )
            want = m.forward(batch, backend=oracle).float()
            err = (got - want).abs().max().item()
            assert err < 2e-2, f"{name}: step {step} off by {err:.2e}"
