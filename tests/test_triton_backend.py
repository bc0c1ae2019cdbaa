"""The Triton backends end to end (on CPU under TRITON_INTERPRET=1, on CUDA for real): greedy
tokens equal torch_native's on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

import loom
from tests.conftest import save_tiny_llama

pytest.importorskip("triton")


# Tests of `auto`'s choices that patch the CPU's lists (on a GPU machine the engine runs on CUDA,
# whose lists tests/gpu covers)
_CPU_AUTO = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's auto choice")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # wide logits (initializer_range): no near-ties for greedy to flip on
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-triton"), vocab_size=256, initializer_range=0.2
    )


def _reference_run(tiny_dir):
    """Three prompts, greedy parameters, engine arguments (fp32, prompts prefilled in chunks of
    16, pages of 4) and torch_native's tokens for them."""
    prompts = [
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 17, 40)
    ]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    kw = dict(
        model=tiny_dir,
        skip_tokenizer_init=True,
        max_total_tokens=1024,
        dtype="float32",
        chunked_prefill_size=16,
        page_size=4,
    )
    with loom.Engine(attention_backend="torch_native", **kw) as e:
        want = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    return prompts, params, kw, want


@pytest.mark.parametrize("backend", ["triton", "flash_attention"])
def test_greedy_equals_torch_native(tiny_dir, backend):
    prompts, params, kw, want = _reference_run(tiny_dir)
    with loom.Engine(attention_backend=backend, **kw) as e:
        assert e.get_server_info()["attention_backend"] == backend
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert got == want


