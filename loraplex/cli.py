"""The ``loraplex`` command: wires configuration to the engine, registry and gateway."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from loraplex.cli_registry import add_registry_commands
from loraplex.cli_serve import add_serve_command
from loraplex.errors import LoraplexError


def _model_arg(value: str | None) -> str:
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


def engine_config_from_args(args: argparse.Namespace, model: str) -> object:
    from loraplex.config import (
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
    )

    return EngineConfig(
        model=ModelConfig(model, args.dtype, args.device, args.seed, args.max_model_len),
        cache=CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory,
                          not args.no_prefix_caching, args.swap_space_blocks),
        lora=LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                  not args.no_chunked_prefill, args.preemption_mode),
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.outputs import CompletionOutput, RequestOutput
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.llm import LoRARequest

    model = _model_arg(args.model)
    engine = LLMEngine(engine_config_from_args(args, model))  # type: ignore[arg-type]
    try:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False,
                add_generation_prompt=True)
        token_ids = engine.tokenizer.encode(prompt, add_special_tokens=not args.chat)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed_sampling,
                                max_tokens=args.max_tokens)
        ref = LoRARequest(os.path.basename(os.path.normpath(args.adapter)),
                          args.adapter).to_ref() if args.adapter else None
        if ref is not None:
            engine.adapters.load_now(ref)  # refuse a bad adapter before generating
        engine.add_request("cli", token_ids, params, ref)
        result = RequestOutput("cli", prompt, list(token_ids), [CompletionOutput(0)])
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.error:
                    raise LoraplexError(delta.error)
                result.apply(delta)
                sys.stdout.write(delta.text_delta)
                sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        engine.close()
    return 0


def _cmd_demo_prepare(args: argparse.Namespace) -> int:
    from loraplex.model.demo import prepare_demo_model

    print(prepare_demo_model(args.dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=(
        "Multi-tenant LoRA serving: one resident base model, many tenants' adapters."))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline")
    gen.add_argument("--model", default=None,
                     help="HF model folder (default: LORAPLEX_MODEL, else the demo model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--adapter", default=None, help="PEFT adapter folder")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request seed")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("demo", help="the demo model (SmolLM2-135M-Instruct)")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    prep = demo_sub.add_parser("prepare", help="download and convert the demo model")
    prep.add_argument("--dir", default=None, help="target folder (default: the cache)")
    prep.set_defaults(func=_cmd_demo_prepare)

    add_registry_commands(sub)
    add_serve_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LoraplexError as exc:
        print(f"loraplex: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
