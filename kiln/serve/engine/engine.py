"""The inference engine: continuous batching of many requests over a paged KV cache.

Requests arrive with `submit` (from any thread) and leave as soon as they finish; every `step`
runs one forward over the scheduled segments of all running requests (a decode token each,
plus prefill chunks up to the token budget), then samples each request's next token with its
own generator. Greedy output equals `kiln.model.generate` for the prompt alone. With
batch_invariant (the default) the forward runs every weight matmul in fixed 16-row tiles and
decode attention in fixed tiles of sequences, so on CPU a request's logits are bitwise the same
whatever else is in the batch (see `invariant.py`; docs/engine.md lists what it was verified
under and what it costs).

Every architecture kiln.model builds is served (docs/engine.md, "Architectures"): MLA from its
latent cache with absorbed weights, sinks and soft-caps in the paged attention, sliding windows
that release the blocks behind the window (a model mixing windowed and global layers keeps a
second block group for the windowed ones: window_blocks.py), and recurrent layers (Mamba-2, Gated
DeltaNet, hybrids) with a per-sequence state slot (state_pool.py) beside the KV blocks of the
attention layers; prefix caching is off for recurrent models (their state is not cached).

With a drafter (drafters.py) the step speculates: each decoding sequence's last token and up to
k draft tokens are checked in the same one forward (a k+1-token segment of the packed row), the
accepted drafts and one more token are committed to the sequence and its blocks, the rejected
drafts' blocks go back to the pool. The accept/reject rule is speculative.py's, applied after
the request's own penalties, processors and truncation, so greedy output is the target's and
sampled output is distributed as the target's. Speculation is switched off for a step when more
than `speculative_max_batch` sequences decode in it (a large batch already fills the matmuls,
and checking k+1 tokens per sequence then costs about k+1 times as much). Whether a step
speculates depends on the batch, so a drafter and batch_invariant are refused together.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kiln.config import ConfigError, require
from kiln.errors import KilnError
from kiln.model.transformer import Transformer
from kiln.serve.engine import speculative
from kiln.serve.engine.block_pool import FREED, BlockPool, attention_layers, block_bytes
from kiln.serve.engine.invariant import ROWS, TiledMatmuls, pad_rows
from kiln.serve.engine.paged_cache import PagedStep, Segment
from kiln.serve.engine.requests import Completion, RequestHandle, TokenEvent
from kiln.serve.engine.sampling import (
    Sampled,
    SamplingParams,
    apply_penalties,
    sample_generator,
    sample_token,
    truncate,
)
from kiln.serve.engine.scheduler import Scheduler, Work
from kiln.serve.engine.scheduler import Sequence as Seq
from kiln.serve.engine.state_pool import StatePool
from kiln.serve.engine.stop import TextStream
from kiln.serve.engine.window_blocks import WindowBlocks

if TYPE_CHECKING:
    from kiln.loading import LoadedModel
    from kiln.model.config import ModelConfig
    from kiln.serve.engine.drafters import EngineDrafter
    from kiln.tokenizer.tokenizer import Tokenizer


__all__ = [
    "Completion", "Engine", "EngineConfig", "EngineFull", "EngineStats", "RequestHandle",
    "TokenEvent",
]  # fmt: skip


class EngineFull(KilnError):
    """The waiting queue is at max_waiting: try again later (HTTP 429)."""


class EngineConfigError(ConfigError):
    """An engine setting out of range; the message names the field."""


@dataclass(frozen=True)
class EngineConfig:
    """KV pool size, batch limits and scheduling switches of an Engine."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # the pool's size; None: from kv_cache_bytes or the default
    kv_cache_bytes: int | None = None  # bound the pool by memory instead of a block count
    max_num_seqs: int = 64  # sequences (samples) running at once
    max_tokens_per_step: int = 512  # token budget per step (decode tokens + prefill chunks)
    prefill_chunk: int = 128  # prompts are prefilled in chunks cut at multiples of this
    max_waiting: int = 4096  # submit raises EngineFull beyond this many queued requests
    prefix_caching: bool = True  # share block-aligned prompt prefixes between requests
    batch_invariant: bool = True  # fixed-shape matmul tiles: logits independent of the batch
    invariant_rows: int = ROWS  # the fixed row tile of every matmul (1: batch-1 latency)
    default_kv_bytes: int = 1 << 30  # pool memory when neither num_blocks nor kv_cache_bytes
    speculative_k: int = 4  # with a drafter: draft tokens checked per sequence per step
    speculative_max_batch: int = 8  # with a drafter: speculate only when this many decode or fewer

    def __post_init__(self) -> None:
        """Refuse values the engine cannot run with, naming the field."""
        for name in ("block_size", "max_num_seqs", "max_tokens_per_step", "prefill_chunk",
                     "max_waiting", "invariant_rows", "default_kv_bytes", "speculative_k",
                     "speculative_max_batch"):  # fmt: skip
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1,
                    f"engine.{name} must be an integer >= 1, got {value!r}",
                    EngineConfigError)  # fmt: skip
        for name in ("num_blocks", "kv_cache_bytes"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, int) and value >= 1),
                    f"engine.{name} must be None or an integer >= 1, got {value!r}",
                    EngineConfigError)  # fmt: skip
        require(self.num_blocks is None or self.kv_cache_bytes is None,
                "engine.num_blocks and engine.kv_cache_bytes are exclusive: give one",
                EngineConfigError)  # fmt: skip


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues, KV pool and counters."""

    running: int
    waiting: int
    blocks_total: int
    blocks_used: int  # held by sequences or kept by the prefix cache
    blocks_free: int
    blocks_cached: int  # kept by the prefix cache, held by no sequence
    prompt_tokens: int
    generated_tokens: int
    preemptions: int
    prefix_hits: int  # prompt tokens served from the prefix cache
    steps: int
    draft_tokens: int = 0  # draft tokens checked by the target (with a drafter)
    accepted_tokens: int = 0  # of those, kept
    speculative_steps: int = 0  # steps that checked drafts


@dataclass(eq=False)
class _Sample:
    """The engine's state for one sample of a request."""

    request: _Request
    index: int
    generator: torch.Generator
    stream: TextStream
    seq: Seq | None = None
    generated: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: Completion | None = None
    drafted: int = 0  # draft tokens the target checked for this sample
    accepted: int = 0


