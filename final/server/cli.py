"""`final serve` (the HTTP server) and `final ping` (Tokasaurus' toka-ping: a quick request to a server).

    final serve --config config.yaml --port 10210
    final ping "Tell me a joke" --chat --max-tokens 64
    final ping                                 # just GET /ping

FastAPI/uvicorn (the [serve] extra) are imported only when `serve` runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import time

from final.chat_template import REASONING_PARSERS, TOOL_CALL_PARSERS
from final.cli import add_lora_arg, add_replica_args, load_adapters, open_engine
from final.sampling import Limits

DEFAULT_PORT = 10210  # Tokasaurus' default
# flag, limits key, type, what it bounds (docs/reference/limits.md)
LIMIT_FLAGS = (
    ("--max-n", "max_n", int, "most samples per prompt"),
    ("--max-prompts", "max_prompts", int, "most prompts per request"),
    ("--max-stop", "max_stop", int, "most stop strings per request"),
    ("--max-stop-length", "max_stop_length", int, "most characters per stop string"),
    ("--max-top-logprobs", "max_top_logprobs", int, "most alternatives per token (logprobs: k, top_logprobs)"),
    ("--max-queued-rows", "max_queued_rows", int, "most rows queued in the engine; beyond, 429 with Retry-After"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body; beyond, 413"),
    ("--max-grammar-bytes", "max_grammar_bytes", int,
     "largest constraint (json_schema, regex, ebnf, structural_tag, a response_format schema); beyond, 400"),
    ("--deadline", "deadline_s", float, "seconds a request may run before its rows are aborted (504)"),
    ("--max-cartridge-bytes", "max_cartridge_bytes", int, "bytes of loaded cartridges; beyond, LRU eviction"),
    ("--cartridge-fetch-timeout", "cartridge_fetch_s", float,
     "seconds a request waits for a remote cartridge source (then 504)"),
)


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve OpenAI completions + Tokasaurus' cartridge endpoints over HTTP")
    serve.add_argument("--config", default=None,
                       help="config file (default: $FINAL_CONFIG, else ./config.yaml, else the package's default)")
    serve.add_argument("--model", default=None, help="override model_path")
    add_replica_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 = any free)")
    serve.add_argument("--api-key", default=os.environ.get("FINAL_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $FINAL_API_KEY, else none)")
    serve.add_argument("--cartridge-dir", default=None,
                       help="allow requests to load local cartridge files under this folder (default: none; "
                            "cartridges from the config are always served)")
    serve.add_argument("--cartridge-sources", default=None, metavar="LIST",
                       help="cartridge sources requests may name, of local,hf,s3,wandb (default: the config's "
                            "cartridge_sources, else local only: remote ones download with this server's credentials)")
    add_lora_arg(serve)
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how tool calls are written and read (config key tool_call_parser; default: the config's, "
                            "else auto: from the tokenizer, as SGLang picks qwen25; docs/guides/tool-calling.md)")
    serve.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="split <think> reasoning into reasoning_content (config key reasoning_parser; default: "
                            "the config's, else auto: where <think> and </think> are tokens)")
    serve.add_argument("--weights-dir", default=None,
                       help="accept weight updates (POST /update_weights_from_disk) from HF folders or .safetensors "
                            "files under this folder (default: none, updates refused with 403)")
    for flag, key, kind, what in LIMIT_FLAGS:
        serve.add_argument(flag, type=kind, default=None, dest=f"limit_{key}", metavar="S" if kind is float else "N",
                           help=f"{what} (overrides the config's limits.{key}; default {getattr(Limits(), key)})")
    serve.add_argument("--grace", type=float, default=30.0,
                       help="after SIGTERM: new requests get 503 and those in flight get this many seconds to "
                            "finish before they are cut (default 30)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=_cmd_serve)

    ping = sub.add_parser("ping", help="send one request to a running server (like Tokasaurus' toka-ping)")
    ping.add_argument("prompt", nargs="?", default=None, help="prompt; without one, only GET /ping")
    ping.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="server base URL")
    ping.add_argument("--chat", action="store_true", help="chat completions (the prompt is one user turn)")
    ping.add_argument("--model", default="default")
    ping.add_argument("--max-tokens", type=int, default=100)
    ping.add_argument("--n", type=int, default=1)
    ping.add_argument("--temperature", type=float, default=0.0)
    ping.add_argument("--stream", action="store_true", help="print text as it arrives (SSE)")
    ping.add_argument("--cartridge", action="append", default=None,
                      help="cartridge id (repeat to compose); sent to the /custom/cartridge/ endpoint")
    ping.add_argument("--cartridge-source", default="local", choices=["local", "wandb", "huggingface", "s3"])
    ping.add_argument("--api-key", default=os.environ.get("FINAL_API_KEY"))
    ping.add_argument("--timeout", type=float, default=300.0)
    ping.set_defaults(func=_cmd_ping)


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from final.server.app import create_app
    from final.server.limits import Drain, DrainingServer

    if not _is_loopback(args.host):
        print(f"warning: serving on {args.host}, reachable from other machines"
              f"{'' if args.api_key else ' without an API key (--api-key)'}", file=sys.stderr)
    overrides: dict = {"model_path": args.model} if args.model else {}
    limits = {key: getattr(args, f"limit_{key}") for _, key, _, _ in LIMIT_FLAGS
              if getattr(args, f"limit_{key}") is not None}
    if limits:  # deep-merged over the config's limits: and checked with them (ConfigError naming limits.KEY)
        overrides["limits"] = limits
    if args.cartridge_sources is not None:  # checked with the config (ConfigError naming cartridge_sources)
        overrides["cartridge_sources"] = args.cartridge_sources
    for key in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    with open_engine(args, **overrides) as inference:
        adapters = load_adapters(inference, args.lora)  # the OpenAI `model` field names them (GET /v1/models)
        print(f"final serve: {inference.config.model_path} on the {inference.backend} backend"
              f"{f', adapters {adapters}' if adapters else ''}", file=sys.stderr)
        app = Drain(create_app(inference, api_key=args.api_key, cartridge_dir=args.cartridge_dir,
                                    weights_dir=args.weights_dir))
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=1)  # what is left after --grace is cut
        DrainingServer(config, app, args.grace).run()
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cmd_ping(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/")
    with httpx.Client(timeout=args.timeout, headers=headers) as http:
        try:
            if args.prompt is None:
                r = http.get(f"{base}/ping")
                print(r.text)
                return 0 if r.status_code == 200 else 1
            path, body = _request(args)
            start = time.perf_counter()
            if args.stream:
                texts = _stream(http, f"{base}{path}", body, args.chat)
            else:
                r = http.post(f"{base}{path}", json=body)
                if r.status_code != 200:
                    print(f"error: HTTP {r.status_code}: {r.text}", file=sys.stderr)
                    return 1
                choices = r.json()["choices"]
                texts = [c["message"]["content"] if args.chat else c["text"] for c in choices]
        except httpx.HTTPError as exc:
            print(f"error: cannot reach {base}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    print(f"time taken: {time.perf_counter() - start:.3f} s", file=sys.stderr)
    if not args.stream:
        for i, text in enumerate(texts):
            if len(texts) > 1:
                print(f"--- [{i}]")
            print(text)
    return 0


def _request(args: argparse.Namespace) -> tuple[str, dict]:
    body: dict = {"model": args.model, "max_tokens": args.max_tokens, "n": args.n, "temperature": args.temperature,
                  "stream": args.stream}
    if args.chat:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    kind = "chat/completions" if args.chat else "completions"
    if args.cartridge:
        body["cartridges"] = [{"id": c, "source": args.cartridge_source, "force_redownload": False}
                              for c in args.cartridge]
        return f"/custom/cartridge/{kind}", body
    return f"/v1/{kind}", body


def _stream(http, url: str, body: dict, chat: bool) -> list[str]:
    """Print each SSE text delta as it arrives; returns the texts per choice."""
    texts: dict[int, str] = {}
    with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"error: HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise SystemExit(f"error: {event['error']['message']}")
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece:
                    texts[choice["index"]] = texts.get(choice["index"], "") + piece
                    print(piece, end="", flush=True)
    print()
    return [texts[i] for i in sorted(texts)]
