"""`kiln serve MODEL`: the OpenAI-compatible API and the Storyteller page over the engine."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from kiln.errors import KilnError

DESCRIPTION = """Serve a model over HTTP: OpenAI's API (/v1/models, /v1/completions,
/v1/chat/completions, streaming), /health, /metrics (Prometheus) and the Storyteller page at /.

MODEL is any folder kiln loads (a kiln demo folder, a run, a checkpoint, an HF model folder).
The server binds 127.0.0.1 by default; any other --host needs an API key (--api-key or, better,
the KILN_API_KEY environment variable, which `ps` does not show). Clients send it as
'Authorization: Bearer KEY'. Limits have safe defaults; raise them with the options below.
SIGTERM (or Ctrl+C) stops accepting requests, lets running ones finish for --grace seconds,
cancels the rest and exits 0."""

EXAMPLES = """examples:
  kiln serve runs/demo-20260101-120000
  kiln serve runs/demo-20260101-120000 --port 8080 --max-concurrent 16
  KILN_API_KEY=s3cret kiln serve exports/demo --host 0.0.0.0
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "demo-20260101-120000", "prompt": "Once upon a time", "max_tokens": 40}'"""

API_KEY_ENV = "KILN_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kiln serve` to the `kiln` command."""
    from kiln.commands import add_subcommand
    from kiln.serve.limits import ServerLimits

    p = add_subcommand(
        sub, "serve", "serve a model: OpenAI-compatible API and the Storyteller page", EXAMPLES,
        description=DESCRIPTION,
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL", help="demo, run, checkpoint or HF model folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free one)")
    p.add_argument(
        "--api-key", default=None,
        help=f"key clients must send (default: ${API_KEY_ENV}; required off loopback)",
    )  # fmt: skip
    p.add_argument("--model-name", help="the model id clients name (default: MODEL's folder name)")
    p.add_argument("--tokenizer", help="tokenizer file or folder (default: the model's own)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--dtype", default="auto", help="auto, fp32 or bf16 (default auto)")
    p.add_argument(
        "--cors-origin", action="append", default=[], metavar="ORIGIN",
        help="allow browser pages from ORIGIN to call the API (repeatable; default: none)",
    )  # fmt: skip
    p.add_argument(
        "--grace", type=float, default=10.0,
        help="seconds running requests get to finish on SIGTERM (default 10)",
    )  # fmt: skip
    d = ServerLimits()
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help=f"largest request body (default {d.max_body_bytes:,}; more: 413)")  # fmt: skip
    limits.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt (default: the model's context)")  # fmt: skip
    limits.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help=f"most new tokens per request (default {d.max_tokens})")  # fmt: skip
    limits.add_argument("--max-n", type=int, default=d.max_n,
                        help=f"most samples per prompt (default {d.max_n})")  # fmt: skip
    limits.add_argument("--max-concurrent", type=int, default=d.max_concurrent,
                        help=f"requests in flight at once (default {d.max_concurrent}; more: 429)")  # fmt: skip
    limits.add_argument("--max-waiting", type=int, default=d.max_waiting,
                        help=f"engine's waiting queue (default {d.max_waiting}; full: 429)")  # fmt: skip
    limits.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences the engine batches at once (default: the engine's)")  # fmt: skip
    p.set_defaults(handler=run_serve)


def limits_from_args(args: argparse.Namespace) -> object:
    """ServerLimits from the command line (bad values: one KilnError line naming the limit)."""
    from kiln.serve.limits import ServerLimits

    return ServerLimits(
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens, max_n=args.max_n, max_concurrent=args.max_concurrent,
        max_waiting=args.max_waiting,
    )  # fmt: skip


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (so the real port is known before serving)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise KilnError(f"--host {host} --port {port}: cannot listen there ({exc})") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Check the exposure rule, load the model and engine, then serve until SIGTERM."""
    from kiln.serve.limits import check_exposure

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_exposure(args.host, api_key)  # before any loading: a refused start is instant
    limits = limits_from_args(args)
    if args.grace < 0:
        raise KilnError(f"--grace {args.grace}: expected seconds >= 0")

    from kiln.loading import load_model
    from kiln.serve.engine import Engine, EngineConfig
    from kiln.serve.server import ServerOptions, create_app, run_server

    sock = bind(args.host, args.port)  # a taken port fails before the model loads
    loaded = load_model(args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype)
    engine_options = {"max_waiting": limits.max_waiting}
    if args.max_num_seqs is not None:
        engine_options["max_num_seqs"] = args.max_num_seqs
    engine = Engine.from_loaded(loaded, EngineConfig(**engine_options))
    name = args.model_name or Path(args.model).resolve().name
    options = ServerOptions(name, limits, api_key, tuple(args.cors_origin))
    app = create_app(engine, loaded.tokenizer, loaded.model.cfg.block_size, options)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"kiln serve: {loaded.source}", file=sys.stderr)
    print(
        f"kiln serve: model {name!r} at http://{shown}:{port}/ (API /v1, page /, metrics "
        f"/metrics); API key {'required' if api_key else 'not required (loopback only)'}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    run_server(app, args.host, port, args.grace, sock)
    print("kiln serve: stopped", file=sys.stderr)
    return 0