def test_decode_graph_runner_replays_batches_in_their_buckets(tiny_dir, monkeypatch):
    """The CUDA graph runner's bookkeeping, on CPU: a stand-in graph re-runs the captured
    forward when replayed, over the runner's static buffers. Each step's packed batch is copied
    in (the ids from the device under overlap), padding rows fill the bucket, and the outputs
    are sliced back. As requests finish the batch goes 3 -> 2 -> 1 (buckets 4, 2, 1), and the
    tokens equal torch_native's."""
    from loom.model_executor import cuda_graph_runner as cgr

    class EagerGraph:
        def replay(self):
            self.out.copy_(self.forward())

    def record(self, graph, forward):
        graph.forward = forward
        graph.out = forward()
        return graph.out

    sizes = []
    replay = cgr.CudaGraphRunner.replay

    def counted(self, packed, *args, **kwargs):
        bs = packed.shape[1]
        sizes.append(bs)
        out = replay(self, packed, *args, **kwargs)
        gbs = next(b for b in self.buckets if b >= bs)
        # rows past the batch decode the padding token: position 0, seq_len 1, row 0, slot 0
        pad = torch.tensor([0, 0, 1, 0, 0]).view(5, 1).expand(5, gbs - bs)
        assert torch.equal(self.static[:, bs:gbs], pad)
        return out

    monkeypatch.setattr(torch.cuda, "CUDAGraph", EagerGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(cgr.CudaGraphRunner, "_record", record)
    monkeypatch.setattr(cgr.CudaGraphRunner, "replay", counted)
    prompts, params, kw, want = _reference_run(tiny_dir)
    # the second prompt twice (its copy joins a step later, on the cached prompt): the batch
    # goes 3 -> 4 -> 3 (bucket 4 again, its last row left over from the batch of 4) -> 2 -> 1;
    # greedy, so each output is a prefix of the 8-token reference
    prompts, want = prompts + [prompts[1]], want + [want[1]]
    lens = (8, 6, 3, 7)
    with loom.Engine(attention_backend="triton", **kw) as e:
        e.runner.capture_cuda_graphs(4)
        runner = e.runner.cuda_graph_runner
        assert runner.buckets == [1, 2, 4]
        e.scheduler.overlap = True  # chained steps: the ids come from the device
        outs = e.generate(
            input_ids=prompts, sampling_params=[{**params, "max_new_tokens": n} for n in lens]
        )
        assert e.scheduler.stats.num_overlapped_batches > 0
    assert [o["output_ids"] for o in outs] == [w[:n] for w, n in zip(want, lens, strict=True)]
    assert {4, 3, 2, 1} <= set(sizes)
    assert 3 in sizes[sizes.index(4) :]  # a batch of 3 after one of 4


def test_greedy_with_several_kv_heads_per_decode_program_equals_torch_native(tiny_dir, monkeypatch):
    """The decode variant reading several KV heads per program, with the next tile's slots
    prefetched (as over fp8 caches at large batches), end to end."""
    import loom.layers.attention.triton_backend as tb

    prompts, params, kw, want = _reference_run(tiny_dir)
    monkeypatch.setattr(tb, "kv_per_program", lambda bs, kv_dtype: 2)
    monkeypatch.setattr(tb, "decode_prefetch", lambda bs, kv_dtype: True)
    with loom.Engine(attention_backend="triton", **kw) as e:
        assert e.runner.kv_pool.get_kv(0)[0].shape[1] >= 2
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert got == want


def test_kv_heads_per_decode_program_by_cache_dtype_and_batch():
    """Two KV heads a program over fp8 caches once one split fills the GPU; one otherwise."""
    import loom.layers.attention.triton_backend as tb

    fp8 = torch.float8_e4m3fn
    assert [tb.kv_per_program(bs, fp8) for bs in (1, 4, 32, 33, 64, 1000)] == [1, 1, 1, 2, 2, 2]
    assert {tb.kv_per_program(bs, torch.bfloat16) for bs in (1, 64, 1000)} == {1}
    # slots prefetched where two heads a program read an fp8 cache
    assert [tb.decode_prefetch(bs, fp8) for bs in (1, 32, 33, 1000)] == [False, False, True, True]
    assert not tb.decode_prefetch(1000, torch.bfloat16)


@pytest.mark.parametrize("prefill,decode", [("torch_native", "triton"), ("triton", "torch_native")])
def test_hybrid_prefill_and_decode_backends_equal_torch_native(tiny_dir, prefill, decode):
    """--prefill-attention-backend / --decode-attention-backend: extend batches (chunked here)
    run on one backend and decode on the other, over the same KV pool."""
    from loom.layers.attention.hybrid import HybridAttnBackend

    prompts, params, kw, want = _reference_run(tiny_dir)
    # (eager decode on CUDA too: a replayed graph would not pass through the counters below)
    kw.update(
        prefill_attention_backend=prefill, decode_attention_backend=decode, disable_cuda_graph=True
    )
    with loom.Engine(**kw) as e:
        info = e.get_server_info()
        assert (info["prefill_attention_backend"], info["decode_attention_backend"]) == (
            prefill,
            decode,
        )
        assert info["attention_backend"] == f"{prefill} prefill + {decode} decode"
        hybrid = e.runner.attn_backend
        assert isinstance(hybrid, HybridAttnBackend)
        calls = {"prefill": 0, "decode": 0}
        for phase, inner in (
            ("prefill", hybrid.prefill_backend),
            ("decode", hybrid.decode_backend),
        ):
            orig = inner.init_forward_metadata

            def counted(batch, _orig=orig, _phase=phase):
                calls[_phase] += 1
                return _orig(batch)

            inner.init_forward_metadata = counted
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        e.scheduler.check_kv_balance()
    assert got == want
    assert calls["prefill"] >= 4 and calls["decode"] >= 7  # 60 prompt tokens in chunks of 16


@_CPU_AUTO
def test_an_out_of_tree_backend_joins_auto_by_its_priority(tiny_dir):
    """`--attention-backend auto` ranks every registered backend by its ``auto_priority`` for
    the device and phase: a plug-in that ranks itself above torch_native for CPU decode (here
    Loom's Triton kernels under the interpreter, registered under another name) decodes, and
    the tokens equal torch_native's alone. None keeps a backend out of ``auto``."""
    from loom import plugins
    from loom.layers.attention.triton_backend import TritonAttnBackend

    class CpuDecode(TritonAttnBackend):
        @classmethod
        def auto_priority(cls, device, phase):
            return 50 if phase == "decode" else None

    from loom.layers.attention.cpu_backend import CPUAttnBackend

    prompts, params, kw, want = _reference_run(tiny_dir)
    with loom.Engine(**kw) as e:  # auto, before the plug-in: Loom's own CPU backends
        cpu = CPUAttnBackend.is_supported(torch.device("cpu"))  # (it ranks 20 for decode)
        before = "torch_native prefill + cpu decode" if cpu else "torch_native"
        assert e.get_server_info()["attention_backend"] == before
    plugins.register("attention_backend", "cpu_decode_for_test", CpuDecode)
    try:
        with loom.Engine(**kw) as e:
            info = e.get_server_info()
            assert info["attention_backend"] == "torch_native prefill + cpu_decode_for_test decode"
            got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
            e.scheduler.check_kv_balance()
    finally:
        plugins.unregister("attention_backend", "cpu_decode_for_test")
    assert got == want


def test_same_backend_for_both_phases_is_one_instance(tiny_dir):
    with loom.Engine(
        model=tiny_dir,
        skip_tokenizer_init=True,
        max_total_tokens=256,
        dtype="float32",
        prefill_attention_backend="torch_native",
        attention_backend="torch_native",
    ) as e:
        assert e.get_server_info()["attention_backend"] == "torch_native"
        assert type(e.runner.attn_backend).__name__ == "TorchNativeAttnBackend"


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kvp", [1, 2])
@pytest.mark.parametrize("splits", [4, 1])
def test_decode_kernel_variants_match_dense_attention(use_dot, group, kvp, splits):
    """Both decode variants (broadcast products; tl.dot on the padded GQA group) against dense
    attention over scattered KV slots, with one or two KV heads a program, and with four KV
    splits merged by the second stage or one split writing the output itself (its programs
    taking the rows in a given order, as the backend gives them longest first)."""
    from loom.layers.attention.triton_ops import decode_attention

    gen = torch.Generator().manual_seed(group)
    kv_heads, head_dim, slots = 2, 16, 400
    heads = kv_heads * group
    seq_lens = [1, 37, 130]
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    table = torch.zeros(4, 256, dtype=torch.int64)
    perm = torch.randperm(slots - 1, generator=gen) + 1
    used = 0
    for r, n in enumerate(seq_lens):
        table[r, :n] = perm[used : used + n]
        used += n
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    out = decode_attention(
        *(t.to(dev) for t in (q, k_buf, v_buf, table, torch.arange(len(seq_lens)))),
        torch.tensor(seq_lens, device=dev), scale, splits, use_dot=use_dot, kv_per_program=kvp,
        order=torch.tensor([2, 0, 1], device=dev) if splits == 1 else None,
    ).cpu()  # fmt: skip
    for r, n in enumerate(seq_lens):
        idx = table[r, :n]
        k = k_buf[idx].repeat_interleave(group, dim=1)  # [n, heads, d]
        v = v_buf[idx].repeat_interleave(group, dim=1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[r], k) * scale, -1)
        want = torch.einsum("hn,nhd->hd", att, v)
        torch.testing.assert_close(out[r], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        (torch.float16, None),
        (torch.bfloat16, None),
        (torch.float16, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e5m2),
    ],
)
@pytest.mark.parametrize(
    "block_n,prefetch,kvp,splits",
    [
        (None, False, 1, 8),
        (128, False, 1, 8),
        (None, True, 1, 8),
        (None, False, 2, 8),
        # one split: several tiles a program, so the prefetched slots carry across iterations
        (None, True, 1, 1),
        (16, True, 2, 1),
    ],
)
def test_decode_default_variant_in_half_precision_matches_dense_attention(
    dtype, kv_dtype, block_n, prefetch, kvp, splits
):
    """fp16/bf16 take the tl.dot variant by default (the GPU default for half-precision
    models); over an fp8 cache its dots run in fp16. Triton's CPU interpreter computes tl.dot on
    bf16 wrongly (a 16x16 bf16 tl.dot alone is off by ~1e10 there, fp16 is exact), so a bf16
    query over a bf16 cache runs on CUDA only. The reference reads the same fp8 values."""
    from loom.layers.attention.triton_ops import decode_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == torch.bfloat16 and kv_dtype is None and device == "cpu":
        pytest.skip("Triton's interpreter mishandles tl.dot on bf16")
    gen = torch.Generator().manual_seed(3)
    kv_heads, group, head_dim, slots = 2, 4, 32, 300
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=gen).to(kv_dtype or dtype)
    v_buf = torch.randn(slots, kv_heads, head_dim, generator=gen).to(kv_dtype or dtype)
    table = (torch.randperm(slots - 1, generator=gen)[:200] + 1).view(2, 100)
    q = torch.randn(2, kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = [100, 61]
    k_buf, v_buf, table, q = (t.to(device) for t in (k_buf, v_buf, table, q))
    out = decode_attention(
        q,
        k_buf,
        v_buf,
        table,
        torch.arange(2, device=device),
        torch.tensor(lens, device=device),
        head_dim**-0.5,
        splits,
        block_n=block_n,
        prefetch=prefetch,
        kv_per_program=kvp,
    )
    assert out.dtype == dtype
    for r, n in enumerate(lens):
        k = k_buf[table[r, :n]].float().repeat_interleave(group, dim=1)
        v = v_buf[table[r, :n]].float().repeat_interleave(group, dim=1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * head_dim**-0.5, -1)
        want = torch.einsum("hn,nhd->hd", att, v)
        torch.testing.assert_close(out[r].float(), want, rtol=2e-2, atol=2e-2)


def test_scheduler_fused_penalties_equal_the_pytorch_path(tiny_dir, monkeypatch):
    """The scheduler's GPU sampling path (penalties, logit bias and min_new_tokens applied by the
    sampling kernel, counts advanced there), run on CPU under the interpreter: the same greedy
    tokens as the PyTorch path, in a batch mixing penalised, biased and plain rows, also as
    requests finish and the batch shrinks."""
    import loom.sampling.batch_sampler as sched_mod

    prompts = [
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 17, 40, 9)
    ]
    params = [
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "frequency_penalty": 0.7,
         "presence_penalty": 0.3, "repetition_penalty": 1.3},
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {"5": 3.0}},
        {"max_new_tokens": 10, "temperature": 0, "repetition_penalty": 1.5, "min_new_tokens": 4,
         "stop_token_ids": [7, 11], "logit_bias": {"7": 2.0, "9": -1.5}},
        {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    ]  # fmt: skip
    kw = dict(model=tiny_dir, skip_tokenizer_init=True, max_total_tokens=1024, dtype="float32")
    runs = {}
    for fused in (False, True):
        calls = []
        real = sched_mod.fused_sample

        def spy(*a, _real=real, _calls=calls, **k):
            _calls.append(1)
            return _real(*a, **k)

        monkeypatch.setattr(sched_mod, "fused_sampling_enabled", lambda logits, f=fused: f)
        monkeypatch.setattr(sched_mod, "fused_sample", spy)
        with loom.Engine(attention_backend="torch_native", **kw) as e:
            runs[fused] = [
                o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)
            ]
            e.scheduler.check_kv_balance()
        assert bool(calls) == fused
    assert runs[True] == runs[False]


