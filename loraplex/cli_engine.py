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
    SpeculativeConfig,
)

ENV_KV_DISK_DIR = "LORAPLEX_KV_DISK_DIR"  # --kv-disk-dir (the compose stack sets it)


def model_arg(value: str | None) -> str:
    """The base model folder: the flag, LORAPLEX_MODEL, or the demo model (prepared)."""
    if value:
        return value
    env = os.environ.get("LORAPLEX_MODEL")
    if env:
        return env
    from loraplex.model.demo import prepare_demo_model

    return str(prepare_demo_model())


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default in ``--help``, except where the help already says it or
    there is nothing to show (flags, unset options)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = action.help or ""
        if ("default" in help_ or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return help_
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by ``generate`` and ``serve``."""
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations")
    g.add_argument("--device", default=None,
                   help="cpu or cuda (default: cuda if present, else cpu)")
    g.add_argument("--max-loras", type=int, default=LoRAConfig.max_loras,
                   help="adapters resident on the device at once (slots)")
    g.add_argument("--max-lora-rank", type=int, default=LoRAConfig.max_lora_rank,
                   help="largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=LoRAConfig.max_cpu_loras,
                   help="adapters kept in host memory in front of the slots")
    g.add_argument("--max-pinned-fraction", type=float,
                   default=LoRAConfig.max_pinned_fraction,
                   help="share of the device slots pinned adapters may take (rounded down; "
                        "below 1: the rest serve the working set)")
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size,
                   help="tokens per KV-cache block (a power of two)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks (default: as many as --kv-cache-memory holds)")
    g.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="KV-cache budget in bytes (default: a fraction of free memory)")
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="sequences running in one step at most")
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens,
                   help="tokens computed in one step at most (prefill and decode)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion (default: the model's context length)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of a prompt prefix seen before")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="compute each prompt in one step instead of in budget-sized chunks")
    g.add_argument("--preemption-mode", default=SchedulerConfig.preemption_mode,
                   choices=["recompute", "swap"],
                   help="what a sequence preempted for lack of KV blocks loses: recompute "
                        "its KV later, or swap it to host memory")
    g.add_argument("--swap-space-blocks", type=int, default=CacheConfig.swap_space_blocks,
                   help="host-memory KV blocks for --preemption-mode swap")
    g.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="keep prefix-cache blocks evicted from the pool in this folder and "
                        f"load them back on a later hit (env {ENV_KV_DISK_DIR}; default: "
                        "off)")
    g.add_argument("--kv-disk-gib", type=float, default=CacheConfig.kv_disk_gib, metavar="N",
                   help="disk budget of --kv-disk-dir in GiB, least recently used blocks "
                        "deleted first (default: %(default)s)")
    g.add_argument("--scheduling-policy", default=SchedulerConfig.policy,
                   choices=["fair", "fifo"],
                   help="fair: tenants share a busy engine by weight, interactive before "
                        "batch (default); fifo: oldest first")
    g.add_argument("--max-kv-fraction", type=float, default=None, metavar="F",
                   help="fraction of the KV pool one tenant's running requests may hold "
                        "(a tenant's own setting wins; default: no cap)")
    g.add_argument("--max-batch-wait-s", type=float, default=SchedulerConfig.max_batch_wait_s,
                   help="batch-class requests wait at most this long behind interactive "
                        "ones (default: %(default)s)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\' or '
                        '\'{"method": "draft_model", "model": "/path/to/draft", '
                        '"num_speculative_tokens": 3}\' (default: off)')
    g.add_argument("--seed", type=int, default=0,
                   help="engine seed (sampling of requests that give no seed)")


def kv_disk_dir(args: argparse.Namespace) -> str | None:
    """The KV disk tier's folder: the flag, else LORAPLEX_KV_DISK_DIR; None: no tier."""
    return args.kv_disk_dir or os.environ.get(ENV_KV_DISK_DIR) or None


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """The engine configuration of the options ``add_engine_args`` registered."""
    return EngineConfig(
        model=ModelConfig(model, args.dtype, args.device, args.seed, args.max_model_len),
        cache=CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory,
                          not args.no_prefix_caching, args.swap_space_blocks,
                          kv_disk_dir(args), args.kv_disk_gib),
        lora=LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras,
                        args.max_pinned_fraction),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                  not args.no_chunked_prefill, args.preemption_mode,
                                  policy=args.scheduling_policy,
                                  max_batch_wait_s=args.max_batch_wait_s,
                                  max_kv_fraction=args.max_kv_fraction),
        speculative=(SpeculativeConfig.from_json(args.speculative_config)
                     if args.speculative_config else None),
    )
