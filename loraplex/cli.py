"""The ``loraplex`` command: wires configuration to the engine, registry and gateway."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from loraplex.cli_engine import add_engine_args, engine_config_from_args, model_arg
from loraplex.cli_registry import add_registry_commands
from loraplex.cli_serve import add_serve_command
from loraplex.errors import LoraplexError


def _cmd_generate(args: argparse.Namespace) -> int:
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.outputs import CompletionOutput, RequestOutput
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.llm import LoRARequest

    engine = LLMEngine(engine_config_from_args(args, model_arg(args.model)))
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
