"""The multi-LoRA Triton kernels (loom.lora.triton_ops) against their PyTorch oracle: on CPU
under TRITON_INTERPRET=1 (tests/conftest.py sets it) at tiny shapes, and on CUDA at Llama-3-8B's
qkv shapes, including a captured CUDA graph replayed with other slots."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from loom.lora import triton_ops as ops
from loom.lora.batch import make_lora_batch, segments_of

pytestmark = pytest.mark.skipif(not ops.HAS_TRITON, reason="triton not installed")

# the small tests run on CUDA when there is one, else on CPU under the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GARBAGE = 1e3  # written where the kernels must not read: off-diagonal B blocks, rank padding


def lora_reference(
    x: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
    token_slot: torch.Tensor,
    slice_sizes: Sequence[int],
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The update ``delta [T, out]`` (fp32) the kernels add to ``y``, in plain PyTorch: per slot,
    per slice, only the slice's diagonal block of B (and with ``slot_ranks`` only the first
    ``rank`` rows/columns of each slice), so it ignores whatever the rest of the pool holds."""
    num_slices = len(slice_sizes)
    r = a_buf.shape[1] // num_slices
    offs = ops._offsets_of(slice_sizes)
    xf = x.float()
    delta = torch.zeros(x.shape[0], b_buf.shape[1], device=x.device, dtype=torch.float32)
    slots = token_slot.long()
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = torch.nonzero(slots == s).flatten()
        k = r if slot_ranks is None else min(r, int(slot_ranks[s]))
        for j, size in enumerate(slice_sizes):
            a = a_buf[s, j * r : j * r + k].float()  # [k, in]
            b = b_buf[s, offs[j] : offs[j] + size, j * r : j * r + k].float()  # [size, k]
            delta[idx, offs[j] : offs[j] + size] = (xf[idx] @ a.t()) @ b.t()
    return delta


def make_pool(slots, n_in, slice_sizes, r, ranks=None, dtype=torch.float32, device=DEV, seed=0):
    """A pool laid out as LoRAManager's: per slice j, A rows j*r.. and B's diagonal block.
    Entries the kernels must not read (off-diagonal B, and with ``ranks`` the padding past each
    slot's rank) hold GARBAGE; the oracle ignores them, so reading them fails the comparison."""
    gen = torch.Generator().manual_seed(seed)
    s_count = len(slice_sizes)
    a = torch.randn(slots, s_count * r, n_in, generator=gen) / n_in**0.5
    b = torch.full((slots, sum(slice_sizes), s_count * r), GARBAGE)
    row = 0
    for j, size in enumerate(slice_sizes):
        b[:, row : row + size, j * r : (j + 1) * r] = torch.randn(slots, size, r, generator=gen)
        b[:, row : row + size, j * r : (j + 1) * r] /= r**0.5
        row += size
    if ranks is not None:
        for s, k in enumerate(ranks):
            for j in range(s_count):
                a[s, j * r + k : (j + 1) * r] = GARBAGE
                b[s, :, j * r + k : (j + 1) * r] = GARBAGE
    return a.to(device, dtype), b.to(device, dtype)


def token_slots(t, slots, seed):
    """A mix of slots and -1, in runs (as requests' tokens come) and singletons."""
    gen = torch.Generator().manual_seed(seed)
    choices = list(range(-1, slots))
    out = []
    while len(out) < t:
        s = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        out += [s] * int(torch.randint(1, 5, (1,), generator=gen))
    out = out[:t]
    if t > 2:
        out[0], out[-1] = -1, 0  # both kinds present
    return out


CASES = [  # (slice sizes, r, T)
    ([40], 4, 1),
    ([40], 8, 17),
    ([40, 24], 8, 5),
    ([24, 24], 4, 17),
    ([32, 16, 16], 8, 17),
    ([32, 16, 16], 4, 5),
    ([32, 16, 16], 8, 1),
]
N_IN, SLOTS = 48, 3  # 48 features: three BLOCK_K=16 chunks, and not a power of two


def run(path, x, y, a, b, slots, sizes, ranks=None, splits=None):
    device = x.device
    batch = make_lora_batch(slots, device)
    segs = batch.segments if path == "segment" else None
    v = ops.lora_shrink(
        x, a, batch.token_slot, len(sizes), segments=segs, slot_ranks=ranks,
        num_splits=splits, block_k=16, reduce=splits is None,
    )  # fmt: skip
    offs = [sum(sizes[:j]) for j in range(len(sizes))]
    # with splits, the expand takes the partials [splits, T, S*r] unreduced
    ops.lora_expand(v, b, batch.token_slot, offs, y, segments=segs, slot_ranks=ranks, block_n=16)
    return v if v.dim() == 2 else v.sum(0)


