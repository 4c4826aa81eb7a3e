"""System (c) of the offline benchmark: loraplex's offline ``LLM.generate`` (continuous
batching, paged KV, per-token LoRA), timed the way the peers are: adapters read from disk
beforehand, their installs into device slots inside the clock."""

from __future__ import annotations

import argparse
import cProfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _workload import WorkItem, num_output_tokens


class LoraplexSystem:
    def __init__(self, model_dir: str, adapter_paths: Sequence[Path], args: argparse.Namespace,
                 max_len: int, dtype: str) -> None:
        from loraplex import LLM, LoRARequest

        block_size = 16
        blocks_per_seq = -(-max_len // block_size)
        self.config: dict[str, Any] = dict(
            dtype=dtype, max_loras=args.max_loras, max_lora_rank=32,
            max_cpu_loras=max(128, len(adapter_paths)),
            num_kv_blocks=args.max_num_seqs * blocks_per_seq + 64,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=True)
        self.llm = LLM(model=model_dir, progress=False, **self.config)
        self.loras = [LoRARequest(f"lora-{i}", str(p)) for i, p in enumerate(adapter_paths)]
        self.num_runs = 0

    def warm_host_cache(self, num_adapters: int) -> None:
        """Reads adapters from disk into the host cache (the HF peers load theirs up front),
        hashing each folder once, as a long-running process would."""
        for lr in self.loras[:num_adapters]:
            self.llm.add_lora(lr)

    def generate(self, items: Sequence[WorkItem], profile: Path | None = None,
                 ) -> tuple[float, list[list[int]], dict[str, Any]]:
        from loraplex import SamplingParams

        self.num_runs += 1
        # A salt per run: the same prompts in another run must not hit the prefix cache.
        salt = f"run-{self.num_runs}"
        warm = [w.prompt_ids[:16] for w in items[:2]]
        self.llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                          [self._lora(w) for w in items[:2]], cache_salt=f"warm-{salt}")
        before = self.llm.stats()
        params = [SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
                  for w in items]
        prompts = [w.prompt_ids for w in items]
        loras = [self._lora(w) for w in items]
        profiler = cProfile.Profile() if profile is not None else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outs = self.llm.generate(prompts, params, loras, cache_salt=salt)
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - start
        if profiler is not None and profile is not None:
            profiler.dump_stats(str(profile))
        after = self.llm.stats()
        keys = ("num_steps", "num_preemptions", "adapter_slot_loads", "adapter_slot_evictions",
                "adapter_disk_loads")
        delta = {k: getattr(after, k) - getattr(before, k) for k in keys}
        delta["adapter_load_seconds"] = round(after.adapter_load_seconds
                                              - before.adapter_load_seconds, 3)
        delta["output_tokens_per_step"] = round(
            num_output_tokens(items) / max(1, delta["num_steps"]), 1)
        return seconds, [o.outputs[0].token_ids for o in outs], delta

    def _lora(self, item: WorkItem) -> Any:
        return None if item.adapter is None else self.loras[item.adapter]
