"""Engine options shared by ``loraplex generate`` and ``loraplex serve``, and the model
folder both default to."""

from __future__ import annotations

import argparse
import os

from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)


def model_arg(value: str | None) -> str:
    """The base model folder: the flag, LORAPLEX_MODEL, or the demo model (prepared)."""
    if value:
        return value
    env = os.environ.get("LORAPLEX_MODEL")
    if env:
        return env
    from loraplex.model.demo import prepare_demo_model

    return str(prepare_demo_model())


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by ``generate`` and ``serve``."""
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    g.add_argument("--max-loras", type=int, default=4)
    g.add_argument("--max-lora-rank", type=int, default=64)
    g.add_argument("--max-cpu-loras", type=int, default=16)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--swap-space-blocks", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """The engine configuration of the options ``add_engine_args`` registered."""
    return EngineConfig(
        model=ModelConfig(model, args.dtype, args.device, args.seed, args.max_model_len),
        cache=CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory,
                          not args.no_prefix_caching, args.swap_space_blocks),
        lora=LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                  not args.no_chunked_prefill, args.preemption_mode),
    )
