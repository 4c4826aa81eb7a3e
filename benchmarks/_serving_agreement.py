"""The greedy agreement of two servers' outputs on the same stream, and, where they differ,
the oracle (HF transformers + PEFT on the same weights, greedy) that says which is right.

The servers stream text, not token ids: outputs are compared as text, and their first
tokens by encoding each text again with the model's tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from _log import log
from _serving_bench import Bench


def compare_outputs(bench: Bench, model_dir: str, adapter_paths: Sequence[Path],
                    names: Sequence[str], encode: Callable[[str], list[int]]
                    ) -> list[dict[str, Any]]:
    """Per rate, the greedy agreement of two systems' outputs on the same stream."""
    rows = []
    for rate in bench.args.rates:
        texts = [[r["text"] if r["error"] is None and r["end"] is not None else None
                  for r in _row(bench.results, name, rate)["records"]] for name in names]
        ref, other = texts
        row = dict(rate=rate, **agreement(ref, other, encode))
        row["oracle"] = judge(bench, model_dir, adapter_paths, rate, row["differ"], texts)
        rows.append(row)
    return rows


def judge(bench: Bench, model_dir: str, adapter_paths: Sequence[Path], rate: float,
          differ: Sequence[int], texts: Sequence[Sequence[str | None]]) -> list[dict[str, Any]]:
    """Each request the two systems disagree on (up to --oracle-requests per rate), run by
    the oracle (HF transformers + PEFT, greedy): which system's output is the oracle's."""
    calls = bench.streams[rate]
    cases = differ[:bench.args.oracle_requests]
    if not cases:
        return []
    log(f"   {rate:g} req/s: {len(differ)} outputs differ; HF transformers + PEFT on "
        f"{len(cases)} of them")

    def adapter(model: str) -> Path | None:
        name = model.rsplit("/", 1)[-1]
        return None if model == bench.base_model else adapter_paths[int(name[len("lora"):])]

    oracle = hf_greedy(model_dir, bench.args.dtype,
                       [(calls[i].prompt, adapter(calls[i].model), calls[i].max_tokens)
                        for i in cases])
    out = []
    for i, want in zip(cases, oracle, strict=True):
        lp, v = texts[0][i], texts[1][i]
        out.append({"index": i, "model": calls[i].model,
                    "loraplex_is_oracle": lp is not None and same_text(lp, want),
                    "vllm_is_oracle": v is not None and same_text(v, want)})
        log(f"     request {i} ({calls[i].model}): loraplex "
            f"{'=' if out[-1]['loraplex_is_oracle'] else '!='} oracle, vLLM "
            f"{'=' if out[-1]['vllm_is_oracle'] else '!='} oracle")
    return out


def _row(results: Sequence[dict[str, Any]], config: str, rate: float) -> dict[str, Any]:
    return next(r for r in results if r["config"] == config and r["rate"] == rate)


def same_text(a: str, b: str) -> bool:
    """Equal completions. A completion that ends inside a multi-byte character ends in
    U+FFFD in loraplex's text and without it in vLLM's (its detokenizer holds incomplete
    bytes back, even at the end), so trailing U+FFFD are not compared."""
    return a.rstrip("\ufffd") == b.rstrip("\ufffd")


def agreement(ref: Sequence[str | None], other: Sequence[str | None], encode: Any,
              prefix: int = 16) -> dict[str, Any]:
    """Share of requests (both completed) whose greedy outputs agree: the whole text, and the
    first ``prefix`` tokens. The servers stream text, not token ids; the ids are recovered
    by encoding each completion's text with the model's tokenizer (without special tokens),
    so two texts agree on their first ``prefix`` tokens when their encodings do. Also the
    indices of the requests that disagree (whole outputs)."""
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(ref, other, strict=True))
             if a is not None and b is not None]
    differ = [i for i, a, b in pairs if not same_text(a, b)]
    first = sum(1 for _, a, b in pairs
                if encode(a.rstrip("\ufffd"))[:prefix] == encode(b.rstrip("\ufffd"))[:prefix])
    n = max(1, len(pairs))
    return {"compared": len(pairs), "first_tokens": prefix, "first_agree": first / n,
            "whole_agree": (len(pairs) - len(differ)) / n, "differ": differ}


def hf_greedy(model_dir: str, dtype: str, cases: Sequence[tuple[list[int], Path | None, int]]
              ) -> list[str]:
    """The oracle for requests the servers disagree on: HF transformers (+ PEFT for an
    adapter) on the same weights, greedy, EOS not stopping the output (it is picked like
    any other token, as with ``ignore_eos``); each case is (prompt ids, adapter folder or
    None, output tokens). Returns the decoded texts."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = []
    for prompt, adapter, max_tokens in cases:
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir,
                                                          dtype=getattr(torch, dtype))
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter))
        model.eval()
        ids = torch.tensor([prompt])  # [1, prompt_len]
        out: list[int] = []
        past = None
        # The cache API's deprecation warnings, once per step otherwise.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for _ in range(max_tokens):
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.tensor([[nxt]])  # [1, 1]
        # One sequence of ids decodes to one string (a batch of them, to a list).
        texts.append(cast(str, tok.decode(out, skip_special_tokens=True)))
    return texts
