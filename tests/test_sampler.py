"""The sampler against formulas: greedy, filtered distributions, seeds."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loom.sampling import triton_sampling
from loom.sampling.sampler import SamplingBatchInfo, filter_probs, sample
from loom.sampling.sampling_params import SamplingParams


def _info(params, vocab=8, output_lens=None):
    return SamplingBatchInfo.build(
        params, output_lens or [0] * len(params), vocab, torch.device("cpu")
    )


def _reference_filtered(logits, temperature, top_k, top_p, min_p):
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, idx in enumerate(order.tolist()):
        if top_k > 0 and rank >= top_k:
            break
        if mass >= top_p:
            break
        if probs[idx] < min_p * probs[order[0]]:
            break
        keep[idx] = True
        mass += probs[idx].item()
    p = torch.where(keep, probs, 0)
    return p / p.sum()


def test_greedy_rows_take_argmax():
    logits = torch.randn(3, 8)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0)]
    assert sample(logits, _info(params)).tolist() == logits.argmax(-1).tolist()


def test_filter_matches_formula():
    torch.manual_seed(0)
    logits = torch.randn(4, 8) * 2
    settings = [(0.7, 3, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (1.0, -1, 1.0, 0.2), (0.9, 5, 0.6, 0.05)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    info = _info(params)
    probs = torch.softmax(logits / info.temperatures, -1)
    got = filter_probs(probs, info)
    for row, (t, k, p, m) in enumerate(settings):
        ref = _reference_filtered(logits[row], t, k, p, m)
        torch.testing.assert_close(got[row] / got[row].sum(), ref)


def test_sample_frequencies_follow_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0]])
    params = [SamplingParams(temperature=0.8, top_k=4)]
    n = 20000
    info = _info(params * n)
    draws = sample(logits.expand(n, -1).clone(), info)
    counts = torch.bincount(draws, minlength=8).float()
    ref = _reference_filtered(logits[0], 0.8, 4, 1.0, 0.0)
    expected = ref * n
    mask = expected > 0
    assert counts[~mask].sum() == 0  # nothing outside top_k
    chi2 = (((counts[mask] - expected[mask]) ** 2) / expected[mask]).sum().item()
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_seeded_rows_are_reproducible_across_batches():
    torch.manual_seed(1)
    logits = torch.randn(1, 64)
    seeded = SamplingParams(temperature=1.0, sampling_seed=42)
    alone = [sample(logits, _info([seeded], 64, [i])).item() for i in range(20)]
    other = SamplingParams(temperature=1.0)
    batch = torch.cat([torch.randn(1, 64), logits, torch.randn(1, 64)])
    in_batch = [
        sample(batch, _info([other, seeded, other], 64, [0, i, 0]))[1].item() for i in range(20)
    ]
    assert alone == in_batch
    assert len(set(alone)) > 1  # positions draw different noise


def test_engine_seed_gives_same_text_alone_and_batched(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7}
    alone = engine.generate("Once upon a time", params)["output_ids"]
    batched = engine.generate(
        ["Tell me a joke", "Once upon a time", "Hi"],
        [{"max_new_tokens": 12, "temperature": 1.0}, params, {"max_new_tokens": 5}],
    )
    assert batched[1]["output_ids"] == alone


@pytest.mark.parametrize("vocab", [128256, 49152, 8192])
def test_two_stage_argmax_is_argmax_with_ties(vocab):
    """The GPU's two-stage argmax returns torch.argmax's index, the first maximum, on ties too."""
    from loom.sampling.sampler import _vocab_split, argmax_two_stage

    torch.manual_seed(0)
    c = _vocab_split(vocab)
    assert c > 1 and vocab % c == 0
    logits = torch.randn(6, vocab)
    logits[1, 7] = logits[1, vocab - 3] = 50.0  # a tie across chunks
    logits[2, 100] = logits[2, 101] = 50.0  # a tie within a chunk
    logits[3] = 0.0  # all equal
    logits[4, vocab - 1] = 99.0  # the last entry
    assert torch.equal(argmax_two_stage(logits, c), logits.argmax(dim=-1))
    assert argmax_two_stage(logits, c)[1] == 7 and argmax_two_stage(logits, c)[3] == 0


# ---- the fused GPU sampling kernel (CPU: Triton's interpreter) ----------------------------------

# CPU tensors through Triton's interpreter (on a GPU machine tests/gpu and the engine-level
# test in test_triton_backend.py run the kernel for real)
_SKIP_UNLESS_INTERPRETER = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="Triton interpreter tests (CPU only)",
)


def _INTERPRETER(test):
    """A Triton-interpreter test: CPU only, and long (each one is a worker's own task)."""
    return pytest.mark.spread(_SKIP_UNLESS_INTERPRETER(test))


_FUSED_LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.2, -0.5, -1.0, -3.0, 0.9, 1.1, -0.1, 0.0])


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Rows of a few logits split into chunks of 8 columns (the last partly masked), so the
    fused kernel's per-chunk partials and their merges run as on a GPU-sized vocabulary
    (chunks of 4,096)."""
    from loom.sampling import triton_sampling

    monkeypatch.setattr(triton_sampling, "_CHUNK", 8)


@pytest.fixture(autouse=True)
def _interpreter_patches_once(monkeypatch):
    patch_triton_language_once(monkeypatch)


def patch_triton_language_once(monkeypatch) -> None:
    """Triton's interpreter patches ``triton.language`` for every launch (restoring it after)
    and again on every call of a ``@triton.jit`` helper inside it, which finds everything
    already patched and changes nothing, yet scans the modules each time: about half the
    interpreter's time in these kernels. Within a launch a helper whose language modules
    that launch (or an earlier helper in it) has patched skips the repeat; every launch still
    patches and restores as Triton does, so the kernels compute exactly the same (the draws
    of a seeded batch are identical with and without this). Without the interpreter, or
    without Triton's ``_patch_lang``, this does nothing."""
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None:
        return
    patched: list[set[int]] = []  # the language modules patched by the launch running now

    class _NothingToRestore:
        def restore(self):
            pass

    def patch_lang(fn):
        mods = fn.__globals__.values()
        langs = {id(m) for m in mods if inspect.ismodule(m) and m in (tl, tl.core)}
        if patched and langs <= patched[0]:
            return _NothingToRestore()
        scope = original(fn)
        if patched:  # a helper's scope is never restored (Triton's way): it lasts the launch
            patched[0] |= langs
            return scope
        patched.append(langs)  # a launch: its scope is restored when the launch ends
        restore = scope.restore

        def restore_launch():
            patched.clear()
            restore()

        scope.restore = restore_launch
        return scope

    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)


