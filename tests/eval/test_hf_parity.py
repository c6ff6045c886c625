"""A kiln model and the same weights exported to `transformers` give the same task scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.eval.multiple_choice import evaluate_task
from kiln.eval.scoring import Scorer, encode_pair
from kiln.eval.tasks import load_task
from kiln.model import ModelConfig
from kiln.model.hf import to_hf
from kiln.tokenizer import Tokenizer

from .conftest import EOT, random_model, random_tiny

# GPT-2's architecture (learned positions, LayerNorm, GELU, biases) at the tiny preset's size.
GPT2_TINY = ModelConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=64)


def hf_choice_logprob(
    hf_model: torch.nn.Module, block: int, context: list[int], continuation: list[int]
) -> float:
    """The continuation's log-prob from one unpadded `transformers` forward, context cut left."""
    tokens = [*context, *continuation][-(block + 1) :]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([tokens[:-1]])).logits[0].double()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return float(logp[-len(continuation) :].sum())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_task_scores_match_transformers(shared_data: Path, tok: Tokenizer, family: str) -> None:
    model = random_tiny() if family == "llama" else random_model(GPT2_TINY)
    hf_model = to_hf(model)
    eot = tok.special_tokens[EOT]
    scorer = Scorer(model, batch_size=5, progress=False)
    for name in ("hellaswag", "winogrande"):
        task = load_task(name, shared_data / "eval", limit=6)
        result = evaluate_task(task, scorer, tok, eot)
        hf_scores = [
            [
                hf_choice_logprob(hf_model, 128, *encode_pair(tok, c.context, c.continuation, eot))
                for c in item.choices
            ]
            for item in task.items
        ]
        for ours, theirs in zip(result.choice_logprobs, hf_scores, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-4)
        hf_acc = sum(
            max(range(len(s)), key=s.__getitem__) == item.gold
            for s, item in zip(hf_scores, task.items, strict=True)
        ) / len(task.items)
        assert result.metrics["acc"] == hf_acc
        # The choices differ in score by far more than the tolerance, so argmaxes are stable.
        assert min(abs(a - b) for s in hf_scores for a in s for b in s if a != b) > 1e-3