@dataclass(eq=False)
class _Request:
    handle: RequestHandle
    params: SamplingParams
    stop_ids: frozenset[int]
    samples: list[_Sample] = field(default_factory=list)
    forked: bool = False
    cancelled: bool = False


def check_servable(cfg: ModelConfig, *, speculative: bool = False) -> None:
    """Refuse, before any request, what the engine cannot run (only speculation, now).

    Every attention kind (GQA, MLA from its latent, sinks, soft-caps, sliding windows) and the
    recurrent layers are served; speculative steps are refused with recurrent layers, whose
    state cannot roll back rejected drafts.
    """
    if speculative and cfg.has_recurrent_layers:
        raise EngineConfigError(
            f"speculative decoding (a drafter) needs to roll back rejected drafts, and the "
            f"recurrent state of model.layer_pattern = {cfg.layer_pattern!r} cannot be rolled "
            "back: serve this model without a drafter"
        )


def sliding_window_horizon(cfg: ModelConfig) -> int | None:
    """The widest window when every attention layer has one (older blocks can be freed)."""
    windows = {cfg.layer_window(i) for i in attention_layers(cfg)}
    if not windows or None in windows:
        return None
    return max(w for w in windows if w is not None)


class Engine:
    """Continuous batching over a paged KV cache for one model (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None,
        config: EngineConfig | None = None,
        *,
        eot_id: int | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        drafter: EngineDrafter | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.eot_id = eot_id
        self.extra_stop_ids: frozenset[int] = frozenset()  # more end-of-sequence ids (HF configs)
        self._autocast = autocast or contextlib.nullcontext
        param = next(model.parameters())
        self.device = param.device
        cfg = model.cfg
        c = self.config
        check_servable(cfg, speculative=drafter is not None)
        if drafter is not None and c.batch_invariant:
            raise EngineConfigError(
                "engine.batch_invariant and a drafter are exclusive: whether a step speculates "
                "depends on how many sequences decode in it, so a request's logits (and a seeded "
                "request's tokens) would depend on the batch; set batch_invariant=False"
            )
        per_block = block_bytes(cfg, c.block_size, param.dtype)
        enough = c.max_num_seqs * -(-cfg.block_size // c.block_size)  # all sequences at full length
        if c.num_blocks is not None:
            num_blocks = c.num_blocks
        elif per_block == 0:  # no attention layer: the block tables are bookkeeping only
            num_blocks = enough
        else:
            memory = c.kv_cache_bytes or c.default_kv_bytes
            num_blocks = memory // per_block - 2  # the pool keeps a zero and a scratch block
            if c.kv_cache_bytes is None:  # the default: no more than all sequences can use
                num_blocks = min(num_blocks, enough)
        if num_blocks < 1:
            raise EngineConfigError(
                f"engine.kv_cache_bytes = {c.kv_cache_bytes} holds no KV block "
                f"({per_block} bytes each)"
            )
        # A model mixing windowed and global layers: the windowed layers get their own pool,
        # sized to what their windows can hold, and free their blocks behind the window.
        step_tokens = max(c.max_tokens_per_step, c.prefill_chunk) + c.speculative_k + 1
        self.windowed = WindowBlocks.for_model(cfg, num_blocks, c.block_size, c.max_num_seqs,
                                               step_tokens, self.device, param.dtype)  # fmt: skip
        self.pool = BlockPool(cfg, num_blocks, c.block_size, device=self.device, dtype=param.dtype,
                              layers=self.windowed and self.windowed.global_layers)  # fmt: skip
        self.drafter = drafter
        if drafter is not None:
            drafter.setup(model, num_blocks, c.block_size)
        # Recurrent layers: a state slot per running sequence; a cached prefix would need the
        # state at its end, which is not kept, so prefix caching is off for these models.
        self.states: StatePool | None = None
        if cfg.has_recurrent_layers:
            self.states = StatePool(model, c.max_num_seqs, self.device,
                                    invariant=c.batch_invariant)  # fmt: skip
        self.scheduler = Scheduler(
            self.pool, max_num_seqs=c.max_num_seqs, max_tokens_per_step=c.max_tokens_per_step,
            prefill_chunk=c.prefill_chunk, prefix_caching=c.prefix_caching and self.states is None,
            states=self.states, window=sliding_window_horizon(cfg), local=self.windowed,
        )  # fmt: skip
        self._lock = threading.Lock()  # guards the inbox, cancellations and counters
        self._step_lock = threading.Lock()  # one step at a time
        self._wake = threading.Condition(self._lock)
        self._inbox: deque[_Request] = deque()
        self._cancels: set[RequestHandle] = set()
        self._requests: dict[RequestHandle, _Request] = {}
        self._arrivals = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.broken: str | None = None  # why the background loop died, if it did
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.speculative_steps = 0

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, config: EngineConfig | None = None,
        drafter: EngineDrafter | None = None,
    ) -> Engine:  # fmt: skip
        """An engine over what kiln.loading.load_model returned (its precision included)."""
        engine = cls(loaded.model, loaded.tokenizer, config, eot_id=loaded.eot_id,
                     autocast=loaded.autocast, drafter=drafter)  # fmt: skip
        engine.extra_stop_ids = frozenset(loaded.stop_ids)
        return engine

    @property
    def background(self) -> bool:
        """Whether start()'s loop is stepping the engine."""
        return self._thread is not None

    # ---------------------------------------------------------------------------- requests
    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> RequestHandle:
        """Queue a request; every bad value is refused here with a KilnError naming the field."""
        if self.broken is not None:
            raise KilnError(f"the engine's loop has stopped ({self.broken}); restart the server")
        params = SamplingParams() if params is None else params
        ids = self._check(prompt_ids, params)
        handle = RequestHandle(self, ids, params.n)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.extra_stop_ids
            if self.eot_id is not None:
                stop.add(self.eot_id)
        request = _Request(handle, params, frozenset(stop))
        for i in range(params.n):
            request.samples.append(_Sample(
                request, i, sample_generator(params, i, self.device),
                TextStream(self.tokenizer, params.stop),
            ))  # fmt: skip
        with self._lock:
            if len(self._inbox) + len(self.scheduler.waiting) >= self.config.max_waiting:
                raise EngineFull(
                    f"the engine has {self.config.max_waiting} requests waiting "
                    "(engine.max_waiting); try again later"
                )
            self._inbox.append(request)
            self._wake.notify_all()
        return handle

    def submit_text(self, prompt: str, params: SamplingParams | None = None) -> RequestHandle:
        """Encode prompt (special-token text refused) and submit it."""
        from kiln.tokenizer.user_text import encode_user_text

        if self.tokenizer is None:
            raise KilnError("this engine has no tokenizer: submit token ids instead")
        ids = encode_user_text(self.tokenizer, prompt, False, "the prompt", "pass token ids")
        if not ids and self.eot_id is not None:
            ids = [self.eot_id]  # an empty prompt starts a fresh document
        return self.submit(ids, params)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[Completion]]:
        """Run a batch of prompts to completion: each prompt's n completions."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise KilnError(f"params: {len(params)} given for {len(prompts)} prompts")
        handles = [self.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return [h.result() for h in handles]

    def _check(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, after every check a request must pass."""
        if not isinstance(params, SamplingParams):
            raise KilnError(f"params must be SamplingParams, got {type(params).__name__}")
        cfg = self.model.cfg
        if isinstance(prompt_ids, str | bytes) or not isinstance(
            prompt_ids, Sequence | torch.Tensor
        ):
            raise KilnError(
                f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}"
            )
        ids = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        if not ids:
            raise KilnError("prompt_ids is empty: a prompt needs at least one token")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < cfg.vocab_size:
                raise KilnError(
                    f"prompt_ids[{i}] = {t!r} is not a token id in [0, {cfg.vocab_size})"
                )
        bad = [t for t in params.stop_token_ids if t >= cfg.vocab_size]
        if bad:
            raise KilnError(
                f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})"
            )
        if params.logprobs is not None and params.logprobs > cfg.vocab_size:
            raise KilnError(
                f"logprobs = {params.logprobs} exceeds the vocabulary ({cfg.vocab_size})"
            )
        if len(ids) >= cfg.block_size:
            raise KilnError(
                f"prompt_ids: {len(ids)} tokens leave no room in the model's context of "
                f"{cfg.block_size} tokens"
            )
        total = len(ids) + params.max_tokens
        if total > cfg.block_size:
            raise KilnError(
                f"max_tokens = {params.max_tokens}: the prompt ({len(ids)} tokens) + max_tokens "
                f"= {total} exceeds the model's context of {cfg.block_size} tokens"
            )
        blocks = -(-total // self.config.block_size)
        if blocks > self.pool.num_blocks:
            raise KilnError(
                f"max_tokens = {params.max_tokens}: prompt + max_tokens needs {blocks} KV blocks, "
                f"the pool has {self.pool.num_blocks} (engine.num_blocks)"
            )
        return ids

    def _cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            self._cancels.add(handle)
            self._wake.notify_all()

    # ---------------------------------------------------------------------------- stepping
    def step(self) -> int:
        """One scheduling step: one forward over the scheduled work; the tokens it produced."""
        with self._step_lock:
            self._take_inbox()
            work = self.scheduler.schedule()
            if not work:
                return 0
            self.steps += 1
            try:
                drafts = self._draft(work) if self.drafter is not None else {}
                logits = self._forward(work, drafts) if drafts else self._forward(work)
            except Exception as exc:  # the step's requests fail, the engine lives
                for w in work:
                    self._fail(w.seq.owner.request, exc)
                return 0
            produced = 0
            row = 0
            for w in work:
                self.scheduler.computed(w.seq, w.end - w.start)
            argmax: list[int] | None = None  # plain greedy rows share one batched argmax
            for w in work:
                if not w.sample:
                    continue
                sample: _Sample = w.seq.owner
                request = sample.request
                proposed = drafts.get(w.seq)
                if proposed is not None:
                    if sample.done is None:
                        try:
                            rows = logits[row : row + len(proposed) + 1]
                            produced += self._speculate(sample, rows, proposed)
                        except Exception as exc:  # this request fails alone
                            self._fail(request, exc)
                    row += len(proposed) + 1
                    continue
                if sample.done is None:
                    try:
                        if request.params.plain_greedy and request.params.n == 1:
                            if argmax is None:
                                argmax = logits.argmax(dim=-1).tolist()
                            produced += self._emit(sample, Sampled(argmax[row], None, None))
                        else:
                            produced += self._advance(sample, logits[row])
                    except Exception as exc:  # this request fails alone
                        self._fail(request, exc)
                row += 1
            with self._lock:
                self.generated_tokens += produced
            return produced

    def _draft(self, work: list[Work]) -> dict[Seq, list[int]]:
        """Draft tokens per decoding sequence of this step (none when speculation is off)."""
        assert self.drafter is not None
        c, cfg = self.config, self.model.cfg
        decoding = [w for w in work if w.sample and w.end - w.start == 1]
        if not decoding or len(decoding) > c.speculative_max_batch:
            return {}
        room = c.max_tokens_per_step - sum(w.end - w.start for w in work)
        asks: list[tuple[object, list[int], int]] = []
        for w in decoding:
            sample: _Sample = w.seq.owner
            request = sample.request
            if sample.done is not None or (request.params.n > 1 and not request.forked):
                continue  # the first token forks the other samples: plain decoding
            k = min(c.speculative_k, request.params.max_tokens - len(sample.generated) - 1,
                    cfg.block_size - len(w.seq.tokens), room)  # fmt: skip
            if k >= 1:
                asks.append((w.seq, w.seq.tokens, k))
                room -= k
        if not asks:
            return {}
        proposals = self.drafter.propose(asks)
        drafts: dict[Seq, list[int]] = {}
        for (seq, _, k), proposed in zip(asks, proposals, strict=True):
            ids = [int(t) for t in proposed[:k]]
            valid = bool(ids) and all(0 <= t < cfg.vocab_size for t in ids)
            # Blocks for the drafts' keys and values, never by preempting another sequence.
            if valid and self.scheduler.reserve(seq, len(seq.tokens) + len(ids)):
                drafts[seq] = ids
        if drafts:
            self.speculative_steps += 1
        return drafts

    def _speculate(self, sample: _Sample, rows: torch.Tensor, drafts: list[int]) -> int:
        """Check drafts against the target's rows (m+1, V); commit the kept ones and one more."""
        seq = sample.seq
        assert seq is not None
        params = sample.request.params
        prompt = seq.tokens[: seq.prompt_len]
        kept: list[int] = []
        nxt = -1
        for i, raw in enumerate(rows.float()):
            row = apply_penalties(raw, params, prompt, [*sample.generated, *kept])
            for processor in params.logits_processors:
                row = processor([*sample.generated, *kept], row)
            if params.greedy:
                nxt = int(row.argmax())
                if i < len(drafts) and drafts[i] == nxt:
                    kept.append(nxt)
                    continue
                break
            probs = truncate(row, params).softmax(dim=-1)
            if i == len(drafts):
                nxt = int(torch.multinomial(probs, 1, generator=sample.generator))
                break
            x = drafts[i]
            # A deterministic draft is q = one-hot(x): kept with probability p(x), else the
            # next token comes from p with x removed (speculative.py's rule).
            if float(torch.rand((), generator=sample.generator)) < float(probs[x]):
                kept.append(x)
                continue
            q = torch.zeros_like(probs)
            q[x] = 1.0
            residual = speculative.residual_distribution(probs, q)
            nxt = int(torch.multinomial(residual, 1, generator=sample.generator))
            break
        sample.drafted += len(drafts)
        sample.accepted += len(kept)
        with self._lock:
            self.draft_tokens += len(drafts)
            self.accepted_tokens += len(kept)
        produced = 0
        for i, token in enumerate([*kept, nxt]):
            produced += self._emit(sample, self._picked(rows[i], token, params))
            if sample.done is not None:
                return produced  # a stop or the length: its blocks are released already
        self.scheduler.computed(seq, len(kept))  # the kept drafts' keys and values stay
        self.scheduler.trim(seq)  # the rejected drafts' blocks go back to the pool
        return produced

    @staticmethod
    def _picked(raw: torch.Tensor, token: int, params: SamplingParams) -> Sampled:
        """A chosen token with the model's own logprobs (when asked), as sample_token gives."""
        if params.logprobs is None:
            return Sampled(token, None, None)
        logp = raw.float().log_softmax(dim=-1)
        top: list[tuple[int, float]] = []
        if params.logprobs > 0:
            values, ids = logp.topk(params.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return Sampled(token, float(logp[token]), top)

    def _forward(
        self, work: list[Work], drafts: dict[Seq, list[int]] | None = None
    ) -> torch.Tensor:
        """Logits (R, V) of the rows that sample (a speculating one: m+1 rows), one forward."""
        drafts = drafts or {}
        tokens: list[int] = []
        rows: list[int] = []
        segments = []
        for w in work:
            extra = drafts.get(w.seq, [])
            tokens += w.seq.tokens[w.start : w.end] + extra
            segments.append(Segment(tuple(w.seq.blocks), w.start, w.end + len(extra), w.seq.state,
                                    tuple(w.seq.local)))  # fmt: skip
            if w.sample:
                rows += range(len(tokens) - 1 - len(extra), len(tokens))
        pad = 0
        if self.config.batch_invariant:  # whole tiles: elementwise ops and norms see them too
            pad = pad_rows(len(tokens), self.config.invariant_rows) - len(tokens)
        idx = torch.tensor(tokens + [0] * pad, dtype=torch.long, device=self.device)[None]
        local = None
        if self.windowed is not None:  # the windowed layers read their own tables
            local = PagedStep(self.windowed.pool, [Segment(s.local, s.start, s.end)
                              for s in segments], self.device,
                              invariant=self.config.batch_invariant, pad_tokens=pad)  # fmt: skip
        cache = PagedStep(self.pool, segments, self.device, invariant=self.config.batch_invariant,
                          pad_tokens=pad, states=self.states, local=local)  # fmt: skip
        tiles = contextlib.nullcontext()
        if self.config.batch_invariant:
            tiles = TiledMatmuls(self.config.invariant_rows)
        with torch.inference_mode(), self._autocast(), tiles:
            h = self.model.hidden(idx, cache)  # (1, N + pad, C)
            if not rows:
                return h.new_empty(0, self.model.cfg.vocab_size)
            if self.config.batch_invariant:
                rows += [rows[-1]] * (pad_rows(len(rows), self.config.invariant_rows) - len(rows))
            elif len(rows) == h.size(1):  # every row samples (a decode step): no gather
                return self.model.logits(h[0]).float()
            return self.model.logits(h[0, rows]).float()  # (R (+ padding), V)

    def _advance(self, sample: _Sample, logits: torch.Tensor) -> int:
        """Sample the next token of one sample (forking the other n-1 after the prompt)."""
        request = sample.request
        if request.params.n > 1 and not request.forked:
            request.forked = True
            produced = 0
            for child in request.samples[1:]:
                if self._fork(sample.seq, child):
                    produced += self._sample_one(child, logits)
            return produced + self._sample_one(sample, logits)
        return self._sample_one(sample, logits)

    def _sample_one(self, sample: _Sample, logits: torch.Tensor) -> int:
        seq = sample.seq
        assert seq is not None
        picked = sample_token(logits, sample.request.params, seq.tokens[: seq.prompt_len],
                              sample.generated, sample.generator)  # fmt: skip
        return self._emit(sample, picked)

    def _emit(self, sample: _Sample, picked: Sampled) -> int:
        """Append a sampled token: stop checks, text, the event; 1 if a token was produced."""
        seq = sample.seq
        assert seq is not None
        params = sample.request.params
        if picked.token_id in sample.request.stop_ids:
            self._complete(sample, "stop")
            return 0
        sample.generated.append(picked.token_id)
        seq.tokens.append(picked.token_id)
        text = sample.stream.push(picked.token_id)
        reason = None
        if sample.stream.stopped:
            reason = "stop"
        elif len(sample.generated) >= params.max_tokens:
            reason = "length"
            text += sample.stream.finish()
        event = TokenEvent(sample.index, picked.token_id, text, picked.logprob, picked.top_logprobs)
        sample.text.append(text)
        if params.logprobs is not None:
            sample.events.append(event)
        sample.request.handle._push(event)
        if reason is not None:
            self._complete(sample, reason)
        return 1

    def _fork(self, parent: Seq | None, child: _Sample) -> bool:
        """Start sample `child` on the parent's prompt blocks; False if it must wait instead."""
        assert parent is not None
        bs = self.pool.block_size
        prompt = parent.tokens[: parent.prompt_len]
        seq = Seq(list(prompt), parent.prompt_len, next(self._arrivals), owner=child)
        child.seq = seq
        full, partial = divmod(parent.prompt_len, bs)
        room = len(self.scheduler.running) < self.config.max_num_seqs
        if self.windowed is not None and partial and self.windowed.pool.available == 0:
            room = False
        if not room or (partial and self.pool.available == 0):
            self.scheduler.add(seq)  # recomputed (prefix-cache hits permitting) when admitted
            return False
        for block in parent.blocks[:full]:
            if block != FREED:  # fallen out of the sliding window already
                self.pool.retain(block)
        seq.blocks = list(parent.blocks[:full])
        if partial:  # copy-on-write: each sample writes its own tokens into the last block
            block = self.pool.allocate()
            self.pool.copy(parent.blocks[full], block)
            seq.blocks.append(block)
        if self.windowed is not None:
            self.windowed.fork(parent, seq, full, bool(partial))
        seq.num_computed = parent.prompt_len
        seq.registered = min(parent.registered, full)
        seq.keys = parent.keys[:full]
        self.scheduler.start_state(seq)
        if seq.state is not None:  # the parent's state after the prompt is the child's too
            assert self.states is not None and parent.state is not None
            self.states.copy(parent.state, seq.state)
        self.scheduler.running.append(seq)
        return True

    def _complete(self, sample: _Sample, reason: str, error: str | None = None) -> None:
        if sample.done is not None:
            return
        if sample.seq is not None:
            self.scheduler.remove(sample.seq)
            sample.seq.finished = True
            if self.drafter is not None:
                self.drafter.release(sample.seq)
        params = sample.request.params
        if reason in ("stop", "cancelled"):
            # Text held back (a possible stop-string start, an unfinished character) is the
            # sample's own when a stop token or a cancel ends it: it belongs in the completion.
            sample.text.append(sample.stream.finish())
        sample.done = Completion(
            sample.index, list(sample.generated), "".join(sample.text), reason,
            list(sample.events) if params.logprobs is not None else None, error,
            sample.drafted, sample.accepted,
        )  # fmt: skip
        sample.request.handle._finish(sample.done)
        if all(s.done is not None for s in sample.request.samples):
            self._requests.pop(sample.request.handle, None)

    def _fail(self, request: _Request, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        for sample in request.samples:
            self._complete(sample, "error", message)

    def _take_inbox(self) -> None:
        """Move new requests into the scheduler and apply cancellations (under the lock)."""
        with self._lock:
            new = list(self._inbox)
            self._inbox.clear()
            cancels = list(self._cancels)
            self._cancels.clear()
        for request in new:
            self._requests[request.handle] = request
            # Only sample 0 prefills; the others fork from its prompt blocks (see _advance).
            first = request.samples[0]
            prompt = request.handle.prompt_ids
            first.seq = Seq(list(prompt), len(prompt), next(self._arrivals), owner=first)
            self.scheduler.add(first.seq)
            with self._lock:
                self.prompt_tokens += len(request.handle.prompt_ids)
        for handle in cancels:
            request = self._requests.get(handle)
            if request is not None:
                for sample in request.samples:
                    self._complete(sample, "cancelled")

    # ---------------------------------------------------------------------------- background
    def start(self) -> None:
        """Step in a background thread until stop()."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._has_work():
                    self._wake.wait(0.1)
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # the loop must not die silently: its waiters would hang
                self._break(exc)
                return

    def _break(self, exc: BaseException) -> None:
        """The loop itself failed (not one request): fail every live request, refuse new ones."""
        self.broken = f"{type(exc).__name__}: {exc}"
        with self._lock:
            requests = [*self._requests.values(), *self._inbox]
        for request in requests:
            with contextlib.suppress(Exception):  # a waiter's event loop may be gone already
                self._fail(request, exc)

    def _has_work(self) -> bool:
        return bool(self._inbox or self._cancels or self.scheduler.running
                    or self.scheduler.waiting)  # fmt: skip

    def stop(self, cancel_running: bool = False, timeout: float | None = None) -> None:
        """Stop the background loop (after its current step); optionally cancel every request."""
        thread = self._thread
        if thread is not None:
            with self._lock:
                self._stopping = True
                self._wake.notify_all()
            thread.join(timeout)
            self._thread = None
        if cancel_running:
            with self._lock:
                self._cancels.update(self._requests)
                self._cancels.update(r.handle for r in self._inbox)
            with self._step_lock:
                self._take_inbox()

    # ---------------------------------------------------------------------------- inspection
    def stats(self) -> EngineStats:
        """Queues, KV pool and counters now."""
        with self._lock:
            pool, sched = self.pool, self.scheduler
            return EngineStats(
                running=len(sched.running), waiting=len(sched.waiting) + len(self._inbox),
                blocks_total=pool.num_blocks, blocks_used=pool.used, blocks_free=len(pool.free),
                blocks_cached=pool.cached, prompt_tokens=self.prompt_tokens,
                generated_tokens=self.generated_tokens, preemptions=sched.preemptions,
                prefix_hits=sched.prefix_hits, steps=self.steps,
                draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
                speculative_steps=self.speculative_steps,
            )  # fmt: skip

    def audit(self) -> None:
        """Check the KV block books against every live sequence (AssertionError on a leak)."""
        with self._step_lock:
            seqs = [*self.scheduler.running, *self.scheduler.waiting]
            self.pool.audit(s.blocks for s in seqs)
            if self.windowed is not None:
                self.windowed.audit(seqs)
            if self.states is not None:
                self.states.audit(s.state for s in self.scheduler.running)
                if any(s.state is not None for s in self.scheduler.waiting):
                    raise AssertionError("a waiting sequence holds a recurrent state slot")
            if self.drafter is not None:
                self.drafter.audit()