def _fused_draws(params, n, seeds=None, logits=None, iters=3, **kw):
    from loom.sampling.triton_sampling import fused_sample

    logits = _FUSED_LOGITS if logits is None else logits
    info = _info(params * n if len(params) == 1 else params, vocab=logits.shape[0])
    rows = logits.expand(len(info.params[0]), -1).clone()
    # 3 rounds narrow their range (6) 17^3 times: these logits (>= 0.1 apart) are resolved.
    # Without top-k and top-p (min-p alone) no round runs, as the scheduler asks.
    search = info.need_top_k or info.need_top_p
    seeds = seeds if seeds is not None else info.seeds
    return fused_sample(rows, info.params, seeds, iters=iters, search=search, **kw)


@_INTERPRETER
@pytest.mark.parametrize("t,k,p,m", [(0.7, 3, 1.0, 0.0), (1.0, -1, 0.8, 0.0), (1.0, -1, 1.0, 0.3)])
def test_fused_kernel_samples_follow_the_filtered_softmax(t, k, p, m):
    """Top-k alone, top-p alone, min-p alone (no search rounds); the three together are
    the 64-threshold test's case. 400 draws: fewer would miss a cut that drops the least
    likely kept token (p = 0.059 under top-p: P(caught) is 1.0 at 400 draws, 0.83 at 300);
    the GPU test draws 20,000."""
    draws = _fused_draws([SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)], 400)
    _assert_follows_filtered(draws, _FUSED_LOGITS, t, k, p, m)


def _assert_follows_filtered(draws, logits, t, k, p, m):
    """No filtered-out token drawn, and the draws' counts fit the sort-based reference."""
    from tests.test_sampling_params import _chi2_p

    counts = torch.bincount(draws, minlength=len(logits)).double()
    want = _reference_filtered(logits, t, k if k > 0 else 0, p, m)
    expected = want / want.sum() * len(draws)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a filtered-out token was sampled"
    assert _chi2_p(counts[keep], expected[keep]) > 1e-3


