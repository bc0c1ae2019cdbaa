"""The flashinfer backend's plans per (sliding window, logit cap), on CPU against a stand-in
``flashinfer`` module whose wrappers compute attention in plain PyTorch from what was planned,
as FlashInfer documents its arguments (``window_left``: keys a query sees before its own;
``logits_soft_cap``: ``cap * tanh(score / cap)``). This checks Loom's side (a wrapper per
variant, planned with the layer's window and cap, each layer running its own); FlashInfer's
kernels themselves run only on CUDA (tests/gpu)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from loom import plugins
from loom.testing import check_attention_backend


class _Wrapper:
    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, **bufs):
        self.plans: list[dict] = []

    def plan(self, *args, causal=False, window_left=-1, logits_soft_cap=None, **kwargs):
        if len(args) == 8:  # prefill: qo_indptr first
            qo, args = args[0].tolist(), args[1:]
        else:  # decode: one query a request
            qo = list(range(len(args[0])))
        indptr, indices = args[0].tolist(), args[1]
        self.plans.append({"window_left": window_left, "logits_soft_cap": logits_soft_cap})
        self.layout = (qo, indptr, indices)
        self.window_left, self.cap = window_left, logits_soft_cap or 0.0

    def run(self, q, kv):
        qo, indptr, indices = self.layout
        k_cache, v_cache = (x[:, 0].float() for x in kv)
        out = torch.empty_like(q)
        for b in range(len(indptr) - 1):
            idx = indices[indptr[b] : indptr[b + 1]]
            k, v, qb = k_cache[idx], v_cache[idx], q[qo[b] : qo[b + 1]].float()
            group = qb.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", qb, k) * qb.shape[-1] ** -0.5
            if self.cap:
                s = self.cap * torch.tanh(s / self.cap)
            q_pos = torch.arange(qb.shape[0]).unsqueeze(1) + len(idx) - qb.shape[0]
            k_pos = torch.arange(len(idx)).unsqueeze(0)
            seen = k_pos <= q_pos
            if self.window_left >= 0:
                seen &= k_pos >= q_pos - self.window_left
            s = s.masked_fill(~seen, -torch.inf)
            out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    from loom.layers.attention import flashinfer_backend as fb
    from loom.layers.attention.base import ATTENTION_FEATURES

    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = _Wrapper
    fi.BatchDecodeWithPagedKVCacheWrapper = _Wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fi)

    class Declared(fb.FlashInferAttnBackend):  # what declaring the features would run
        features = frozenset(ATTENTION_FEATURES)

    plugins.register("attention_backend", "fake_flashinfer_for_test", Declared)
    yield "fake_flashinfer_for_test"
    plugins.unregister("attention_backend", "fake_flashinfer_for_test")


@pytest.mark.parametrize(
    "kw", [{}, {"sliding_window": 8}, {"logit_cap": 2.0}, {"sliding_window": 8, "logit_cap": 2.0}]
)
def test_flashinfer_plans_pass_the_layers_window_and_cap(fake_flashinfer, kw):
    """The attention kit over the stand-in: each layer's window and cap reach the plan."""
    check_attention_backend(fake_flashinfer, dtype=torch.float16, head_dim=64, **kw)


def test_flashinfer_plans_a_wrapper_per_variant(fake_flashinfer):
    """Layers of two variants (a windowed capped one, a plain one): the first step plans the
    plain variant up front and the other on its first layer, later steps plan both up front; a
    variant met inside a CUDA graph capture is an error rather than a plan inside the graph."""
    from loom.forward_batch import ForwardBatch, ForwardMode
    from loom.layers.attention.base import AttentionContext
    from loom.layers.attention.layer import Attention
    from loom.mem_cache.memory_pool import KVPool, ReqToTokenPool

    pool = KVPool(64, 1, 2, 1, 64, torch.float16, torch.device("cpu"))
    table = ReqToTokenPool(2, 64, torch.device("cpu"))
    table.req_to_token[0, :8] = torch.arange(1, 9)
    ctx = AttentionContext(
        2, 1, 64, torch.float16, torch.device("cpu"), pool, table,
        frozenset({"sliding_window", "logit_cap"}),
    )  # fmt: skip
    backend = plugins.resolve("attention_backend", fake_flashinfer)(ctx)
    local = Attention(0, 2, 1, 64, 0.125, sliding_window=4, logit_cap=30.0)
    plain = Attention(1, 2, 1, 64, 0.125)

    def decode(seq_len):
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=1,
            input_ids=torch.zeros(1, dtype=torch.long),
            positions=torch.tensor([seq_len - 1]),
            out_cache_loc=table.req_to_token[0, seq_len - 1 : seq_len],
            req_pool_indices=torch.tensor([0]),
            seq_lens=torch.tensor([seq_len]),
            seq_lens_cpu=[seq_len],
            req_to_token_pool=table,
            kv_pool=pool,
            attn_backend=backend,
        )
        backend.init_forward_metadata(batch)
        x = torch.randn(1, 128, dtype=torch.float16)
        kv = torch.randn(1, 64, dtype=torch.float16)
        return batch, [layer(x, kv, kv, batch) for layer in (local, plain)]

    batch, _ = decode(5)
    assert backend.variants == [(0, 0.0), (4, 30.0)]
    wrappers = backend.decode
    assert wrappers[(4, 30.0)].plans == [{"window_left": 3, "logits_soft_cap": 30.0}]
    assert wrappers[(0, 0.0)].plans == [{"window_left": -1, "logits_soft_cap": None}]
    decode(6)  # both planned up front this time, once each
    assert [len(wrappers[v].plans) for v in backend.variants] == [2, 2]

    other = Attention(0, 2, 1, 64, 0.125, sliding_window=2)
    batch, _ = decode(7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="capture"):
            other(torch.randn(1, 128, dtype=torch.float16), None, None, batch, save_kv=False)