@pytest.mark.parametrize(
    "layout",
    [
        [(0, 9), (5, 7), (12, 1), (30, 1), (3, 1)],  # a mixed step: prompts, then decoding rows
        [(17, 1), (0, 1), (40, 1)],  # one-token rows only
        [(0, 6), (4, 1), (0, 5)],  # a one-token row between prompts: the extend kernel's
        # more rows than the decode kernel splits KV for: one split, programs longest first
        [(0, 4)] + [(3 + 2 * i, 1) for i in range(34)],
    ],
)
@pytest.mark.parametrize("backend", ["triton", "flash_attention"])
def test_mixed_extend_batches_equal_torch_native(tiny_dir, layout, backend):
    """Extend batches whose trailing one-token rows take the decode kernel (the prompts before
    them the backend's extend path) give torch_native's logits for every token."""
    from loom.config import ServerArgs
    from tests.test_llama_parity import bound_runner, extend_all_logits

    seqs = [
        torch.randint(0, 256, (p + e,), generator=torch.Generator().manual_seed(i)).tolist()
        for i, (p, e) in enumerate(layout)
    ]
    got, want = (
        extend_all_logits(
            *bound_runner(
                ServerArgs(
                    model=tiny_dir, max_total_tokens=4096, dtype="float32", attention_backend=b
                )
            ),
            layout,
            seqs,
        )
        for b in (backend, "torch_native")
    )
    assert (got - want).abs().max().item() < 1e-4


