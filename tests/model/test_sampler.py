"""The sampler against direct computations on known distributions."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.model.sampler import (
    SamplingRow,
    _filtered_probs,
    apply_bias,
    apply_penalties,
    bias_tensors,
    id_tensor,
    sample,
    verify,
)
from loraplex.testing import chi_square_fits, reference_processed_logits


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def _counts(row: SamplingRow, draws: int = 4000) -> list[int]:
    counts = [0] * LOGITS.shape[1]
    gen = row.generator
    for _ in range(draws):
        counts[sample(LOGITS, [row], gen)[0].token_id] += 1
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    """argmax's own choice on ties (the first), NaN (taken) and rows all -inf, at a real
    vocabulary's width."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-2, 3, (12, 49152), generator=gen).float()  # many ties
    logits[3, torch.rand(49152, generator=gen) < 0.001] = float("nan")
    logits[5, :] = float("-inf")
    logits[7, torch.rand(49152, generator=gen) < 0.5] = float("-inf")
    logits[9] = torch.randn(49152, generator=gen)
    logits = logits.to(dtype)
    out = sample(logits, [SamplingRow()] * 12)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_bfloat16_logits_sample_as_their_float32_values() -> None:
    """The runner hands over the model's bfloat16 logits; they are widened only where a row
    needs more than their argmax. Either way every row gets what their exact float32
    values give: plain greedy, greedy with logprobs, penalised, seeded random."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 300, generator=gen) * 4).bfloat16()
    def rows() -> list[SamplingRow]:
        return [SamplingRow(), SamplingRow(num_logprobs=2),
                SamplingRow(repetition_penalty=1.5, output_token_ids=[3, 7]),
                SamplingRow(temperature=0.8, generator=_gen(11)), SamplingRow()]
    assert torch.equal(logits.max(-1).indices, logits.float().max(-1).indices)
    assert sample(logits, rows()) == sample(logits.float(), rows())
    plain = sample(logits, [SamplingRow()] * 5)
    assert [t.token_id for t in plain] == logits.float().argmax(-1).tolist()


def test_temperature_sampling_follows_the_distribution() -> None:
    counts = _counts(SamplingRow(temperature=1.0, generator=_gen(0)))
    expected = [0.5, 0.25, 0.15, 0.07, 0.03]
    for c, p in zip(counts, expected, strict=True):
        # 5 standard deviations of a binomial: fails only on a real bias
        assert abs(c / 4000 - p) < 5 * math.sqrt(p * (1 - p) / 4000)


def test_top_k_top_p_min_p_cut_the_tail() -> None:
    assert _counts(SamplingRow(temperature=1.0, top_k=2, generator=_gen(1)))[2:] == [0, 0, 0]
    # top_p 0.7: 0.5 + 0.25 reaches it, so only the two most likely tokens survive
    assert _counts(SamplingRow(temperature=1.0, top_p=0.7, generator=_gen(2)))[2:] == [0, 0, 0]
    # min_p 0.2: threshold 0.1, so 0.07 and 0.03 are dropped
    counts = _counts(SamplingRow(temperature=1.0, min_p=0.2, generator=_gen(3)))
    assert counts[3:] == [0, 0] and counts[2] > 0


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 100)
    alone = [sample(logits, [SamplingRow(temperature=1.0, generator=_gen(9))])[0].token_id]
    row = SamplingRow(temperature=1.0, generator=_gen(9))
    others = [SamplingRow(temperature=0.7, generator=_gen(i)) for i in range(5)]
    batch = torch.cat([torch.randn(2, 100), logits, torch.randn(3, 100)])
    mixed = sample(batch, others[:2] + [row] + others[2:])
    assert mixed[2].token_id == alone[0]


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_the_models_log_softmax(k: int) -> None:
    logits = torch.randn(2, 30)
    out = sample(logits, [SamplingRow(num_logprobs=k), SamplingRow()])
    ref = torch.log_softmax(logits[0].double(), -1)
    assert out[0].logprob == pytest.approx(float(ref[out[0].token_id]), abs=1e-5)
    assert out[1].logprob is None
    top = out[0].top_logprobs
    assert top is not None and len(top) == k
    expected = torch.topk(ref, k) if k else None
    if expected is not None:
        assert [t for t, _ in top] == expected.indices.tolist()


# --- logit processing: min_tokens bans, logit_bias, penalties -------------------------


def _row(**spec: Any) -> SamplingRow:
    """A row from the engine's plain values: ``logit_bias`` pairs and ``banned_ids`` become
    the tensors the engine makes once per request."""
    if "logit_bias" in spec:
        spec["logit_bias"] = bias_tensors(spec["logit_bias"]) if spec["logit_bias"] else None
    if "banned_ids" in spec:
        spec["banned_ids"] = id_tensor(spec["banned_ids"]) if spec["banned_ids"] else None
    return SamplingRow(**spec)


def _processing_rows(vocab: int) -> list[tuple[SamplingRow, dict[str, Any]]]:
    """A mixed batch: untouched rows next to every kind of processing, alone and combined,
    each row with its own history."""
    rng = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    specs: list[dict[str, Any]] = [
        {},
        {"presence_penalty": 1.5},
        {"frequency_penalty": -0.7},
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.6, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logit_bias": ((3, 100.0), (7, -100.0), (vocab - 1, 0.25))},
        {"banned_ids": (0, 1), "logit_bias": ((0, 5.0),), "repetition_penalty": 1.1},
        {"frequency_penalty": 0.5},  # no output yet: nothing to penalise
    ]
    return [(_row(prompt_token_ids=ids(3 + 5 * i),
                  output_token_ids=[] if i == len(specs) - 1 else ids(2 + 3 * i), **spec), spec)
            for i, spec in enumerate(specs)]


def test_processed_logits_match_the_definitions_over_a_mixed_batch() -> None:
    vocab = 40
    pairs = _processing_rows(vocab)
    rows = [r for r, _ in pairs]
    logits = torch.randn(len(rows), vocab) * 3
    got = apply_penalties(apply_bias(logits, rows), rows)
    for i, (r, spec) in enumerate(pairs):
        expected = reference_processed_logits(
            logits[i], r.prompt_token_ids, r.output_token_ids, presence=r.presence_penalty,
            frequency=r.frequency_penalty, repetition=r.repetition_penalty,
            logit_bias=spec.get("logit_bias", ()), banned_ids=spec.get("banned_ids", ()))
        assert torch.allclose(got[i].double(), expected, atol=1e-5), f"row {i}: {r}"
    assert torch.equal(got[0], logits[0])


def test_greedy_takes_the_argmax_of_processed_logits_and_logprobs_stay_raw() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 4] = 5.0
    rows = [_row(logit_bias=((8, 10.0),), num_logprobs=0), SamplingRow(num_logprobs=0)]
    out = sample(logits, rows)
    assert [t.token_id for t in out] == [8, 4]
    raw = torch.log_softmax(logits[0], -1)
    assert out[0].logprob == pytest.approx(float(raw[8]), abs=1e-6)


def test_banned_ids_are_never_drawn() -> None:
    row = _row(temperature=1.0, banned_ids=(0, 1), generator=_gen(4))
    assert _counts(row, draws=500)[:2] == [0, 0]


def test_a_row_without_processing_leaves_the_logits_untouched() -> None:
    logits = torch.randn(3, 20)
    rows = [SamplingRow(prompt_token_ids=[1, 2], output_token_ids=[3])] * 3
    assert apply_penalties(apply_bias(logits, rows), rows) is logits


@pytest.mark.parametrize("row", [SamplingRow(temperature=1.0),
                                 SamplingRow(temperature=0.7, top_k=4, top_p=0.9)])
def test_verify_keeps_the_target_distribution_at_every_position(row: SamplingRow) -> None:
    """Rejection sampling of point-mass proposals: the first kept token is distributed as
    the target's first position, the second (given the first proposal was kept) as its
    second, and so on — whether the proposals are likely (2) or unlikely (5)."""
    logits = torch.log(torch.tensor([[0.05, 0.1, 0.5, 0.2, 0.1, 0.05],
                                     [0.1, 0.4, 0.1, 0.1, 0.1, 0.2],
                                     [0.3, 0.2, 0.2, 0.1, 0.1, 0.1]]))  # [k + 1, vocab]
    draft = [2, 5]
    probs = _filtered_probs(logits, [row] * 3)
    gen = _gen(7)
    outs = [verify(logits, draft, row, gen) for _ in range(8000)]
    counts = [[0] * 6 for _ in range(3)]
    for out in outs:
        for position, token in enumerate(out):
            counts[position][token] += 1
    for position in range(3):
        fits, stat, critical = chi_square_fits(counts[position], probs[position].tolist())
        assert fits, (position, stat, critical, counts[position])
    assert sum(counts[1]) > 2000 and sum(counts[2]) > 400  # proposals were kept often


def test_verify_greedy_keeps_the_matching_prefix_and_the_next_argmax() -> None:
    logits = torch.full((4, 5), -1.0)
    for position, best in enumerate([3, 1, 4, 0]):
        logits[position, best] = 1.0
    assert verify(logits, [3, 1, 2], SamplingRow()) == [3, 1, 4]
    assert verify(logits, [0, 1, 4], SamplingRow()) == [3]
    assert verify(logits, [3, 1, 4], SamplingRow()) == [3, 1, 4, 0]


@settings(max_examples=200, deadline=None)
@given(repetition=st.floats(min_value=0.0, max_value=1e308, exclude_min=True),
       temperature=st.sampled_from([1e-5, 0.3, 1.0, 2.0]),
       seed=st.integers(0, 2**16), bias=st.booleans())
def test_any_valid_repetition_penalty_keeps_logits_finite_and_the_oracles_argmax(
        repetition: float, temperature: float, seed: int, bias: bool) -> None:
    """Every penalty the API takes (> 0, finite: 5e-324 to 1e308), with and without
    logit_bias at its limit: processed logits stay finite, the greedy token is the float64
    oracle's, and a random row's probabilities are a distribution (float32 turns a penalty
    under ~1e-38 into 0 and one past ~3e38 into inf)."""
    g = _gen(seed)
    vocab = 64
    logits = torch.randn(2, vocab, generator=g) * 4
    history = torch.randperm(vocab, generator=g)[:12].tolist()
    spec: dict[str, Any] = {"repetition_penalty": repetition,
                            "prompt_token_ids": history[:8], "output_token_ids": history[8:]}
    if bias:
        spec["logit_bias"] = ((history[0], 100.0), (history[9], -100.0))
    rows = [_row(**spec), _row(temperature=temperature, generator=_gen(seed), **spec)]
    got = apply_penalties(apply_bias(logits, rows), rows)
    assert bool(torch.isfinite(got).all())
    # The float64 oracle itself overflows past [1e-300, 1e300] (a logit over 5e-324 is inf
    # there); beyond it a penalty's effect on the row's order no longer changes.
    expected = reference_processed_logits(logits[0], history[:8], history[8:],
                                          repetition=min(max(repetition, 1e-300), 1e300),
                                          logit_bias=spec.get("logit_bias", ()))
    assert int(got[0].argmax()) == int(expected.argmax())
    assert sample(logits, rows)[0].token_id == int(expected.argmax())
    probs = _filtered_probs(got[1:], rows[1:])
    assert bool(torch.isfinite(probs).all()) and float(probs.sum()) == pytest.approx(1.0)
