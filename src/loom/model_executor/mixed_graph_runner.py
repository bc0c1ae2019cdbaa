"""Whole CUDA graphs for mixed steps (``--enable-mixed-chunk``): a prefill chunk and the running
requests' decode rows in one forward, attention included.

A mixed step as piecewise graphs runs each layer's attention eagerly between the graphs, and a
serving stream's inter-token gap is that step whenever a prompt arrives. On the H200 (serving
SmolLM2 under Poisson arrivals, docs/benchmarks.md) such a step costs 10.8 ms at its median
against 1.6 ms for a decode step, almost all of it host launches; as one graph, 1.9 ms. Attention can be captured too once its metadata has fixed shapes:
each graph is keyed by (P, D), a prompt-token bucket and a decode-row bucket, and lays the step
out as

- tokens ``[0, P)``: the prefill requests' new tokens, concatenated, then padding;
- tokens ``[P, P + D)``: the decoding rows, one token each, then padding;
- up to ``MAX_PREFILL_REQS`` prefill requests, the rest of them ``extend_len`` 0.

Padding tokens compute token 0 at position 0 into slot 0 (the padding page, as the decode
graphs' padding rows do); padded prefill requests have no tokens (the extend kernel's programs
return at once); padded decode rows read one token of request row 0. The step's real tokens and
requests are copied into static buffers (two copies), the graph replays, and the logits are
taken at the real tokens' places in that layout.

The attention backend supplies the metadata over the static buffers
(``AttentionBackend.mixed_graph_metadata``); backends without it run mixed steps piecewise.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from loom.forward_batch import ForwardBatch, ForwardMode, int64_tensor

logger = logging.getLogger(__name__)

MAX_PREFILL_REQS = 16  # prefill requests a mixed graph holds; a step with more runs piecewise


def prefill_buckets(max_tokens: int) -> list[int]:
    return sorted({b for b in (32, 64, 128, 256, 512) if b < max_tokens} | {max_tokens})


def decode_buckets(max_rows: int) -> list[int]:
    """Coarser than the decode graphs' (a padded decode row costs one token of per-token work
    and one KV read), so that prompt buckets times these stay a few dozen graphs."""
    sizes = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    return sorted({b for b in sizes if b < max_rows} | {max_rows})


class MixedLayout:
    """Where a mixed step's tokens and requests go in the static buffers: ``E`` prefill request
    slots, then ``max_rows`` decode rows; ``meta`` rows: request rows and sequence lengths (both
    ``E + max_rows``), then the prefill requests' query starts, new-token counts and prefixes."""

    def __init__(self, max_rows: int, E: int = MAX_PREFILL_REQS) -> None:
        self.E = E
        self.max_rows = max_rows
        n = E + max_rows
        self.ROWS, self.LENS = 0, n
        self.QSTART, self.EXT, self.PREFIX = 2 * n, 2 * n + E, 2 * n + 2 * E
        self.size = 2 * n + 3 * E
        # padding: request row 0; decode rows have one token, prefill slots none
        self.template = [0] * self.size
        for j in range(E, n):
            self.template[self.LENS + j] = 1

    def meta(
        self,
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        num_prefill: int,
    ) -> list[int]:
        """The meta row for a step whose first ``num_prefill`` requests prefill (the rest
        decode one token each)."""
        m = self.template.copy()
        E, k = self.E, num_prefill
        start = 0
        for i in range(k):
            ext = extend_lens[i]
            m[self.ROWS + i] = rows[i]
            m[self.LENS + i] = prefix_lens[i] + ext
            m[self.QSTART + i] = start
            m[self.EXT + i] = ext
            m[self.PREFIX + i] = prefix_lens[i]
            start += ext
        d = len(rows) - k
        m[self.ROWS + E : self.ROWS + E + d] = rows[k:]
        m[self.LENS + E : self.LENS + E + d] = [p + 1 for p in prefix_lens[k:]]
        return m

    @staticmethod
    def logit_index(i: int, num_prefill_tokens: int, P: int) -> int:
        """Token ``i`` of the step (its tokens concatenated) in the graph's layout."""
        return i if i < num_prefill_tokens else P + (i - num_prefill_tokens)


