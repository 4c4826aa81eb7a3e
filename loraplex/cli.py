"""The ``loraplex`` command: wires configuration to the engine, registry and gateway."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from sqlalchemy.exc import SQLAlchemyError

from loraplex.cli_engine import HelpFormatter, add_engine_args, engine_config_from_args, model_arg
from loraplex.cli_registry import add_registry_commands
from loraplex.cli_serve import add_serve_command
from loraplex.errors import ConfigError, LoraplexError, first_line


def _cmd_generate(args: argparse.Namespace) -> int:
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.outputs import CompletionOutput, RequestOutput
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.llm import LoRARequest

    # Checked first: a bad value is one line at once, not after the model has loaded (or
    # the demo model downloaded).
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed_sampling,
                            max_tokens=args.max_tokens)
    engine = LLMEngine(engine_config_from_args(args, model_arg(args.model)))
    try:
        prompt = args.prompt
        has_template = bool(getattr(engine.tokenizer, "chat_template", None))
        chat = has_template if args.chat is None else args.chat
        if chat and not has_template:
            raise ConfigError("the model has no chat template: leave out --chat")
        if chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False,
                add_generation_prompt=True)
        token_ids = engine.tokenizer.encode(prompt, add_special_tokens=not chat)
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


def _cmd_demo_adapter(args: argparse.Namespace) -> int:
    from loraplex.model.demo_adapter import DemoAdapterOptions, train_demo_adapter

    options = DemoAdapterOptions(steps=args.steps, learning_rate=args.learning_rate,
                                 seed=args.seed)
    print(train_demo_adapter(model_arg(args.model), args.out, options))
    return 0


def _cmd_draft(args: argparse.Namespace) -> int:
    from loraplex.model.truncate import save_first_layers

    print(save_first_layers(model_arg(args.model), args.out, args.layers))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", formatter_class=HelpFormatter,
                                     description=(
        "Multi-tenant LoRA serving: one resident base model, many tenants' adapters."))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline",
                         formatter_class=HelpFormatter,
                         description="Complete one prompt offline and print the completion.")
    gen.add_argument("--model", default=None,
                     help="HF model folder (default: LORAPLEX_MODEL, else the demo model)")
    gen.add_argument("--prompt", required=True, help="the user's message (or raw text, --raw)")
    gen.add_argument("--adapter", default=None, help="PEFT adapter folder (default: none)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    gen.add_argument("--seed-sampling", type=int, default=None,
                     help="per-request sampling seed (default: none)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap the prompt in the model's chat template as a user message "
                          "(default: on when the model has a chat template, as instruct "
                          "models do)")
    gen.add_argument("--raw", dest="chat", action="store_false", default=None,
                     help="the same as --no-chat: complete the prompt text as is")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("demo", help="the demo model (SmolLM2-135M-Instruct)")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    prep = demo_sub.add_parser("prepare", help="download and convert the demo model")
    prep.add_argument("--dir", default=None, help="target folder (default: the cache)")
    prep.set_defaults(func=_cmd_demo_prepare)
    from loraplex.model.demo_adapter import DemoAdapterOptions

    defaults = DemoAdapterOptions()
    adapter = demo_sub.add_parser(
        "adapter", formatter_class=HelpFormatter,
        help="train a small LoRA for the demo model that answers in a ship's-log voice",
        description="Train, in a couple of minutes on a CPU, a LoRA adapter for the demo "
                    "model whose answers open with \"Captain's log:\" and close with "
                    "\"End of log.\"; prints the folder it wrote (a PEFT adapter that "
                    "'loraplex adapters add' and 'loraplex generate --adapter' accept).")
    adapter.add_argument("--model", default=None,
                         help="base model folder (default: LORAPLEX_MODEL, else the demo "
                              "model)")
    adapter.add_argument("--out", default=None,
                         help="adapter folder to write (default: "
                              "LORAPLEX_HOME/demo-adapters/captains-log)")
    adapter.add_argument("--steps", type=int, default=defaults.steps,
                         help="training steps (fewer: faster, a weaker style)")
    adapter.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                         help="AdamW learning rate")
    adapter.add_argument("--seed", type=int, default=defaults.seed,
                         help="seed of the generated data and the initial weights")
    adapter.set_defaults(func=_cmd_demo_adapter)

    draft = sub.add_parser(
        "draft", formatter_class=HelpFormatter,
        help="cut a draft model for speculative decoding out of a model's first layers",
        description="Write the model's first LAYERS decoder layers, with its embeddings, "
                    "final norm, LM head and tokenizer, as a standalone model folder; prints "
                    "it. Serve it with --speculative-config '{\"method\": \"draft_model\", "
                    "\"model\": OUT}' (for a model with no smaller sibling of its tokenizer).")
    draft.add_argument("--model", default=None,
                       help="model folder (default: LORAPLEX_MODEL, else the demo model)")
    draft.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    draft.add_argument("--out", required=True, help="folder to write")
    draft.set_defaults(func=_cmd_draft)

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
    except SQLAlchemyError as exc:  # serve's registry: an unreachable or unusable database
        print(f"loraplex: error: database: {first_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"loraplex: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
