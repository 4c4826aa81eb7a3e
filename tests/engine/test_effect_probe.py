"""What the adapter effect probe asks of the engine: the first token's whole next-token
distribution (an internal sampling field), and requests of the ``batch`` class that never
hold another tenant's request back by more than one engine step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import Share
from loraplex.errors import InvalidRequestError
from loraplex.gateway.adapter_effect import PROBE_SHARE
from loraplex.llm import LoRARequest
from loraplex.testing import load_reference, reference_greedy

PROBE = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                       first_token_distribution=True)
PROMPT = [1, 17, 42, 99, 7]
MAX_NUM_SEQS = 4


@pytest.fixture
def engine(tiny_llama_dir: Path) -> Iterator[LLMEngine]:
    eng = LLMEngine(EngineConfig(
        ModelConfig(str(tiny_llama_dir)), CacheConfig(block_size=4, num_kv_blocks=128),
        LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2),
        SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64)),
        progress=False)
    yield eng
    eng.close()


def _run(engine: LLMEngine) -> dict[str, list[SequenceDelta]]:
    deltas: dict[str, list[SequenceDelta]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def test_the_first_tokens_distribution_is_the_models_whole_log_softmax(
        engine: LLMEngine, tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    """With and without an adapter: the first delta carries every token's logprob (those of
    HF + PEFT), no later delta does, and the tokens are those of plain greedy decoding."""
    ref = LoRARequest("r4", str(llama_adapters["r4"])).to_ref()
    engine.add_request("base", PROMPT, PROBE, share=PROBE_SHARE)
    engine.add_request("lora", PROMPT, PROBE, ref, share=PROBE_SHARE)
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True), ref)
    deltas = _run(engine)
    assert all(d.distribution is None for d in deltas["plain"])
    for request_id, adapter in (("base", None), ("lora", llama_adapters["r4"])):
        first, *rest = deltas[request_id]
        assert first.new_token_ids and first.distribution is not None
        assert all(d.distribution is None for d in rest)
        got = torch.tensor(first.distribution)  # [vocab]
        assert got.shape == (engine.vocab_size,)
        assert abs(float(got.exp().sum()) - 1.0) < 1e-4
        expected_ids, logits = reference_greedy(load_reference(tiny_llama_dir, adapter),
                                                PROMPT, 8)
        torch.testing.assert_close(got, torch.log_softmax(logits.float(), -1),
                                   atol=1e-4, rtol=0)
        assert [t for d in deltas[request_id] for t in d.new_token_ids] == expected_ids
    assert [t for d in deltas["plain"] for t in d.new_token_ids] == \
        [t for d in deltas["lora"] for t in d.new_token_ids]


def test_the_field_is_a_boolean() -> None:
    with pytest.raises(InvalidRequestError, match="first_token_distribution"):
        SamplingParams(first_token_distribution=1)  # type: ignore[arg-type]


def test_probe_requests_never_delay_another_tenants_request_beyond_one_step(
        engine: LLMEngine, llama_adapters: dict[str, Path]) -> None:
    """A tenant's stream is decoding when a probe (8 requests, batch class) arrives and
    fills the batch: the stream still gets a token at every step, and the tenant's new
    requests, sent while the probe runs, get their first token in the first step after
    they arrive (``ttft_steps`` 1), as without the probe."""
    ref = LoRARequest("r4", str(llama_adapters["r4"])).to_ref()
    tenant = Share(tenant="quiet")
    engine.add_request("stream", PROMPT, SamplingParams(temperature=0.0, max_tokens=64,
                                                        ignore_eos=True), share=tenant)
    engine.step()  # its prefill, and its first token
    for i in range(4):
        for side, adapter in (("base", None), ("lora", ref)):
            engine.add_request(f"probe-{side}-{i}", [3 + i, *PROMPT], PROBE, adapter,
                               share=PROBE_SHARE)
    stream_tokens = 1
    finished: dict[str, SequenceDelta] = {}
    num_sent = 0
    probe_ids = {f"probe-{s}-{i}" for i in range(4) for s in ("base", "lora")}
    while engine.has_unfinished():
        if not probe_ids <= set(finished) and num_sent < 6:
            # Another short request of the tenant's at every step while the probe runs.
            engine.add_request(f"quiet-{num_sent}", [9, num_sent, *PROMPT],
                               SamplingParams(temperature=0.0, max_tokens=2,
                                              ignore_eos=True), share=tenant)
            num_sent += 1
        deltas = engine.step()
        stream = [d for d in deltas if d.request_id == "stream"]
        if "stream" not in finished:
            # The running stream is never held back: one token in every step.
            assert len(stream) == 1 and len(stream[0].new_token_ids) == 1
            stream_tokens += 1
        for d in deltas:
            if d.finished:
                finished[d.request_id] = d
    assert stream_tokens == 64 and num_sent == 6
    assert probe_ids <= set(finished)
    assert all(finished[r].finish_reason == "length" for r in probe_ids)
    for i in range(num_sent):
        metrics = finished[f"quiet-{i}"].metrics
        assert metrics is not None and metrics.ttft_steps == 1, (i, metrics)
    # The probe waited behind the tenant's work, not the other way round.
    probe_ttft = [m.ttft_steps for r in probe_ids if (m := finished[r].metrics) is not None]
    assert max(t or 0 for t in probe_ttft) > 1
