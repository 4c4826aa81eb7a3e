"""Turns logits into tokens, in vLLM's order:

1. logprobs of the raw logits (what the model says, as vLLM's default ``raw_logprobs``);
2. min_tokens (EOS and stop token ids at -inf) and ``logit_bias`` (added);
3. penalties: repetition (vLLM's, over prompt and output tokens: a positive logit is
   divided by it, a negative one multiplied), then frequency and presence (OpenAI's, over
   output tokens: ``logit -= frequency * count + presence * (count > 0)``);
4. structured output: tokens the row's grammar refuses at -inf (the mask was computed
   while the forward pass ran);
5. greedy rows take the argmax of those logits; the others apply temperature, top-k,
   top-p, min-p and draw, seeded per request.

Steps 2 and 3 are batched over the rows that use them; each row's counts come from its own
sequence's token ids, so a preempted (recomputed or swapped) sequence and each of ``n``
samples get exactly the penalties of their own history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from loraplex_kernels.ops import argmax_rows


@dataclass(frozen=True, kw_only=True)
class SamplingRow:
    """How to sample one row of logits. ``generator`` carries the request's own RNG state,
    so a seeded request draws the same tokens whatever else is in the batch."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    num_logprobs: int | None = None  # None: no logprobs; 0: only the sampled token's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token ids, values) of logit_bias, made once per request (``bias_tensors``)
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    banned_ids: torch.Tensor | None = None  # never sampled this step (min_tokens' stops)
    # The sequence's tokens so far, read for the penalties (not copied).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Structured output: the row's allowed next tokens as a packed bitmask (int32 words,
    # bit t % 32 of word t // 32), computed while the forward pass runs; called once.
    allowed: Callable[[], torch.Tensor] | None = None
    # The whole log-softmax of the raw logits is wanted (``SampledToken.distribution``).
    full_distribution: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy on the model's own logits: nothing applied to them, no logprobs."""
        return (self.is_greedy and self.num_logprobs is None and not self.has_penalties
                and self.logit_bias is None and self.banned_ids is None
                and self.allowed is None and not self.full_distribution)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # the model's log-probability of token_id (raw logits)
    top_logprobs: tuple[tuple[int, float], ...] | None  # best alternatives, most likely first
    # Every token's log-probability (raw logits), by id, for a row with full_distribution.
    distribution: tuple[float, ...] | None = None


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           default_generator: torch.Generator | None = None) -> list[SampledToken]:
    """Samples one token per row of ``logits`` ``[num_rows, vocab]``: float32, or the
    model's dtype, widened to float32 unless every row is plainly greedy (the argmax of
    bfloat16 logits is that of their exact float32 values)."""
    num_rows = logits.shape[0]
    if logits.dtype is not torch.float32 and not all(r.is_plain_greedy for r in rows):
        logits = logits.float()
    raw = logits
    logits = apply_allowed(apply_penalties(apply_bias(logits, rows), rows), raw, rows)
    token_ids = argmax_rows(logits)  # [num_rows]; replaced below for random rows
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
    need_logprobs = [i for i, r in enumerate(rows)
                     if r.num_logprobs is not None or r.full_distribution]
    logprobs = torch.log_softmax(raw.index_select(
        0, torch.tensor(need_logprobs, device=raw.device)), dim=-1) if need_logprobs else None
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
        full = tuple(row.tolist()) if rows[i].full_distribution else None
        out.append(SampledToken(ids[i], float(row[ids[i]]), top, full))
    return out


def verify(logits: torch.Tensor, draft_ids: Sequence[int], row: SamplingRow,
           default_generator: torch.Generator | None = None) -> list[int]:
    """The tokens a sequence keeps of its proposals ``draft_ids`` (k of them), from the
    target's ``logits`` ``[k + 1, vocab]`` at the k positions before them and the one after:
    the accepted proposals, then one token of the target's own.

    Greedy: the longest prefix equal to the target's argmax, then its argmax. Random: the
    rejection-sampling rule for a draft that puts all its mass on its proposal (prompt
    lookup): proposal i is kept with probability p_i(d_i); the first one refused is replaced
    by a draw from the residual max(p_i - q_i, 0), i.e. p_i without d_i, renormalised; when
    all are kept, the last position draws from p_k. Every kept token is thereby distributed
    exactly as the target's own draw (Leviathan et al., 2023). The row's penalties, bias,
    grammar mask and logprobs are not applied: requests using them do not speculate.
    """
    num_draft = len(draft_ids)
    if row.is_greedy:
        best = argmax_rows(logits).tolist()
        num_accepted = 0
        while num_accepted < num_draft and best[num_accepted] == draft_ids[num_accepted]:
            num_accepted += 1
        return best[:num_accepted + 1]
    probs = _filtered_probs(logits, [row] * (num_draft + 1))  # [k + 1, vocab]
    gen = row.generator or default_generator
    draft = torch.tensor(list(draft_ids), device=probs.device)
    target_p = probs[:-1].gather(1, draft[:, None])[:, 0]  # [k]
    uniform = torch.rand(num_draft, generator=gen, device=probs.device)
    accepted = (uniform < target_p).tolist()
    kept: list[int] = []
    for i, ok in enumerate(accepted):
        if not ok:
            residual = probs[i].clone()
            residual[draft_ids[i]] = 0.0
            return kept + [_draw(residual, gen)]
        kept.append(draft_ids[i])
    return kept + [_draw(probs[-1], gen)]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` ``[vocab]`` (unnormalised is fine), by the exponential race
    ``sample`` uses."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def apply_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` with min_tokens' banned ids at -inf and ``logit_bias`` added; the same
    tensor when no row uses either. The rows carry tensors made once per request
    (``bias_tensors``, ``id_tensor``), so a step costs one indexed op per row, in
    proportion to the ids it touches, not a Python object per id, row and step (a
    logit_bias on all 49,152 tokens in 16 rows had cost 1.6 s a step)."""
    biased = [(i, r.logit_bias) for i, r in enumerate(rows) if r.logit_bias is not None]
    banned = [(i, r.banned_ids) for i, r in enumerate(rows) if r.banned_ids is not None]
    if not banned and not biased:
        return logits
    logits = logits.clone()
    dev = logits.device
    for i, (ids, values) in biased:
        logits[i].index_add_(0, ids.to(dev), values.to(device=dev, dtype=logits.dtype))
    for i, token_ids in banned:
        logits[i, token_ids.to(dev)] = float("-inf")
    return logits


def bias_tensors(pairs: Sequence[tuple[int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit_bias as the sampler reads it: its token ids and their values."""
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64)  # [num_biased]
    values = torch.tensor([v for _, v in pairs], dtype=torch.float32)  # [num_biased]
    return ids, values


