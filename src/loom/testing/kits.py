from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import torch

from loom import plugins


def _instantiate(family: str, name: str, **kwargs: Any) -> Any:
    target = plugins.resolve(family, name)
    return target(**kwargs) if isinstance(target, type) else target


# ---- attention_backend ------------------------------------------------------------------------


def _reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Dense causal attention for one request in plain PyTorch (fp32): q [n, H, D], k/v [S, Hk, D],
    query i sits at position prefix_len + i and sees keys 0..prefix_len + i."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + prefix_len
    allowed = torch.arange(k.shape[0]).unsqueeze(0) <= q_pos
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def check_attention_backend(
    name: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
    seed: int = 0,
    atol: float | None = None,
    head_dim: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> None:
    """Extend (with and without cached prefixes) and decode over a paged pool with scattered,
    non-contiguous pages, against dense attention computed in plain PyTorch. ``kv_dtype``: a
    KV cache narrower than ``dtype`` (fp8); the reference then reads K/V rounded the same way."""
    from loom.layers.attention.base import AttentionContext
    from loom.layers.attention.layer import Attention
    from loom.mem_cache.memory_pool import KVPool, PageAllocator, ReqToTokenPool
    from loom.model_executor.forward_batch import ForwardBatch, ForwardMode

    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    heads, kv_heads, num_pages = 4, 2, 256
    pool = KVPool(num_pages, page_size, 1, kv_heads, head_dim, kv_dtype or dtype, device)

    def stored(x: torch.Tensor) -> torch.Tensor:  # K/V as the pool keeps them, in ``dtype``
        x = x.to(dtype)
        return x if kv_dtype is None else x.to(kv_dtype).to(dtype)

    table = ReqToTokenPool(8, 512, device)
    alloc = PageAllocator(num_pages, page_size)
    rng.shuffle(alloc._free)  # scattered pages catch backends that assume contiguity
    backend = plugins.resolve("attention_backend", name)(
        AttentionContext(heads, kv_heads, head_dim, dtype, device, pool, table)
    )
    layer = Attention(0, heads, kv_heads, head_dim, head_dim**-0.5)
    tol = atol if atol is not None else (1e-4 if dtype == torch.float32 else 2e-2)

    prefix_lens = [0, 5, 17, 0]
    extend_lens = [9, 1, 30, 64]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    full_k = [torch.randn(s + 1, kv_heads, head_dim, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s + 1, kv_heads, head_dim, generator=gen) for s in seq_lens]
    rows = []
    for s in seq_lens:
        row = table.alloc()
        pages = alloc.alloc(-(-(s + 1) // page_size))
        slots = torch.tensor(
            [pages[i // page_size] * page_size + i % page_size for i in range(s + 1)]
        )
        table.req_to_token[row, : s + 1] = slots.to(device)
        rows.append(row)

    def run(mode, input_lens, prefixes, q, ks, vs):
        locs = torch.cat(
            [
                table.req_to_token[r, p : p + n]
                for r, p, n in zip(rows, prefixes, input_lens, strict=True)
            ]
        )
        seqs = [p + n for p, n in zip(prefixes, input_lens, strict=True)]
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.zeros(sum(input_lens), dtype=torch.long, device=device),
            positions=torch.cat(
                [torch.arange(p, p + n) for p, n in zip(prefixes, input_lens, strict=True)]
            ).to(device),
            out_cache_loc=locs,
            req_pool_indices=torch.tensor(rows, device=device),
            seq_lens=torch.tensor(seqs, device=device),
            seq_lens_cpu=seqs,
            extend_prefix_lens_cpu=prefixes if mode is ForwardMode.EXTEND else None,
            extend_seq_lens_cpu=input_lens if mode is ForwardMode.EXTEND else None,
            req_to_token_pool=table,
            kv_pool=pool,
            attn_backend=backend,
        )
        backend.init_forward_metadata(batch)
        out = backend.forward(
            q.to(device, dtype), ks.to(device, dtype), vs.to(device, dtype), layer, batch
        )
        assert out.shape == (q.shape[0], heads * head_dim), f"{name}: output shape {out.shape}"
        return out.float().cpu()

    # Cached prefixes are written directly into the pool (as an earlier forward would have).
    for r, p, k, v in zip(rows, prefix_lens, full_k, full_v, strict=True):
        if p:
            locs = table.req_to_token[r, :p]
            pool.set_kv(0, locs, k[:p].to(device, dtype), v[:p].to(device, dtype))
    q = torch.randn(sum(extend_lens), heads * head_dim, generator=gen)
    ks = torch.cat([k[p : p + e] for k, p, e in zip(full_k, prefix_lens, extend_lens, strict=True)])
    vs = torch.cat([v[p : p + e] for v, p, e in zip(full_v, prefix_lens, extend_lens, strict=True)])
    out = run(ForwardMode.EXTEND, extend_lens, prefix_lens, q, ks.flatten(1), vs.flatten(1))
    start = 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        ref = _reference_attention(
            q[start : start + e].view(e, heads, head_dim),
            stored(full_k[i][: p + e]),
            stored(full_v[i][: p + e]),
            p,
            head_dim**-0.5,
        )
        err = (out[start : start + e] - ref.flatten(1)).abs().max().item()
        assert err < tol, f"{name}: extend of request {i} (prefix {p}) off by {err:.2e}"
        start += e

    # Decode one more token per request on top of everything above.
    qd = torch.randn(len(rows), heads * head_dim, generator=gen)
    kd = torch.stack([k[s] for k, s in zip(full_k, seq_lens, strict=True)])
    vd = torch.stack([v[s] for v, s in zip(full_v, seq_lens, strict=True)])
    out = run(ForwardMode.DECODE, [1] * len(rows), seq_lens, qd, kd.flatten(1), vd.flatten(1))
    for i, s in enumerate(seq_lens):
        ref = _reference_attention(
            qd[i].view(1, heads, head_dim),
            stored(full_k[i][: s + 1]),
            stored(full_v[i][: s + 1]),
            s,
            head_dim**-0.5,
        )
        err = (out[i] - ref.flatten()).abs().max().item()
        assert err < tol, f"{name}: decode of request {i} off by {err:.2e}"


# ---- schedule_policy --------------------------------------------------------------------------


class _FakePrefixNode:
    def __init__(self, parent=None):
        self.parent, self.children = parent, {}
        if parent is not None:
            parent.children[len(parent.children)] = self


class _FakePrefixView:
    """A small random tree; each request matches a random node of it (or nothing)."""

    def __init__(self, rng: random.Random) -> None:
        root = _FakePrefixNode()
        self.nodes = [root]
        for _ in range(6):
            self.nodes.append(_FakePrefixNode(rng.choice(self.nodes)))
        self.rng = rng
        self.memo: dict[str, tuple[int, object]] = {}

    def match(self, req):
        if req.rid not in self.memo:
            node = self.rng.choice(self.nodes)
            self.memo[req.rid] = (
                (0, None)
                if node.parent is None
                else (
                    self.rng.randint(1, 20),
                    node,
                )
            )
        return self.memo[req.rid]


def check_schedule_policy(name: str, seed: int = 0) -> None:
    """``order`` returns a permutation of the queue and leaves requests untouched."""
    from loom.sampling.sampling_params import SamplingParams
    from loom.scheduler.request import Req

    rng = random.Random(seed)
    policy = _instantiate("schedule_policy", name)
    for size in (0, 1, 7, 40):
        waiting = [
            Req(
                f"r{i}",
                [rng.randrange(100) for _ in range(rng.randint(1, 20))],
                SamplingParams(max_new_tokens=rng.randint(1, 50)),
            )
            for i in range(size)
        ]
        before = [
            (r.rid, list(r.origin_input_ids), r.sampling_params.max_new_tokens) for r in waiting
        ]
        ordered = policy.order(list(waiting), _FakePrefixView(rng))
        assert sorted(map(id, ordered)) == sorted(map(id, waiting)), (
            f"{name}: order() must return a permutation of the waiting requests"
        )
        after = [
            (r.rid, list(r.origin_input_ids), r.sampling_params.max_new_tokens) for r in waiting
        ]
        assert before == after, f"{name}: order() must not mutate requests"


# ---- radix_eviction_policy --------------------------------------------------------------------


@dataclass
class FakeNode:
    """What the radix cache exposes to an eviction policy."""

    creation_time: float
    last_access_time: float
    hit_count: int
    priority: int = 0


def check_radix_eviction_policy(name: str, seed: int = 0) -> None:
    """Keys are deterministic, totally ordered across nodes, and hooks can be called in the
    cache's order (insert, accesses, remove) without error."""
    rng = random.Random(seed)
    policy = _instantiate("radix_eviction_policy", name)
    nodes = []
    for i in range(50):
        node = FakeNode(
            creation_time=float(i),
            last_access_time=float(i),
            hit_count=0,
            priority=rng.randint(0, 3),
        )
        policy.on_insert(node)
        nodes.append(node)
    for t in range(200):
        node = rng.choice(nodes)
        node.last_access_time = 50.0 + t
        node.hit_count += 1
        policy.on_access(node)
    keys = [policy.key(n) for n in nodes]
    assert keys == [policy.key(n) for n in nodes], f"{name}: key() must be deterministic"
    try:
        order = sorted(range(len(nodes)), key=lambda i: keys[i])
    except TypeError as e:
        raise AssertionError(f"{name}: keys must be mutually comparable: {e}") from e
    assert sorted(order) == list(range(len(nodes)))
    snapshot = copy.deepcopy(nodes)
    for n in nodes:
        policy.key(n)
    assert nodes == snapshot, f"{name}: key() must not mutate nodes"
    for n in nodes[:10]:
        policy.on_remove(n)


# ---- lora_eviction_policy ---------------------------------------------------------------------


def check_lora_eviction_policy(name: str, seed: int = 0) -> None:
    """Driven as the LoRA manager drives it (marks on use, a victim among idle loaded adapters,
    then its removal): every victim is one of the candidates, the choice is deterministic, and
    a removed adapter can be loaded and used again."""
    runs = []
    for _ in range(2):
        policy = _instantiate("lora_eviction_policy", name)
        loaded: list[str] = []
        victims = []
        r = random.Random(seed)
        for _step in range(300):
            name_i = f"adapter-{r.randrange(12)}"
            if name_i not in loaded:
                if len(loaded) >= 4:
                    candidates = sorted(r.sample(loaded, r.randint(1, len(loaded))))
                    victim = policy.select_victim(list(candidates))
                    assert victim in candidates, (
                        f"{name}: select_victim returned {victim!r}, not one of {candidates}"
                    )
                    victims.append(victim)
                    policy.remove(victim)
                    loaded.remove(victim)
                loaded.append(name_i)
            policy.mark_used(name_i)
        runs.append(victims)
    assert runs[0] == runs[1], f"{name}: the same uses must give the same victims"


# ---- logits_processor -------------------------------------------------------------------------


def check_logits_processor(
    name: str, params: dict[str, Any] | None = None, vocab_size: int = 64, seed: int = 0
) -> None:
    """Shape and dtype are kept, ``validate_params`` accepts ``params`` (default: the
    processor's ``example_params``), and rows are processed independently (a row's result does
    not depend on which other rows share the call)."""
    proc = _instantiate("logits_processor", name)
    if params is None:
        params = dict(getattr(proc, "example_params", {}))
    proc.validate_params(params)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab_size, generator=gen)
    history = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    together = proc(logits.clone(), [params] * 4, history)
    assert together.shape == logits.shape and together.dtype == logits.dtype, (
        f"{name}: must return logits of the same shape and dtype"
    )
    for i in range(4):
        alone = proc(logits[i : i + 1].clone(), [params], [history[i]])
        assert torch.equal(alone[0], together[i]), f"{name}: rows must be independent"


# ---- hicache_storage --------------------------------------------------------------------------


def check_hicache_storage(
    name: str, extra_config: dict[str, Any] | None = None, seed: int = 0
) -> None:
    """Pages round-trip bit-exactly in every KV dtype; a missing key reads None and does not
    exist; rewriting a page is harmless; two namespaces never see each other's pages; a second
    instance on the same configuration (another process, a restart) reads what the first wrote;
    attach/detach may be repeated."""
    from loom.mem_cache.storage import page_hashes

    extra = dict(extra_config or {})
    cls = plugins.resolve("hicache_storage", name)
    gen = torch.Generator().manual_seed(seed)
    a, b = cls("kit-model-a", **extra), cls("kit-model-b", **extra)
    a.attach()
    b.attach()
    try:
        keys = page_hashes(list(range(32)), 8, extra_key=f"kit-{seed}")
        pages = [
            (torch.randn(2, 2, 8, 2, 4, generator=gen) * 3).to(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.bfloat16)
        ]
        assert a.exists(keys) == [False] * 4, f"{name}: unknown keys must not exist"
        assert a.read(keys[:1]) == [None], f"{name}: a missing page must read as None"
        assert a.write(keys, pages) == [True] * 4, f"{name}: write must report success"
        assert a.exists(keys) == [True] * 4, f"{name}: written pages must exist"
        got = a.read(keys)
        for want, have in zip(pages, got, strict=True):
            assert have is not None and have.dtype == want.dtype and torch.equal(have, want), (
                f"{name}: pages must round-trip exactly"
            )
        assert a.write(keys[:1], pages[:1]) == [True], f"{name}: rewriting must succeed"
        assert torch.equal(a.read(keys[:1])[0], pages[0])
        assert b.exists(keys) == [False] * 4, f"{name}: namespaces must be isolated"
        assert b.read(keys[:1]) == [None]
        again = cls("kit-model-a", **extra)
        again.attach()
        try:
            assert torch.equal(again.read(keys[2:3])[0], pages[2]), (
                f"{name}: another instance must read what the first wrote"
            )
        finally:
            again.detach()
    finally:
        a.detach()
        b.detach()
    a.attach()
    a.detach()


# ---- grammar_backend --------------------------------------------------------------------------


def _allowed(mask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    bits = mask[row].to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, dtype=torch.int64)
    allowed = ((bits.unsqueeze(1) >> shifts) & 1).bool().flatten()
    return allowed[:vocab_size]


def check_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], **options: Any
) -> None:
    """With a real tokenizer: a regex's matcher allows only continuations of the pattern, fills
    only its own row of a shared mask, refuses a forbidden token without changing state, rolls
    back, copies independently, terminates after the pattern and a stop token (the decoded text
    matches the regex), and ``apply_vocab_mask`` sets exactly the forbidden logits to -inf.
    Invalid constraints raise ValueError."""
    import re

    backend = plugins.resolve("grammar_backend", name)(
        tokenizer, vocab_size, stop_token_ids, **options
    )
    for kind, bad_text in (("regex", "(unclosed"), ("json_schema", "{not json")):
        try:
            backend.compile(kind, bad_text)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: an invalid {kind} must raise ValueError")
    pattern = "[0-9]{3}-(ab|cd)"
    m = backend.matcher(backend.compile("regex", pattern))
    mask = backend.allocate_vocab_mask(3)
    backend.reset_vocab_mask(mask)
    m.fill_vocab_mask(mask, 1)
    assert torch.all(mask[0] == -1) and torch.all(mask[2] == -1), (
        f"{name}: fill_vocab_mask must touch only its own row"
    )
    first = _allowed(mask, 1, vocab_size)
    assert 0 < int(first.sum()) < vocab_size, f"{name}: a regex must restrict the first token"
    forbidden = int((~first).nonzero()[0])
    assert not m.accept_token(forbidden), f"{name}: accept_token must refuse a forbidden token"
    again = backend.allocate_vocab_mask(1)
    m.fill_vocab_mask(again, 0)
    assert torch.equal(again[0], mask[1]), f"{name}: a refused token must not change the state"
    # walk the grammar: the lowest allowed token each time, until it terminates
    accepted: list[int] = []
    for _ in range(32):
        if m.is_terminated():
            break
        row = backend.allocate_vocab_mask(1)
        m.fill_vocab_mask(row, 0)
        tok = int(_allowed(row, 0, vocab_size).nonzero()[0])
        if accepted == []:
            fork = m.copy()
        assert m.accept_token(tok), f"{name}: an allowed token must be accepted"
        accepted.append(tok)
    assert m.is_terminated(), f"{name}: the matcher must terminate after the pattern"
    text = tokenizer.decode([t for t in accepted if t not in stop_token_ids])
    assert re.fullmatch(pattern, text), f"{name}: generated {text!r} does not match {pattern}"
    # the copy taken before the first token is unaffected by what the original accepted
    row = backend.allocate_vocab_mask(1)
    fork.fill_vocab_mask(row, 0)
    assert torch.equal(row[0], mask[1]), f"{name}: copy() must be independent"
    # rollback to the start gives the initial mask again
    m.rollback(len(accepted))
    row = backend.allocate_vocab_mask(1)
    m.fill_vocab_mask(row, 0)
    assert torch.equal(row[0], mask[1]), f"{name}: rollback must restore the state"
    # the batch fill (the backend's parallel path) gives each row what its matcher gives alone
    others = [backend.matcher(backend.compile("regex", pat)) for pat in ("[a-z]+", "(yes|no)")]
    batch = backend.allocate_vocab_mask(4)
    backend.reset_vocab_mask(batch)
    backend.fill_vocab_masks([m, *others], batch, [3, 0, 2])
    for matcher, row in zip([m, *others], [3, 0, 2], strict=True):
        alone = backend.allocate_vocab_mask(1)
        matcher.fill_vocab_mask(alone, 0)
        assert torch.equal(batch[row], alone[0]), f"{name}: fill_vocab_masks row {row} differs"
    assert torch.all(batch[1] == -1), f"{name}: fill_vocab_masks touched a row it was not given"
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    want[1, ~first] = float("-inf")
    backend.apply_vocab_mask(logits, mask)
    assert torch.equal(logits, want), f"{name}: apply_vocab_mask must -inf exactly the forbidden"
