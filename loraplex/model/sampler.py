"""Turns logits into tokens: greedy, temperature, top-k, top-p, min-p, seeded per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingRow:
    """How to sample one row of logits. ``generator`` carries the request's own RNG state,
    so a seeded request draws the same tokens whatever else is in the batch."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    num_logprobs: int | None = None  # None: no logprobs; 0: only the sampled token's

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # the model's log-probability of token_id (raw logits)
    top_logprobs: tuple[tuple[int, float], ...] | None  # best alternatives, most likely first


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           default_generator: torch.Generator | None = None) -> list[SampledToken]:
    """Samples one token per row of ``logits`` ``[num_rows, vocab]`` (float32)."""
    num_rows = logits.shape[0]
    token_ids = logits.argmax(dim=-1)  # [num_rows]; replaced below for random rows
    random_rows = [i for i, r in enumerate(rows) if not r.is_greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, idx), [rows[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            gen = rows[i].generator or default_generator
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly, with one
            # RNG call per row whose size never depends on the batch.
            noise = torch.empty_like(probs[j]).exponential_(generator=gen)
            token_ids[i] = torch.argmax(probs[j] / noise)
    need_logprobs = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
    logprobs = torch.log_softmax(logits.index_select(
        0, torch.tensor(need_logprobs, device=logits.device)), dim=-1) if need_logprobs else None
    ids = token_ids.tolist()
    out: list[SampledToken] = []
    pos = {i: j for j, i in enumerate(need_logprobs)}
    for i in range(num_rows):
        if i not in pos:
            out.append(SampledToken(ids[i], None, None))
            continue
        assert logprobs is not None
        row = logprobs[pos[i]]
        k = rows[i].num_logprobs or 0
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            vals, top_ids = row.topk(min(k, row.shape[0]))
            top = tuple(zip(top_ids.tolist(), vals.tolist(), strict=True))
        out.append(SampledToken(ids[i], float(row[ids[i]]), top))
    return out


def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p, one row per request."""
    temps = torch.tensor([r.temperature for r in rows], device=logits.device)
    logits = logits / temps[:, None]
    vocab = logits.shape[1]
    top_ks = [r.top_k if 0 < r.top_k < vocab else vocab for r in rows]
    if any(k < vocab for k in top_ks):
        k_t = torch.tensor(top_ks, device=logits.device)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (k_t - 1)[:, None])  # [rows, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_ps = torch.tensor([r.top_p for r in rows], device=logits.device)
    if bool((top_ps < 1.0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= top_ps[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_ps = torch.tensor([r.min_p for r in rows], device=logits.device)
    if bool((min_ps > 0.0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