def _dense_window_attention(q, k, v, q_pos, scale, window, cap):
    """q ``[heads, d]`` at position ``q_pos``; k / v ``[n, heads, d]`` at positions 0..n-1."""
    s = torch.einsum("hd,nhd->hn", q.float(), k.float()) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    pos = torch.arange(k.shape[0])
    s = s.masked_fill(~((pos <= q_pos) & (pos > q_pos - window if window else True)), -torch.inf)
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v.float())


@pytest.mark.parametrize(
    "use_dot,kvp,splits,cap",
    [(False, 1, 4, 0.0), (True, 2, 4, 2.0), (True, 1, 1, 0.0), (False, 2, 1, 2.0)],
)
def test_decode_kernel_with_a_window_reads_only_the_window(use_dot, kvp, splits, cap):
    """Decode with a sliding window over long contexts (and a soft cap): every key outside the
    window is NaN in the pool, so a kernel that read it (even to mask it) would return NaN; the
    result equals dense attention over the window, split or not, one or two KV heads a
    program, for a context shorter than the window too."""
    from loom.layers.attention.triton_ops import decode_attention

    gen = torch.Generator().manual_seed(splits)
    kv_heads, group, head_dim, window = 2, 2, 16, 24
    seq_lens = [5, 300, 1000]
    slots = sum(seq_lens) + 1
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    perm, used = torch.randperm(slots - 1, generator=gen) + 1, 0
    for r, n in enumerate(seq_lens):
        table[r, :n] = perm[used : used + n]
        used += n
        outside = table[r, : max(n - window, 0)]
        k_buf[outside], v_buf[outside] = torch.nan, torch.nan
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    out = decode_attention(
        *(t.to(dev) for t in (q, k_buf, v_buf, table, torch.arange(len(seq_lens)))),
        torch.tensor(seq_lens, device=dev), scale, splits, use_dot=use_dot, kv_per_program=kvp,
        order=torch.tensor([2, 0, 1], device=dev) if splits == 1 else None, window=window,
        logit_cap=cap,
    ).cpu()  # fmt: skip
    for r, n in enumerate(seq_lens):
        lo = max(n - window, 0)
        idx = table[r, lo:n]
        k = k_buf[idx].repeat_interleave(group, dim=1)
        v = v_buf[idx].repeat_interleave(group, dim=1)
        want = _dense_window_attention(q[r], k, v, n - 1 - lo, scale, window, cap)
        torch.testing.assert_close(out[r], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_extend_kernel_with_a_window_reads_only_the_window(cap):
    """Extend after a long cached prefix with a sliding window (and a soft cap): the keys
    before the first query's window are NaN in the pool and never read; every query (two query
    blocks of a request, and a request without a prefix whose window spans it all) equals
    dense attention over its own window."""
    from loom.layers.attention.triton_ops import extend_attention

    gen = torch.Generator().manual_seed(7)
    kv_heads, group, head_dim, window = 2, 2, 16, 12
    prefix_lens, extend_lens = [400, 0], [40, 9]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    slots = sum(seq_lens) + 1
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    table = torch.zeros(2, max(seq_lens), dtype=torch.int64)
    perm, used = torch.randperm(slots - 1, generator=gen) + 1, 0
    for r, (n, p) in enumerate(zip(seq_lens, prefix_lens, strict=True)):
        table[r, :n] = perm[used : used + n]
        used += n
        outside = table[r, : max(p - window + 1, 0)]
        k_buf[outside], v_buf[outside] = torch.nan, torch.nan
    q = torch.randn(sum(extend_lens), kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    i64 = dict(dtype=torch.int64, device=dev)
    out = extend_attention(
        *(t.to(dev) for t in (q, k_buf, v_buf, table, torch.arange(2))),
        torch.tensor([0, extend_lens[0]], **i64), torch.tensor(extend_lens, **i64),
        torch.tensor(prefix_lens, **i64), max(extend_lens), scale, window=window, logit_cap=cap,
    ).cpu()  # fmt: skip
    start = 0
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        for i in range(e):
            pos = p + i
            lo = max(pos - window + 1, 0)
            idx = table[r, lo : pos + 1]
            k = k_buf[idx].repeat_interleave(group, dim=1)
            v = v_buf[idx].repeat_interleave(group, dim=1)
            want = _dense_window_attention(q[start + i], k, v, pos - lo, scale, window, cap)
            torch.testing.assert_close(out[start + i], want, rtol=1e-4, atol=1e-4)
        start += e


def test_mixed_extend_batch_with_per_layer_windows_and_caps_equals_torch_native(tiny_dir):
    """flash_attention over a tiny Llama whose layers differ as Gemma 2's do (layer 0: a sliding
    window of 4, shorter than the cached prefix, and a soft cap, which take the Triton kernels;
    layer 1: plain, on SDPA; set on the built model's layers): an extend batch of a prompt, a
    prompt after a cached prefix and a trailing one-token row (which takes the decode kernel)
    gives torch_native's logits for every token."""
    from loom.config import ServerArgs
    from loom.layers.attention.layer import Attention
    from tests.test_llama_parity import bound_runner, extend_all_logits

    layout = [(0, 9), (12, 7), (30, 1)]
    seqs = [
        torch.randint(0, 256, (p + e,), generator=torch.Generator().manual_seed(i)).tolist()
        for i, (p, e) in enumerate(layout)
    ]
    logits = []
    for b in ("flash_attention", "torch_native"):
        runner, cache = bound_runner(
            ServerArgs(model=tiny_dir, max_total_tokens=4096, dtype="float32", attention_backend=b)
        )
        layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
        assert len(layers) == 2
        layers[0].sliding_window, layers[0].logit_cap = 4, 3.0
        logits.append(extend_all_logits(runner, cache, layout, seqs))
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "backend,architecture",
    [("triton", "Gemma2ForCausalLM"), ("flash_attention", "Gemma3ForCausalLM")],
)
def test_model_kit_with_windows_and_caps(backend, architecture):
    """The model kit (logits against HF transformers' over extend and decode batches on a paged
    pool) on the Triton kernels: Gemma 2 (a local layer with a window shorter than the prompts,
    a global one, soft caps on both), and Gemma 3 (local and global layers, no cap: under
    flash_attention its global layer takes SDPA and its local one the Triton kernel)."""
    from transformers import AutoModelForCausalLM

    from loom.testing.model import check_model, tiny_config

    def eager_hf(config):  # HF's own soft-capping path (its SDPA one may drop the cap)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    check_model(
        architecture,
        hf_config=tiny_config(architecture),
        reference=eager_hf,
        device=device,
        attention_backend=backend,
    )