@pytest.mark.parametrize("sizes,r,t", CASES)
@pytest.mark.parametrize("path", ["gather", "segment"])
def test_fp32_matches_reference(sizes, r, t, path):
    a, b = make_pool(SLOTS, N_IN, sizes, r)
    slots = token_slots(t, SLOTS, seed=t + r)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, N_IN, generator=gen).to(DEV)
    y0 = torch.randn(t, sum(sizes), generator=gen).to(DEV)
    y = y0.clone()
    ts = torch.tensor(slots, dtype=torch.int32, device=DEV)
    v = run(path, x, y, a, b, slots, sizes, splits=2 if t == 5 else None)
    ref = lora_reference(x, a, b, ts, sizes)
    torch.testing.assert_close(y, y0 + ref, rtol=1e-5, atol=1e-5)
    none = ts < 0
    assert torch.equal(y[none], y0[none])  # tokens without an adapter are untouched
    assert not v[none].any()  # and their v rows are zero
    # v against A x directly
    vr = torch.stack(
        [
            a[s] @ x[i] if s >= 0 else torch.zeros(a.shape[1], device=DEV)
            for i, s in enumerate(slots)
        ]
    )
    torch.testing.assert_close(v, vr, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [ops.SPLIT_CHUNK + 4, 2 * ops.SPLIT_CHUNK])
def test_gather_expand_reads_splits_in_chunks(splits):
    """More partial sums than the gather expand reads in one load, each of one 16-feature
    chunk of ``in``: the sum is the reference's."""
    sizes, r, t, n_in = [32, 16, 16], 8, 5, 16 * splits
    a, b = make_pool(SLOTS, n_in, sizes, r)
    slots = token_slots(t, SLOTS, seed=3)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, n_in, generator=gen).to(DEV)
    y0 = torch.randn(t, sum(sizes), generator=gen).to(DEV)
    y = y0.clone()
    run("gather", x, y, a, b, slots, sizes, splits=splits)
    ts = torch.tensor(slots, dtype=torch.int32, device=DEV)
    torch.testing.assert_close(y, y0 + lora_reference(x, a, b, ts, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["gather", "segment"])
def test_mixed_ranks_skip_padding(path):
    """With slot_ranks the padding (GARBAGE here) is never read."""
    sizes, r, t = [32, 16, 16], 8, 17
    ranks = [8, 4, 2]
    a, b = make_pool(SLOTS, N_IN, sizes, r, ranks=ranks)
    rk = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    slots = token_slots(t, SLOTS, seed=3)
    x = torch.randn(t, N_IN, generator=torch.Generator().manual_seed(2)).to(DEV)
    y = torch.zeros(t, sum(sizes), device=DEV)
    run(path, x, y, a, b, slots, sizes, ranks=rk)
    ref = lora_reference(x, a, b, torch.tensor(slots), sizes, slot_ranks=rk)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["gather", "segment"])
def test_bf16(path):
    # bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%). The kernels accumulate in fp32 from
    # the same bf16 inputs the oracle reads, so what differs is the rounding of y to bf16 (0.4%
    # of |y|, |y| ~ 3) and, on the segment path, of v before the tensor-core dot (0.4% of each
    # term): 2e-2 absolute and relative leave a few times that margin.
    sizes, r, t = [32, 16, 16], 8, 17
    a, b = make_pool(SLOTS, N_IN, sizes, r, dtype=torch.bfloat16)
    slots = token_slots(t, SLOTS, seed=5)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(t, N_IN, generator=gen).to(DEV, torch.bfloat16)
    y0 = torch.randn(t, sum(sizes), generator=gen).to(DEV, torch.bfloat16)
    y = y0.clone()
    run(path, x, y, a, b, slots, sizes)
    ref = y0.float() + lora_reference(x, a, b, torch.tensor(slots), sizes)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_shrink_expand_dispatch_and_no_adapter():
    sizes, r = [32, 16, 16], 4
    a, b = make_pool(SLOTS, N_IN, sizes, r)
    # runs of 1-4 tokens (gather), then one run of 3 tokens and one of 60 (segments)
    for slots in (token_slots(5, SLOTS, seed=5), [1] * 3 + [-1] * 5 + [2] * 60):
        t = len(slots)
        x = torch.randn(t, N_IN, generator=torch.Generator().manual_seed(t)).to(DEV)
        y = torch.zeros(t, sum(sizes), device=DEV)
        ops.lora_shrink_expand(x, y, a, b, sizes, make_lora_batch(slots, DEV))
        ref = lora_reference(x, a, b, torch.tensor(slots), sizes)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # a batch with no adapter at all leaves y alone
    y = torch.ones(4, sum(sizes), device=DEV)
    x = torch.randn(4, N_IN, device=DEV)
    ops.lora_shrink_expand(x, y, a, b, sizes, make_lora_batch([-1] * 4, DEV))
    assert torch.equal(y, torch.ones_like(y))