@_INTERPRETER
def test_fused_kernel_with_64_thresholds_a_round_follows_the_filtered_softmax():
    """64 thresholds a round (two rounds narrow the range 65^2 times) give the same
    distribution: the setting bench/sampling_host.py compares with 16 and 6 rounds."""
    t, k, p, m = 1.3, 5, 0.9, 0.05
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)]
    draws = _fused_draws(params, 400, iters=2, thresholds=64)
    _assert_follows_filtered(draws, _FUSED_LOGITS, t, k, p, m)


# 24 logits 0.02 apart between 0.6 and 1.06, a larger one and a few far below: one search round
# leaves an interval of ~0.4 around the cut holding many of them, so most draws land in it
_DENSE_LOGITS = torch.cat(
    [torch.tensor([2.5]), 0.6 + 0.02 * torch.arange(24.0), torch.tensor([-2.0, -4.0, -6.0])]
)


@_INTERPRETER
@pytest.mark.parametrize("t,k,p", [(1.0, 6, 1.0), (0.8, 9, 0.7)])
def test_fused_kernel_settles_draws_inside_an_open_search_interval(t, k, p, monkeypatch):
    """One search round cannot separate the densely spaced logits around the cut: the draw runs
    over a superset of the kept set and the pick kernel settles draws that land in the open
    interval (an exact check of the cut's definition at the drawn logit, a redraw above it when
    it fails). The result still follows the filtered softmax; without the settling, filtered
    tokens would be drawn."""
    # chunks of 16 columns: two chunks (the second partly masked) for the 28 logits, so the
    # merges run (the interpreter's time grows with the chunks)
    monkeypatch.setattr(triton_sampling, "_CHUNK", 16)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)]
    draws = _fused_draws(params, 300, logits=_DENSE_LOGITS, iters=1)
    _assert_follows_filtered(draws, _DENSE_LOGITS, t, k, p, 0.0)


@_INTERPRETER
def test_fused_kernel_keeps_a_tie_at_the_cut_whole():
    """Four logits tied at top-k's cut (as bf16 logits often are): the rounds cannot split the
    tie, the interval stays open holding that one value, and the pick kernel keeps the tie
    whole without a check; the draws follow the softmax over the top logit and all four tied
    ones (the sort-based reference would keep an arbitrary two of them)."""
    from tests.test_sampling_params import _chi2_p

    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, 1.5])
    # 200 draws: a split tie (two or three of the four kept) fails with P > 0.9999, a uniform
    # draw over the five with P = 0.99 (chi-square at p = 1e-3)
    n = 200
    draws = _fused_draws([SamplingParams(temperature=1.0, top_k=3)], n, logits=logits)
    counts = torch.bincount(draws, minlength=len(logits)).double()
    keep = torch.zeros(len(logits), dtype=torch.bool)
    keep[:5] = True
    assert counts[~keep].sum() == 0, "a token below the tie was sampled"
    want = torch.softmax(logits[keep], -1) * n
    assert _chi2_p(counts[keep], want) > 1e-3


def gumbel_matches_per_column_philox(device) -> bool:
    """``_gumbel``'s noise for a block equals Philox evaluated column by column (counter
    ``c // 4``, output ``c % 4``): the noise of a column does not depend on the block or chunk
    it is drawn in."""
    import triton
    import triton.language as tl

    @triton.jit
    def noise(Out, seed, start, BLOCK: tl.constexpr):
        tl.store(Out + tl.arange(0, BLOCK), triton_sampling._gumbel(seed, start, 3, BLOCK))

    @triton.jit
    def reference(Out, seed, start, BLOCK: tl.constexpr):
        c = start + tl.arange(0, BLOCK)
        i0, i1, i2, i3 = tl.randint4x(seed, (c // 4).to(tl.int64) + 3 * 4294967296)
        k = c % 4
        r = tl.where(k == 0, i0, tl.where(k == 1, i1, tl.where(k == 2, i2, i3)))
        u = tl.random.uint_to_uniform_float(r)
        tl.store(Out + tl.arange(0, BLOCK), -tl.log(-tl.log(u)))

    a = torch.empty(64, device=device)
    b = torch.empty(64, device=device)
    noise[(1,)](a, 987654321, 128, BLOCK=64)
    reference[(1,)](b, 987654321, 128, BLOCK=64)
    halves = torch.empty(64, device=device)
    noise[(1,)](halves, 987654321, 128, BLOCK=32)
    noise[(1,)](halves[32:], 987654321, 160, BLOCK=32)
    return torch.equal(a, b) and torch.equal(a, halves) and len(set(a.tolist())) == 64


@_INTERPRETER
def test_gumbel_noise_is_philox_per_column():
    assert gumbel_matches_per_column_philox("cpu")


@_INTERPRETER
def test_fused_kernel_greedy_rows_masks_and_seeds():
    logits = _FUSED_LOGITS.clone()
    logits[0] = float("-inf")  # a grammar mask: never drawn
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.95)] * 60
    draws = _fused_draws(params, 1, logits=logits)
    assert (draws[0::2] == logits.argmax()).all()  # greedy rows: the first maximum
    assert (draws != 0).all()
    assert len(set(draws[1::2].tolist())) > 3  # sampled rows vary
    seeded = [SamplingParams(temperature=1.0, sampling_seed=7)] * 4
    a = _fused_draws(seeded, 1, seeds=[(i, 7, 5) for i in range(4)])
    b = _fused_draws(seeded, 1, seeds=[(i, 7, 5) for i in range(4)])
    assert torch.equal(a, b) and len(set(a.tolist())) == 1  # same seed and position: same draw


