"""`kiln sample` and `kiln serve`: text from a model on the engine, on the terminal or over HTTP.

`kiln sample` streams one sample to stdout; `kiln serve MODEL` runs the OpenAI-compatible API
and the Storyteller page over the same engine.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

from kiln.commands import add_device_options, add_tokenizer_option
from kiln.errors import KilnError
from kiln.quant import options as quantize


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kiln sample` and `kiln serve` to the `kiln` command."""
    register_sample(sub)
    register_serve(sub)


SAMPLE_DESCRIPTION = """Generate text from a model, printing tokens as they are decoded.

MODEL is any folder kiln loads: a kiln demo folder, a run folder (or its train/), a run's
checkpoints/ or one checkpoint (step_N), or an HF model folder (kiln export, or GPT-2/Llama
saved by transformers) with its tokenizer beside it.

Special tokens: text in --prompt that spells a special token (e.g. <|endoftext|>) is refused
by default, so a prompt never silently turns into a control token; --allow-special encodes
such text as the control token instead."""

SAMPLE_EXAMPLES = """examples:
  kiln sample runs/demo-20260101-120000 --prompt 'Once upon a time' --max-tokens 100
  kiln sample exports/demo --prompt 'Once upon a time' --temperature 0.8 --top-k 50 --seed 0
  kiln sample runs/demo/train/checkpoints/step_500 --prompt-ids 50256,464 --temperature 0
  kiln sample exports/demo --prompt 'The end.<|endoftext|>Once' --allow-special"""


def register_sample(sub: argparse._SubParsersAction) -> None:
    """Add `kiln sample` to the `kiln` command."""
    from kiln.commands import add_subcommand

    p = add_subcommand(
        sub,
        "sample",
        "generate text from a model (demo, run, checkpoint or HF folder)",
        SAMPLE_EXAMPLES,
        description=SAMPLE_DESCRIPTION,
    )
    p.add_argument("model", metavar="MODEL", help="demo, run, checkpoint or HF model folder")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        help="prompt text (special-token text such as <|endoftext|> is refused unless "
        "--allow-special)",
    )
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 50256,464")
    p.add_argument(
        "--allow-special",
        action="store_true",
        help="encode special-token text in --prompt as the control tokens it names",
    )
    add_tokenizer_option(p)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, e.g. 0.95")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible samples")
    p.add_argument(
        "--stop-id",
        type=int,
        action="append",
        default=None,
        help="token id that ends the sample (repeatable; default: the model's end-of-text id)",
    )
    add_device_options(p)
    quantize.add_quantize_options(p)
    add_draft_options(p, serve=False)
    p.set_defaults(handler=run_sample)


DRAFT_HELP = """speculative decoding: 'ngram' (prompt lookup: no model), a draft model folder (any
folder kiln loads, same vocabulary as MODEL), or 'self:N' (MODEL's own first N layers: shows the
mechanics, rarely a speed-up)"""


def add_draft_options(p: argparse.ArgumentParser, serve: bool) -> None:
    """--draft and its settings (speculative decoding in the engine)."""
    from kiln.serve.engine import EngineConfig

    d = EngineConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", metavar="MODEL|ngram|self:N", default=None, help=DRAFT_HELP)
    g.add_argument("--draft-k", type=int, default=d.speculative_k,
                   help=f"draft tokens checked per step (default {d.speculative_k})")  # fmt: skip
    if serve:
        g.add_argument(
            "--draft-max-batch", type=int, default=d.speculative_max_batch,
            help="speculate only in steps where at most this many sequences decode (default "
            f"{d.speculative_max_batch}; a larger batch decodes plainly: it would be slower)",
        )  # fmt: skip


def check_draft_args(args: argparse.Namespace) -> None:
    """One clear line for a bad --draft-k / --draft-max-batch, before anything loads."""
    if args.draft_k < 1:
        raise KilnError(f"--draft-k must be >= 1, got {args.draft_k}")
    if getattr(args, "draft_max_batch", 1) < 1:
        raise KilnError(f"--draft-max-batch must be >= 1, got {args.draft_max_batch}")
    if args.draft is not None and args.draft.startswith("self:"):
        n = args.draft[len("self:") :]
        if not n.isdigit() or int(n) < 1:
            raise KilnError(f"--draft {args.draft}: expected self:N with N >= 1 target layers")