@pytest.mark.parametrize(
    "layout",
    [
        [(0, 9), (5, 7), (12, 1), (30, 1), (3, 1)],  # prompts, then decoding rows
        [(17, 1), (0, 1), (40, 1)],  # decoding rows only
        # more decoding rows than the decode kernel splits KV for, padded to the bucket of 48
        [(0, 4)] + [(3 + 2 * i, 1) for i in range(34)],
    ],
)
@pytest.mark.parametrize("all_tokens", [True, False])
def test_mixed_graph_layout_equals_torch_native(tiny_dir, layout, all_tokens):
    """A mixed step laid out as a mixed CUDA graph's (prompt tokens padded to their bucket,
    decoding rows after them padded to theirs, empty prefill request slots), run eagerly here,
    gives torch_native's logits: for every token (prompt logprobs) or each request's last."""
    from loom.config import ServerArgs
    from tests.test_llama_parity import bound_runner, extend_all_logits

    seqs = [
        torch.randint(0, 256, (p + e,), generator=torch.Generator().manual_seed(i)).tolist()
        for i, (p, e) in enumerate(layout)
    ]
    calls = []

    def logits(backend: str) -> torch.Tensor:
        runner, cache = bound_runner(
            ServerArgs(
                model=tiny_dir, max_total_tokens=4096, dtype="float32", attention_backend=backend
            )
        )
        if backend == "triton":
            runner.capture_mixed_graphs(64, capture=False)
            run = runner.mixed_graph_runner.run
            runner.mixed_graph_runner.run = lambda *a, **k: calls.append(1) or run(*a, **k)
        if not all_tokens:  # the last token's logits only: drop the indices the helper asks
            fwd = runner.forward_extend
            runner.forward_extend = lambda *a: fwd(*a[:5]) if len(a) > 6 else fwd(*a)
        return extend_all_logits(runner, cache, layout, seqs)

    out = {b: logits(b) for b in ("triton", "torch_native")}
    assert calls, "the mixed step did not take the graph layout"
    assert out["triton"].shape == out["torch_native"].shape
    assert (out["triton"] - out["torch_native"]).abs().max().item() < 1e-4