@_INTERPRETER
def test_row_seeds_replay_the_eager_draws_of_seeded_rows():
    """Per-row seeds on the device (``row_seeds``), advanced by one a step: a seeded row then
    draws exactly what the eager path draws at each output position; unseeded rows get
    distinct streams."""
    from loom.sampling.triton_sampling import fused_sample, per_row_seeds

    params = [SamplingParams(temperature=1.3, top_p=0.95, sampling_seed=s) for s in (3, 9)]
    params += [SamplingParams(temperature=1.3)] * 2
    info = _info(params, vocab=len(_FUSED_LOGITS))
    rows = _FUSED_LOGITS.expand(4, -1).contiguous()
    seeds = per_row_seeds(4, [(0, 3, 10), (1, 9, 4)])
    assert len(set(seeds)) == 4
    row_seeds = torch.tensor(seeds)
    for step in range(3):
        eager = [(0, 3, 10 + step), (1, 9, 4 + step)]
        want = fused_sample(rows.clone(), info.params, eager, iters=3)
        got = fused_sample(rows.clone(), info.params, None, iters=3, row_seeds=row_seeds)
        assert torch.equal(got[:2], want[:2]), step
        row_seeds = row_seeds + 1


def _penalty_case(rows: int, vocab: int, seed: int):
    """A PenaltyState with random counts and prompt tokens per row, random coefficients, and a
    logit bias per row (with an -inf entry, as min_new_tokens sets), as the fused kernel and
    the PyTorch reference (``_apply_dense`` then the bias) take them."""
    from loom.sampling.penalties import PenaltyState

    gen = torch.Generator().manual_seed(seed)
    state = PenaltyState(vocab, torch.device("cpu"), capacity=rows + 3)
    state_rows = []
    for _ in range(rows):
        prompt = torch.randint(0, vocab, (5,), generator=gen).tolist()
        r = state.alloc(prompt)
        state.counts[r] = torch.randint(0, 3, (vocab,), generator=gen, dtype=torch.int32)
        state_rows.append(r)
    coef = [
        (torch.rand(rows, generator=gen) * 0.8).tolist(),
        (torch.rand(rows, generator=gen) * 0.8).tolist(),
        (1.0 + torch.rand(rows, generator=gen)).tolist(),
    ]
    if rows > 1:  # a row without penalties in the batch
        state_rows[1] = -1
        coef[0][1], coef[1][1], coef[2][1] = 0.0, 0.0, 1.0
    bias = []
    for i in range(rows):
        cols = torch.randperm(vocab, generator=gen)[: 1 + i % 3].tolist()
        row = {c: float(torch.randn(1, generator=gen)) for c in cols}
        if i % 2 == 0:
            row[cols[0]] = float("-inf")
        bias.append(row)
    return state, state_rows, coef, bias


def _penalised_reference(logits, state, state_rows, coef, bias):
    from loom.sampling.penalties import _apply_dense

    want = logits.clone()
    with_pen = [i for i, s in enumerate(state_rows) if s >= 0]
    idx = torch.tensor(with_pen)
    c = torch.tensor(coef)[:, idx]
    _apply_dense(want, idx, torch.tensor(state_rows)[idx], state, c[0], c[1], c[2])
    for i, row in enumerate(bias):
        for t, v in row.items():
            want[i, t] += v
    return want


