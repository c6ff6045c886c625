"""Autoregressive generation: prefill into a preallocated KV cache, then one-token decode steps.

Prompts of different lengths are left-padded into one batch; each row's positions start at its
first real token and its padding is masked out of attention, so a row decodes exactly as it
would alone. Greedy decoding (temperature 0) gives the tokens of repeated full forward passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.kv_cache import AttentionCache, KVCache
from kiln.model.transformer import Transformer


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from logits (B, V): greedy at temperature 0, else top-k/top-p sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def filter_logits(
    logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """fp32 logits (B, V) / temperature (> 0), -inf outside the top-k and the top-p nucleus."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = probs.cumsum(dim=-1) - probs > top_p  # (B, V); the top token is never dropped
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def decode_step(model: Transformer, tokens: Tensor, cache: AttentionCache) -> Tensor:
    """Logits (B, V) of the next token after feeding tokens (B, T) on top of the cache."""
    return model.logits(model.hidden(tokens, cache)[:, -1])


@torch.inference_mode()
def generate_steps(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] = (),
    compile: bool = False,
) -> Iterator[list[int | None]]:
    """Yield, per decode step, each row's new token (None once the row has hit a stop token).

    A stop token ends its row and is not yielded. Uses the model as it is (call `eval()` first).
    """
    check_prompts(model.cfg, prompts, max_new_tokens, top_k, top_p, temperature)
    param = next(model.parameters())
    device = param.device
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
    first_valid = None
    if min(lengths) != width:
        first_valid = torch.tensor([width - n for n in lengths], device=device)
    cache = KVCache(
        model.cfg, len(prompts), width + max_new_tokens, device=device, dtype=param.dtype,
        first_valid=first_valid,
    )  # fmt: skip
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    step: Callable[[Transformer, Tensor, AttentionCache], Tensor] = decode_step
    if compile:
        step = torch.compile(decode_step, dynamic=True)
    stop = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)

    logits = decode_step(model, batch.to(device), cache)  # prefill: (B, V)
    for i in range(max_new_tokens):
        tokens = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
        done |= torch.isin(tokens, stop)
        yield [None if d else t for t, d in zip(tokens.tolist(), done.tolist(), strict=True)]
        if i == max_new_tokens - 1 or bool(done.all()):
            return
        logits = step(model, tokens[:, None], cache)


def generate(
    model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kwargs: object
) -> list[list[int]]:
    """New tokens for each prompt (batched; see `generate_steps` for the options)."""
    out: list[list[int]] = [[] for _ in prompts]
    for step_tokens in generate_steps(model, prompts, max_new_tokens, **kwargs):  # type: ignore[arg-type]
        for row, token in enumerate(step_tokens):
            if token is not None:
                out[row].append(token)
    return out


def stream(
    model: Transformer, prompt: Sequence[int], max_new_tokens: int, **kwargs: object
) -> Iterator[int]:
    """Yield one prompt's new tokens as they are decoded (for printing as they come)."""
    for (token,) in generate_steps(model, [prompt], max_new_tokens, **kwargs):  # type: ignore[arg-type]
        if token is None:
            return
        yield token


def check_prompts(
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    top_k: int | None,
    top_p: float | None,
    temperature: float,
) -> None:
    """Clear errors for requests the model cannot serve."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise KilnError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise KilnError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise KilnError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > cfg.block_size:
        raise KilnError(
            f"prompt + max_new_tokens = {longest} tokens exceeds the model's block_size "
            f"{cfg.block_size}"
        )
    if temperature < 0:
        raise KilnError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise KilnError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise KilnError(f"top_p must be in (0, 1], got {top_p}")
