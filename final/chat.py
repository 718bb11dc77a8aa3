"""`final chat`: an interactive conversation in the terminal, optionally with tools (tool calls shown live).

    final chat                         # plain chat with the configured model
    final chat --tools tools.yaml      # multi-turn tool calling; each call and result is printed as it happens
Type /exit (or end input) to leave, /reset to start over.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from final.cli import add_replica_args, add_sampling_args, open_engine, sampling_from_args


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="chat in the terminal (with --tools: tool calls shown live)")
    add_sampling_args(p)
    p.add_argument("--model", default=None, help="override model_path")
    add_replica_args(p)
    p.add_argument("--tools", default=None, metavar="TOOLS_YAML", help="enable tool calling with this tools.yaml")
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    from final.tools.outputs import describe_event

    overrides: dict = {"progress": False}
    if args.model:
        overrides["model_path"] = args.model
    if args.tools:
        overrides["rollout"] = {"multi_turn": {"enable": True, "tool_config_path": args.tools}}
    sampling = sampling_from_args(args)
    def show(event: dict) -> None:
        line = describe_event(event)
        if line:
            print(line, file=stdout, flush=True)

    with open_engine(args, **overrides) as engine:
        live = show if args.tools and engine.capabilities.tool_events else None
        system = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(system)
        print("final chat — /exit to leave, /reset to start over", file=stdout, flush=True)
        while True:
            print("you> ", end="", file=stdout, flush=True)
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                messages = list(system)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            out = engine.generate([messages], on_event=live, **sampling)
            meta = out.metadata[0]
            # with tools the rollout returns the whole conversation (tool turns included); continue from it
            messages = meta["messages"] if "messages" in meta else messages + [
                {"role": "assistant", "content": out.completions[0]}]
            print(f"assistant> {out.completions[0]}", file=stdout, flush=True)
    return 0
