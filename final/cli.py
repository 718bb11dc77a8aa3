"""`final` command line. Each subcommand lives with its feature and registers itself here."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from final.errors import AdapterError, FinalError

if TYPE_CHECKING:
    from final.inf import InferenceEngine

# Feature modules that add subcommands: each has register(subparsers).
SUBCOMMAND_MODULES: list[str] = ["final.chat", "final.distill.cli", "final.evals.cli", "final.server.cli",
                                  "final.bench.cli"]


def quiet() -> None:
    # Library chatter (veRL, transformers) would drown the answer a CLI user asked for.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="config file (default: $FINAL_CONFIG, else ./config.yaml, else the package's default)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per completion")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """--replicas / --ray-address (final.pool.open_engine); default: the config's keys, else 1 and none."""
    p.add_argument("--replicas", type=int, default=None,
                   help="InferenceEngines on Ray sharing the work (default: the config's replicas:, else 1)")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379) instead of starting a local one")


def sampling_from_args(args: argparse.Namespace) -> dict:
    keys = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed}
    return {k: v for k, v in keys.items() if v is not None}


def open_engine(args: argparse.Namespace, **overrides) -> "InferenceEngine":
    """The command's engine: an InferenceEngine, or a pool of replicas on Ray with --replicas N / --ray-address
    (final.pool; the same API). Says which config file it uses when the command did not name one."""
    from final.config import default_config_path
    from final.pool import open_engine as open_pool

    config = args.config if args.config is not None else default_config_path()
    engine = open_pool(config, replicas=getattr(args, "replicas", None),
                       ray_address=getattr(args, "ray_address", None), **overrides)
    if args.config is None:
        print(f"final: config {config}", file=sys.stderr)
    return engine


def load_cartridges(engine: "InferenceEngine", names: list[str] | None) -> list[str] | None:
    """A command's --cartridge values (ids, or files loaded here under their path as id), in order, for
    generate(cartridge=...); None when there are none."""
    for cid in names or []:
        if os.path.isfile(cid):
            engine.load_cartridge(path=cid)
    return list(names) if names else None


def add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=None, metavar="NAME=DIR",
                   help="serve the PEFT LoRA adapter folder DIR under NAME (DIR alone: its folder's name); repeat "
                        "for several")


def lora_specs(specs: list[str] | None) -> list[tuple[str, str]]:
    """--lora values as (name, folder): NAME=DIR, or DIR alone (named after its folder)."""
    from final.adapters import adapter_name

    out = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        out.append((adapter_name(path, name), path) if sep else (adapter_name(spec), spec))
    return out


def load_adapters(engine: "InferenceEngine", specs: list[str] | None) -> list[str]:
    """A command's --lora NAME=DIR values loaded into the engine (one engine: not with --replicas); their names."""
    from final.inf import InferenceEngine

    if specs and not isinstance(engine, InferenceEngine):
        raise AdapterError("adapters are served by one engine: drop --replicas / --ray-address", field="--lora")
    return [engine.load_adapter(path, name=name) for name, path in lora_specs(specs)]


def _generation_adapter(args: argparse.Namespace) -> str | None:
    """generate's adapter: --adapter NAME ('base': none), else the one --lora names (several: --adapter says
    which), checked before any model loads."""
    names = [name for name, _ in lora_specs(args.lora)]
    if args.adapter is not None:
        return None if args.adapter == "base" else args.adapter
    if len(names) > 1:
        raise AdapterError(f"{len(names)} adapters given ({', '.join(names)}): say which with --adapter NAME",
                           field="--adapter")
    return names[0] if names else None


def _cmd_generate(args: argparse.Namespace) -> int:
    overrides = {"model_path": args.model} if args.model else {}
    adapter = _generation_adapter(args)
    with open_engine(args, **overrides) as engine:
        load_adapters(engine, args.lora)
        out = engine.generate(args.prompt, raw=args.raw, n=args.n, cartridge=load_cartridges(engine, args.cartridge),
                              progress=False, **({"adapter": adapter} if adapter else {}), **sampling_from_args(args))
    if args.json:
        print(json.dumps({"completions": out.completions, "metadata": out.metadata}))
    else:
        for i, text in enumerate(out.completions):
            if len(out.completions) > 1:
                print(f"--- [{i}]")
            print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="final", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print completions for one or more prompts")
    add_sampling_args(gen)
    add_replica_args(gen)
    gen.add_argument("prompt", nargs="+", help="prompts (each a user message unless --raw)")
    gen.add_argument("--model", default=None, help="override model_path")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text (no chat template)")
    gen.add_argument("--cartridge", action="append", help="cartridge id or .pt/.safetensors file (repeat to compose)")
    gen.add_argument("--json", action="store_true", help="print JSON with metadata")
    add_lora_arg(gen)
    gen.add_argument("--adapter", default=None, metavar="NAME",
                     help="the adapter to generate with (default: the one --lora loaded; 'base' for none)")
    gen.set_defaults(func=_cmd_generate)
    import importlib

    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet()
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand: a typed error is printed (it names the cause) and exits with status 2."""
    try:
        return func(args)
    except FinalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
