"""vLLM's offline ``LLM.generate`` on a workload written by ``benchmarks/offline_throughput.py``.

Runs inside vLLM's own virtualenv (``setup.sh``), never the project's: it imports nothing of
loraplex. Reads a JSON job (model folder, adapter folders, the requests as prompt token
ids, output lengths and adapter indices, engine limits), loads the model, reads every
adapter once with a one-token request (adapter reads happen before the clock, as for the
other systems), then times one ``generate`` of the whole workload, greedy with EOS
ignored. Writes the seconds and each request's output token ids as JSON.

    python offline.py JOB.json RESULT.json
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = job["adapters"]
    llm = LLM(model=job["model"], dtype=job["dtype"], enable_lora=bool(adapters),
              max_loras=job["max_loras"], max_lora_rank=job["max_lora_rank"],
              max_cpu_loras=max(len(adapters), job["max_loras"]),
              max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"],
              max_model_len=job["max_model_len"], enable_prefix_caching=True, seed=0)
    loras = [LoRARequest(f"lora-{i}", i + 1, path) for i, path in enumerate(adapters)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for lora in loras:  # every adapter read from disk before the clock
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], one, lora_request=lora,
                     use_tqdm=False)
    requests = job["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in requests]
    chosen = [None if r["adapter"] is None else loras[r["adapter"]] for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=chosen, use_tqdm=False)
    seconds = time.perf_counter() - start
    json.dump({"seconds": seconds, "vllm": __import__("vllm").__version__,
               "outputs": [list(o.outputs[0].token_ids) for o in outs]},
              open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