@_INTERPRETER
def test_fused_kernel_applies_penalties_and_bias_then_counts_the_token():
    """Penalties, logit bias (min_new_tokens' -inf too) and greedy draws in the one kernel
    equal the PyTorch path (_apply_dense, index_add_, argmax); the counts of penalised rows
    advance by the drawn token, those of others do not move. An all-greedy batch runs the prep
    and pick kernels alone (``greedy_only``, as the scheduler asks)."""
    from loom.sampling.triton_sampling import FusedPenalties, fused_sample

    rows, vocab = 6, 40
    state, state_rows, coef, bias = _penalty_case(rows, vocab, seed=1)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)) * 2
    want = _penalised_reference(logits, state, state_rows, coef, bias)
    counts_before = state.counts.clone()
    info = SamplingBatchInfo.build(
        [SamplingParams(temperature=0.0)] * rows, [0] * rows, vocab, torch.device("cpu"),
        with_params=True,
    )  # fmt: skip
    extras = FusedPenalties.build(state_rows, coef, bias, torch.device("cpu"))
    got = logits.clone()
    tokens = fused_sample(
        got, info.params, [], extras=extras, state=state, greedy_only=info.is_all_greedy
    )
    torch.testing.assert_close(got, want)  # applied in place
    assert torch.equal(tokens, want.argmax(dim=-1))
    expect = counts_before.clone()
    for i, s in enumerate(state_rows):
        if s >= 0:
            expect[s, tokens[i]] += 1
    assert torch.equal(state.counts, expect)


@_INTERPRETER
def test_fused_kernel_applies_a_grammar_bitmask_after_penalties_and_bias():
    """A grammar's packed bitmask (bit set: allowed), applied inside the fused kernels after
    penalties and bias, masks the logits in place exactly as xgrammar's own kernel does on the
    penalised logits; greedy rows take the best allowed token, sampled rows draw only allowed
    ones."""
    xgr = pytest.importorskip("xgrammar")
    from loom.sampling.triton_sampling import FusedPenalties, fused_sample

    rows, vocab = 6, 40  # two mask words, the second partly used
    state, state_rows, coef, bias = _penalty_case(rows, vocab, seed=3)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[:, 7] = True
    bits = torch.zeros(rows, 2, dtype=torch.int64)
    for r, c in allowed.nonzero().tolist():
        bits[r, c // 32] |= 1 << (c % 32)
    mask = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    want = _penalised_reference(logits, state, state_rows, coef, bias)
    xgr.apply_token_bitmask_inplace(want, mask)  # the library's kernel as the oracle
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_p=0.9)] * 3
    info = SamplingBatchInfo.build(
        params, [0] * rows, vocab, torch.device("cpu"), with_params=True
    )  # fmt: skip
    extras = FusedPenalties.build(state_rows, coef, bias, torch.device("cpu"))
    got = logits.clone()
    tokens = fused_sample(
        got, info.params, [], iters=3, extras=extras, state=state, vocab_mask=mask
    )  # fmt: skip
    torch.testing.assert_close(got, want)  # applied in place
    assert torch.equal(tokens[:3], want[:3].argmax(dim=-1))
    assert all(allowed[r, t] for r, t in enumerate(tokens.tolist()))


@_INTERPRETER
def test_fused_kernel_with_penalties_samples_the_penalised_softmax():
    from loom.sampling.triton_sampling import FusedPenalties, fused_sample
    from tests.test_sampling_params import _chi2_p

    n, vocab = 400, len(_FUSED_LOGITS)
    state, state_rows, coef, bias = _penalty_case(1, vocab, seed=3)
    one = _penalised_reference(_FUSED_LOGITS.view(1, -1), state, state_rows, coef, bias)[0]
    # n rows, each with its own copy of the state row (one state row per batch row)
    s0 = state_rows[0]
    state.counts = state.counts[s0].expand(n, -1).clone()
    state.in_prompt = state.in_prompt[s0].expand(n, -1).clone()
    extras = FusedPenalties.build(
        list(range(n)), [[c[0]] * n for c in coef], bias * n, torch.device("cpu")
    )
    t, p = 1.2, 0.9
    info = _info([SamplingParams(temperature=t, top_p=p)] * n, vocab=vocab)
    rows = _FUSED_LOGITS.expand(n, -1).clone()
    draws = fused_sample(rows, info.params, [], iters=3, extras=extras, state=state)
    counts = torch.bincount(draws, minlength=vocab).double()
    want = _reference_filtered(one, t, 0, p, 0.0)
    expected = want / want.sum() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a filtered-out token was sampled"
    assert _chi2_p(counts[keep], expected[keep]) > 1e-3