def drafter_from_args(args: argparse.Namespace, loaded: Any, command: str) -> Any:
    """The engine drafter --draft names (None without --draft); prints what drafts."""
    if args.draft is None:
        return None
    from kiln.serve.engine.drafters import LookupDrafter, ModelDrafter, truncated

    if args.draft == "ngram":
        drafter: Any = LookupDrafter()
        shown = "prompt lookup (n-gram)"
    elif args.draft.startswith("self:"):
        n = int(args.draft[len("self:") :])
        try:
            draft = truncated(loaded.model, n)
        except KilnError as exc:
            raise KilnError(f"--draft {args.draft}: {exc}") from None
        drafter = ModelDrafter(draft, loaded.autocast, name=args.draft)
        shown = f"the model's first {n} of {loaded.model.cfg.n_layer} layers"
    else:
        from kiln.loading import load_model

        try:
            other = load_model(args.draft, device=args.device, dtype=args.dtype,
                               need_tokenizer=False)  # fmt: skip
        except KilnError as exc:
            raise KilnError(f"--draft {args.draft}: {exc}") from None
        if other.model.cfg.vocab_size != loaded.model.cfg.vocab_size:
            raise KilnError(
                f"--draft {args.draft}: its vocabulary ({other.model.cfg.vocab_size}) differs "
                f"from MODEL's ({loaded.model.cfg.vocab_size}); a draft must share the tokenizer"
            )
        drafter = ModelDrafter(other.model, other.autocast, name=str(args.draft))
        shown = f"draft model {other.source}"
    print(f"{command}: speculative decoding, {args.draft_k} drafts a step from {shown} "
          "(engine.batch_invariant off)", file=sys.stderr)  # fmt: skip
    return drafter


def run_sample(args: argparse.Namespace) -> int:
    """Check the arguments, load the model (and tokenizer), then stream the sample to stdout."""
    _check_args(args)  # every flag is checked before anything loads or prints
    check_draft_args(args)
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    from kiln.loading import load_model

    loaded = load_model(
        args.model, args.tokenizer, args.device, args.dtype, need_tokenizer=prompt_ids is None
    )
    print(f"kiln sample: {loaded.source}", file=sys.stderr)
    print("\n".join(loaded.precision.lines("kiln sample")), file=sys.stderr)
    quantize.quantize_from_args(loaded.model, args, "kiln sample", loaded.precision.dtype)
    tok = loaded.tokenizer
    if prompt_ids is None:
        from kiln.tokenizer.user_text import encode_user_text

        assert tok is not None  # load_model refuses a missing tokenizer when one is needed
        ids = encode_user_text(tok, args.prompt, args.allow_special, "--prompt",
                               "pass --allow-special")  # fmt: skip
        if not ids and loaded.eot_id is not None:
            ids = [loaded.eot_id]  # an empty prompt starts a fresh document
        shown = args.prompt
    else:
        ids = prompt_ids
    _check_fits(ids, args.max_tokens, loaded.model.cfg)
    if prompt_ids is not None:
        shown = _decode_known(tok, ids) if tok is not None else None
    events = _engine_events(loaded, ids, args)
    # The first token is decoded before the prompt is printed, so whatever generation
    # refuses fails before any output.
    first = next(events, None)
    rest: Iterator[Any] = chain([first], events) if first is not None else iter(())
    if tok is None or shown is None:
        for event in rest:
            print(event.token_id, end=" ", flush=True)
        print()
    else:
        sys.stdout.write(shown)
        for event in rest:
            sys.stdout.write(event.text)  # whole characters only: the engine holds the rest
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _engine_events(loaded: Any, ids: list[int], args: argparse.Namespace) -> Iterator[Any]:
    """The sample's token events from the serving engine (this is the CLI layer: it may).

    Every architecture runs on the engine; a drafter is refused for recurrent layers.
    """
    from kiln.serve.engine import Engine, EngineConfig, SamplingParams, check_servable

    stop = args.stop_id if args.stop_id is not None else list(loaded.stop_ids)
    stop = [i for i in stop if i >= 0]  # a negative --stop-id matches nothing: no stop at all
    try:
        check_servable(loaded.model.cfg, speculative=args.draft is not None)
    except KilnError as exc:
        raise KilnError(f"--draft: {exc}") from None
    drafter = drafter_from_args(args, loaded, "kiln sample")
    config = EngineConfig(max_num_seqs=1, prefix_caching=False,
                          num_blocks=-(-(len(ids) + args.max_tokens) // 16),
                          batch_invariant=drafter is None, speculative_k=args.draft_k)  # fmt: skip
    engine = Engine.from_loaded(loaded, config, drafter)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed,
        stop_token_ids=tuple(stop), ignore_eos=True,  # exactly the stops asked for
    )  # fmt: skip
    handle = engine.submit(ids, params)
    yield from handle
    (done,) = handle.result()
    if done.finish_reason == "error":
        raise KilnError(f"generation failed: {done.error}")
    if drafter is not None:
        rate = f" ({done.acceptance_rate:.0%})" if done.acceptance_rate is not None else ""
        print(f"\nkiln sample: drafts accepted {done.accepted}/{done.drafted}{rate}",
              file=sys.stderr)  # fmt: skip