def id_tensor(token_ids: Sequence[int]) -> torch.Tensor:
    """Token ids (min_tokens' banned ones) as the sampler reads them, each once."""
    return torch.tensor(sorted(set(token_ids)), dtype=torch.int64)  # [num_distinct_ids]


_BITS: Final = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 bitmasks ``[rows, words]`` as booleans ``[rows, vocab]``."""
    bits = (masks.unsqueeze(-1) >> _BITS) & 1
    return bits.view(masks.shape[0], -1)[:, :vocab].bool()


def apply_allowed(logits: torch.Tensor, raw: torch.Tensor,
                  rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` with every token a row's grammar refuses at -inf; the same tensor when no
    row has a grammar. The grammar wins over ``min_tokens`` and ``logit_bias``: a row they
    would leave with no token at all keeps its raw logits, masked by the grammar alone."""
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not constrained:
        return logits
    masks = torch.stack([rows[i].allowed() for i in constrained])  # type: ignore[misc]
    allowed = unpack_bitmask(masks, logits.shape[1]).to(logits.device)
    # A grammar that allows no token at all is one that cannot be followed: the engine
    # ends that request with an error whatever is drawn, so its row samples unmasked
    # rather than from no token.
    allowed[~allowed.any(dim=-1)] = True
    index = torch.tensor(constrained, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    dead = ~torch.isfinite(masked).any(dim=-1)
    if bool(dead.any()):
        masked[dead] = raw.index_select(0, index)[dead].masked_fill(~allowed[dead],
                                                                    float("-inf"))
    out = logits.clone() if logits is raw else logits
    out[index] = masked
    return out


_REPETITION_RANGE = (1e-30, 1e30)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` with repetition, frequency and presence penalties applied; the same
    tensor when no row has one.

    Only the (row, token) cells a row's history holds change, so the work is one gather and
    one scatter over those cells, whatever the vocabulary size."""
    penalised = [i for i, r in enumerate(rows) if r.has_penalties]
    if not penalised:
        return logits
    dev = logits.device
    vocab = logits.shape[1]

    def cells(attr: str) -> tuple[torch.Tensor, torch.Tensor]:
        # Flat indices row * vocab + token of every token of that kind, and their rows.
        ids = [getattr(rows[i], attr) for i in penalised]
        row_of = torch.repeat_interleave(torch.tensor(penalised),
                                         torch.tensor([len(x) for x in ids]))
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.int64)
        return row_of * vocab + flat, row_of

    out_cells, _ = cells("output_token_ids")
    prompt_cells, _ = cells("prompt_token_ids")
    # Each distinct cell once; output_counts[j]: how often cell j's token was generated.
    seen, inverse = torch.unique(torch.cat([out_cells, prompt_cells]), return_inverse=True)
    output_counts = torch.zeros(len(seen)).index_add_(
        0, inverse[:len(out_cells)], torch.ones(len(out_cells)))  # [num_seen]
    row_of_seen = seen // vocab

    def per_cell(name: str) -> torch.Tensor:
        values = torch.zeros(len(rows))
        values[penalised] = torch.tensor([getattr(rows[i], name) for i in penalised],
                                         dtype=torch.float32)
        return values[row_of_seen]  # [num_seen]

    seen, output_counts = seen.to(dev), output_counts.to(dev)
    flat = logits.reshape(-1)
    values = flat[seen]  # [num_seen]
    # Any penalty > 0 is valid, but in float32 one under ~1e-38 is 0 (a division by zero,
    # its cells +inf) and one past ~3e38 is inf (a zero logit times it NaN): each is taken
    # at the nearest end of [1e-30, 1e30], where a logit of the model's and logit_bias's
    # sizes (under ~1e3) stays finite through any temperature sampled from (1e-5 up) and
    # every cell keeps its place in the row's order.
    repetition = per_cell("repetition_penalty").clamp(*_REPETITION_RANGE).to(dev)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = (values - per_cell("frequency_penalty").to(dev) * output_counts
              - per_cell("presence_penalty").to(dev) * (output_counts > 0).float())
    out = flat.clone()
    out[seen] = values.to(logits.dtype)
    return out.view_as(logits)


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
        drop_sorted[:, 0] = False  # a top_p under float32's least (1e-300) is 0 there
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_ps = torch.tensor([r.min_p for r in rows], device=logits.device)
    if bool((min_ps > 0.0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