def test_segments_of():
    segs = segments_of([-1, 2, 2, 0, -1, 0, 0, 0, 1], "cpu")
    assert segs.start.tolist() == [1, 3, 5, 8]
    assert segs.length.tolist() == [2, 1, 3, 1]
    assert segs.slot.tolist() == [2, 0, 0, 1]
    assert segs.max_len == 3
    assert segments_of([-1, -1], "cpu").max_len == 0


def test_rejects_bad_offsets():
    a, b = make_pool(1, 8, [8, 8], 4, device="cpu")
    v, y = torch.zeros(1, 8), torch.zeros(1, 16)
    with pytest.raises(ValueError, match="ascend"):
        ops.lora_expand(v, b, torch.zeros(1, dtype=torch.int32), [0, 20], y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCuda:
    SIZES = [4096, 1024, 1024]  # Llama-3-8B's qkv
    N_IN, R, SLOTS = 4096, 16, 8
    # bf16 with fp32 accumulation; see test_bf16 (|delta| ~ 1 here)
    TOL = dict(rtol=2e-2, atol=3e-2)

    def pool(self, ranks=None):
        a, b = make_pool(
            self.SLOTS, self.N_IN, self.SIZES, self.R, ranks=ranks, dtype=torch.bfloat16,
            device="cuda",
        )  # fmt: skip
        return a, b

    @pytest.mark.parametrize("t", [1, 64, 512])
    @pytest.mark.parametrize("segments", [False, True])
    def test_matches_reference(self, t, segments):
        a, b = self.pool()
        slots = token_slots(t, self.SLOTS, seed=t)
        x = torch.randn(t, self.N_IN, device="cuda", dtype=torch.bfloat16)
        y = torch.zeros(t, sum(self.SIZES), device="cuda", dtype=torch.bfloat16)
        batch = make_lora_batch(slots, "cuda", segments=segments)
        ops.lora_shrink_expand(x, y, a, b, self.SIZES, batch)
        ref = lora_reference(x, a, b, batch.token_slot, self.SIZES)
        torch.testing.assert_close(y.float(), ref, **self.TOL)

    def test_mixed_ranks(self):
        ranks = [16, 8, 4, 16, 1, 2, 16, 12]
        a, b = self.pool(ranks)
        rk = torch.tensor(ranks, dtype=torch.int32, device="cuda")
        for t in (17, 300):
            slots = token_slots(t, self.SLOTS, seed=t)
            x = torch.randn(t, self.N_IN, device="cuda", dtype=torch.bfloat16)
            y = torch.zeros(t, sum(self.SIZES), device="cuda", dtype=torch.bfloat16)
            batch = make_lora_batch(slots, "cuda")
            ops.lora_shrink_expand(x, y, a, b, self.SIZES, batch, slot_ranks=rk)
            ref = lora_reference(x, a, b, batch.token_slot, self.SIZES, slot_ranks=rk)
            torch.testing.assert_close(y.float(), ref, **self.TOL)

    @pytest.mark.parametrize("t", [1, 64, 512])
    def test_cuda_graph_replay_with_new_slots(self, t):
        a, b = self.pool()
        x = torch.randn(t, self.N_IN, device="cuda", dtype=torch.bfloat16)
        y0 = torch.randn(t, sum(self.SIZES), device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(y0)
        batch = make_lora_batch(token_slots(t, self.SLOTS, seed=1), "cuda", segments=False)

        def step():
            y.copy_(y0)
            ops.lora_shrink_expand(x, y, a, b, self.SIZES, batch)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for seed in (2, 3):
            slots = token_slots(t, self.SLOTS, seed=seed)
            batch.token_slot.copy_(torch.tensor(slots, dtype=torch.int32))
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            ref = y0.float() + lora_reference(x, a, b, batch.token_slot, self.SIZES)
            torch.testing.assert_close(y.float(), ref, **self.TOL)


@pytest.mark.parametrize("runs", [1, 2, 3, 5, 64])
def test_segment_rows_are_16_byte_aligned(runs):
    """Triton specialises pointers on 16-byte alignment: the segment rows must be aligned for
    any number of runs, or a batch compiles kernel variants the warm-up's did not."""
    slots = [i % 3 for i in range(runs) for _ in range(2)]
    segs = segments_of(slots, "cpu")
    assert segs.start.shape[0] == runs
    for row in (segs.start, segs.length, segs.slot):
        assert row.data_ptr() % 16 == 0
    assert segs.length.tolist() == [2] * runs
    assert segs.start.tolist() == list(range(0, 2 * runs, 2))
    assert segs.slot.tolist() == [i % 3 for i in range(runs)]