def _check_args(args: argparse.Namespace) -> None:
    """One clear line for a bad sampling flag, before the model is loaded."""
    if args.max_tokens < 1:
        raise KilnError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise KilnError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise KilnError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise KilnError(f"--top-p must be in (0, 1], got {args.top_p}")


def _check_fits(ids: list[int], max_tokens: int, cfg: Any) -> None:
    """The prompt's ids exist in the model and leave room for --max-tokens new ones."""
    if not ids:
        raise KilnError("the prompt is empty (and the model has no end-of-text id to start from)")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise KilnError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    if len(ids) + max_tokens > cfg.block_size:
        raise KilnError(
            f"the prompt ({len(ids)} tokens) + --max-tokens {max_tokens} exceeds the model's "
            f"block size {cfg.block_size}; lower --max-tokens or shorten the prompt"
        )


def _decode_known(tok: Any, ids: list[int]) -> str:
    """Text of ids, leaving out ids of a padded vocabulary that the tokenizer does not have."""
    return str(tok.decode([i for i in ids if i < tok.n_vocab]))


def _parse_ids(text: str) -> list[int]:
    """Comma-separated token ids, with a clear error for anything else."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise KilnError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise KilnError("--prompt-ids is empty")
    return ids


SERVE_DESCRIPTION = """Serve a model over HTTP: OpenAI's API (/v1/models, /v1/completions,
/v1/chat/completions, streaming; /v1/images/generations with --image-model), /health, /metrics
(Prometheus) and the Storyteller page at /.

MODEL is any folder kiln loads (a kiln demo folder, a run, a checkpoint, an HF model folder).
The server binds 127.0.0.1 by default; any other --host needs an API key (--api-key or, better,
the KILN_API_KEY environment variable, which `ps` does not show). Clients send it as
'Authorization: Bearer KEY'. Limits have safe defaults; raise them with the options below.
SIGTERM (or Ctrl+C) stops accepting requests, lets running ones finish for --grace seconds,
cancels the rest and exits 0."""

SERVE_EXAMPLES = """examples:
  kiln serve runs/demo-20260101-120000
  kiln serve runs/demo-20260101-120000 --port 8080 --max-concurrent 16
  kiln serve runs/demo-20260101-120000 --quantize int8
  KILN_API_KEY=s3cret kiln serve exports/demo --host 0.0.0.0
  kiln serve runs/demo-20260101-120000 --image-model runs/dit32
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "demo-20260101-120000", "prompt": "Once upon a time", "max_tokens": 40}'"""

API_KEY_ENV = "KILN_API_KEY"