class MixedGraphRunner:
    """``forward_hidden(input_ids, positions, batch)``: the model's forward up to its final
    hidden states; ``attach(batch)``: the batch with the KV pools and ``backend`` attached.
    ``capture``: record the graphs (False: run the same layout eagerly, which tests use where
    there is no CUDA)."""

    def __init__(
        self,
        forward_hidden: Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor],
        attach: Callable[[ForwardBatch], ForwardBatch],
        backend,
        device: torch.device,
        max_prefill_tokens: int,
        max_rows: int,
        capture: bool = True,
    ) -> None:
        self.forward_hidden = forward_hidden
        self.attach = attach
        self.backend = backend
        self.prefill_buckets = prefill_buckets(max_prefill_tokens)
        self.decode_buckets = decode_buckets(max_rows)
        self.layout = MixedLayout(self.decode_buckets[-1])
        self.max_tokens = self.prefill_buckets[-1] + self.decode_buckets[-1]
        self.static = torch.zeros(3, self.max_tokens, dtype=torch.int64, device=device)
        self.meta = torch.tensor(self.layout.template, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.captured = capture
        if capture:
            self.pool = torch.cuda.graph_pool_handle()
            with torch.inference_mode():
                for P in reversed(self.prefill_buckets):  # largest first: the rest reuse its pool
                    for D in reversed(self.decode_buckets):
                        self._capture(P, D)
            logger.info(
                "captured %d CUDA graphs for mixed steps (prompt tokens %s x decode rows %s)",
                len(self.graphs),
                self.prefill_buckets,
                self.decode_buckets,
            )

    def _forward(self, P: int, D: int) -> torch.Tensor:
        lay, E = self.layout, self.layout.E
        ids, pos, loc = (row[: P + D] for row in self.static)
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=E + D,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_pool_indices=self.meta[lay.ROWS : lay.ROWS + E + D],
            seq_lens=self.meta[lay.LENS : lay.LENS + E + D],
            seq_lens_cpu=[],
        )
        self.attach(batch)
        batch.attn_metadata = self.backend.mixed_graph_metadata(
            batch,
            num_prefill_reqs=E,
            num_prefill_tokens=P,
            q_start=self.meta[lay.QSTART : lay.QSTART + E],
            extend_lens=self.meta[lay.EXT : lay.EXT + E],
            prefix_lens=self.meta[lay.PREFIX : lay.PREFIX + E],
        )
        return self.forward_hidden(ids, pos, batch)

    def _capture(self, P: int, D: int) -> None:
        for _ in range(2):  # compile kernels and settle the allocator outside the graph
            self._forward(P, D)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[P, D] = self._forward(P, D)
        self.graphs[P, D] = graph

    def fits(self, extend_lens: list[int]) -> tuple[int, int] | None:
        """(prefill requests, their tokens) of a step this runner serves: one with decoding
        rows (trailing one-token requests) within the buckets; None otherwise."""
        k = len(extend_lens)
        while k > 0 and extend_lens[k - 1] == 1:
            k -= 1
        d = len(extend_lens) - k
        if d == 0 or k > self.layout.E or d > self.decode_buckets[-1]:
            return None
        tokens = sum(extend_lens[:k])
        if tokens > self.prefill_buckets[-1]:
            return None
        return k, tokens

    def run(
        self,
        packed: torch.Tensor,
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        fit: tuple[int, int],
        logit_indices: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states of a mixed step in the graph's layout, and the indices of
        the tokens whose logits it returns (each request's last token, then padding up to the
        bucket's row count; or ``logit_indices`` of its tokens concatenated). ``packed``: its tokens' ids, positions and KV slots
        (``[3, num_tokens]`` on the device); ``fit``: :meth:`fits`' answer."""
        k, n_p = fit
        d = len(rows) - k
        P = self.prefill_buckets[bisect.bisect_left(self.prefill_buckets, n_p)]
        D = self.decode_buckets[bisect.bisect_left(self.decode_buckets, d)]
        lay = self.layout
        if logit_indices is None:
            ends, total = [], 0
            for e in extend_lens[:k]:
                total += e
                ends.append(total - 1)
            idx = ends + [P + j for j in range(d)]
            # padded to the bucket's most rows (repeats of row 0, dropped by the caller): the
            # eager LM head sees one shape per decode bucket (under cProfile on the H200 a call
            # costs 60 us of host time so, 215 us with a new row count each step)
            idx += [0] * (lay.E + D - len(idx))
        else:
            idx = [lay.logit_index(i, n_p, P) for i in logit_indices]
        meta = lay.meta(rows, prefix_lens, extend_lens, k)
        host = int64_tensor(meta + idx).to(packed.device, non_blocking=True)
        self.meta.copy_(host[: lay.size])
        st = self.static
        st[:, : P + D].zero_()
        st[:, :n_p].copy_(packed[:, :n_p])
        st[:, P : P + d].copy_(packed[:, n_p:])
        if self.captured:
            self.graphs[P, D].replay()
            hidden = self.outputs[P, D]
        else:
            hidden = self._forward(P, D)
        return hidden, host[lay.size :]