def test_mixed_graph_runner_declines_steps_outside_its_buckets():
    from loom.model_executor.mixed_graph_runner import MAX_PREFILL_REQS, MixedGraphRunner

    r = MixedGraphRunner.__new__(MixedGraphRunner)
    r.prefill_buckets, r.decode_buckets = [32, 64], [1, 2, 4]
    from loom.model_executor.mixed_graph_runner import MixedLayout

    r.layout = MixedLayout(4)
    assert r.fits([9, 7, 1, 1]) == (2, 16)
    assert r.fits([1, 1]) == (0, 0)
    assert r.fits([9, 7]) is None  # no decoding row: a prefill step
    assert r.fits([60, 5, 1]) is None  # 65 prompt tokens
    assert r.fits([9] + [1] * 5) is None  # 5 decoding rows
    assert r.fits([2] * (MAX_PREFILL_REQS + 1) + [1]) is None
    assert r.fits([2] * MAX_PREFILL_REQS + [1]) == (MAX_PREFILL_REQS, 2 * MAX_PREFILL_REQS)


@_CPU_AUTO
def test_auto_prefill_prefers_a_backend_with_mixed_graphs_under_mixed_chunks(tiny_dir, monkeypatch):
    """With mixed steps to capture whole, `auto` gives extend batches to the best backend that
    has mixed graphs (``supports_mixed_graph``) before a higher-priority one without them;
    otherwise priority alone decides."""
    from loom import plugins
    from loom.layers.attention.torch_native import TorchNativeAttnBackend
    from loom.layers.attention.triton_backend import TritonAttnBackend
    from loom.model_executor.model_runner import ModelRunner

    class FastPrefill(TorchNativeAttnBackend):
        @classmethod
        def auto_priority(cls, device, phase):
            return 60 if phase == "prefill" else None

    class GraphPrefill(TritonAttnBackend):
        @classmethod
        def auto_priority(cls, device, phase):
            return 50 if phase == "prefill" else None

    kw = dict(model=tiny_dir, skip_tokenizer_init=True, max_total_tokens=256, dtype="float32")
    plugins.register("attention_backend", "fast_prefill_for_test", FastPrefill)
    plugins.register("attention_backend", "graph_prefill_for_test", GraphPrefill)
    try:
        # (the CPU captures no graphs: stand in for CUDA's answer)
        monkeypatch.setattr(
            ModelRunner, "_wants_mixed_graphs", lambda self: self.args.enable_mixed_chunk
        )
        for mixed, want in ((False, "fast_prefill_for_test"), (True, "graph_prefill_for_test")):
            with loom.Engine(enable_mixed_chunk=mixed, **kw) as e:
                assert e.runner.prefill_attention_backend_name == want
    finally:
        plugins.unregister("attention_backend", "fast_prefill_for_test")
        plugins.unregister("attention_backend", "graph_prefill_for_test")