def register_serve(sub: argparse._SubParsersAction) -> None:
    """Add `kiln serve` to the `kiln` command."""
    from kiln.commands import add_subcommand
    from kiln.serve.http.limits import ServerLimits

    p = add_subcommand(
        sub, "serve", "serve a model: OpenAI-compatible API and the Storyteller page",
        SERVE_EXAMPLES, description=SERVE_DESCRIPTION,
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL", help="demo, run, checkpoint or HF model folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free one)")
    p.add_argument(
        "--api-key", default=None,
        help=f"key clients must send (default: ${API_KEY_ENV}; required off loopback)",
    )  # fmt: skip
    p.add_argument("--model-name", help="the model id clients name (default: MODEL's folder name)")
    p.add_argument(
        "--image-model", metavar="IMAGE_RUN", default=None,
        help="also draw pictures: a `kiln image train-dit` run, served at "
        "/v1/images/generations and used by the page's Illustrate (id: its folder name)",
    )  # fmt: skip
    add_tokenizer_option(p)
    add_device_options(p)
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
    add_draft_options(p, serve=True)
    quantize.add_quantize_options(p)
    p.set_defaults(handler=run_serve)


def limits_from_args(args: argparse.Namespace) -> object:
    """ServerLimits from the command line (bad values: one KilnError line naming the limit)."""
    from kiln.serve.http.limits import ServerLimits

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
    from kiln.serve.http.limits import check_exposure

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_exposure(args.host, api_key)  # before any loading: a refused start is instant
    limits = limits_from_args(args)
    if args.grace < 0:
        raise KilnError(f"--grace {args.grace}: expected seconds >= 0")
    check_draft_args(args)

    from kiln.loading import load_model
    from kiln.serve.engine import Engine, EngineConfig
    from kiln.serve.http.server import ServerOptions, create_app, run_server

    sock = bind(args.host, args.port)  # a taken port fails before the model loads
    image_model = _load_image_model(args.image_model, args.device) if args.image_model else None
    loaded = load_model(args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype)
    print("\n".join(loaded.precision.lines("kiln serve")), file=sys.stderr)
    quantize.quantize_from_args(loaded.model, args, "kiln serve", loaded.precision.dtype)
    engine_options: dict[str, Any] = {"max_waiting": limits.max_waiting}
    if args.max_num_seqs is not None:
        engine_options["max_num_seqs"] = args.max_num_seqs
    drafter = drafter_from_args(args, loaded, "kiln serve")
    if drafter is not None:
        engine_options |= {"batch_invariant": False, "speculative_k": args.draft_k,
                           "speculative_max_batch": args.draft_max_batch}  # fmt: skip
    engine = Engine.from_loaded(loaded, EngineConfig(**engine_options), drafter)
    name = args.model_name or Path(args.model).resolve().name
    image_name = Path(args.image_model).resolve().name if image_model is not None else None
    options = ServerOptions(name, limits, api_key, tuple(args.cors_origin), image_name)
    app = create_app(engine, loaded.tokenizer, loaded.model.cfg.block_size, options, image_model)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"kiln serve: {loaded.source}", file=sys.stderr)
    print(
        f"kiln serve: model {name!r} at http://{shown}:{port}/ (API /v1, page /, metrics "
        f"/metrics); API key {'required' if api_key else 'not required (loopback only)'}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    if image_model is not None:
        print(f"kiln serve: image model {image_name!r} ({image_model.size}x{image_model.size}, "
              f"{image_model.diffusion.sample_steps} steps) at /v1/images/generations",
              file=sys.stderr, flush=True)  # fmt: skip
    run_server(app, args.host, port, args.grace, sock)
    print("kiln serve: stopped", file=sys.stderr)
    return 0


def _load_image_model(run: str, device: str) -> Any:
    """The --image-model run's text-to-image model on --device (its errors name the flag)."""
    from kiln.devices import resolve_device
    from kiln.image.sampler import load_image_model

    try:
        return load_image_model(run, str(resolve_device(device)))
    except KilnError as exc:
        raise KilnError(f"--image-model {run}: {exc}") from None
