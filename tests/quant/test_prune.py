"""Structured pruning (kiln/quant/prune.py): dead units are the ones ranked last and removing them
leaves the logits unchanged; configs and parameter counts of the smaller model; refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer
from kiln.quant.prune import (
    Importance,
    PruneTargets,
    kept_heads,
    measure_importance,
    prune_model,
)

LLAMA = ModelConfig.preset("tiny", vocab_size=97, block_size=32, n_layer=3, d_ff=48)
GPT2 = ModelConfig(vocab_size=97, block_size=32, n_layer=3, n_head=4, n_kv_head=2, n_embd=32)


def _batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(3)]


def _kill(model: Transformer, group: int, channels: slice, block: int) -> None:
    """Make one KV group, some MLP channels of every layer and one whole block contribute nothing."""
    cfg = model.cfg
    H, Hkv, D, F = cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.ff_size
    v = slice((H + Hkv) * D + group * D, (H + Hkv) * D + (group + 1) * D)
    with torch.no_grad():
        for b in model.blocks:
            for rows in (b.attn.qkv.weight, b.attn.qkv.bias):
                if rows is not None:
                    rows[v] = 0  # the group's values are 0, so are its heads' outputs
            fc = b.mlp.fc
            for rows in (fc.weight, fc.bias):
                if rows is not None:
                    rows[channels] = 0  # gate (SwiGLU) or input (GELU) 0: activation 0
        dead = model.blocks[block]
        for lin in (dead.attn.proj, dead.mlp.proj):
            lin.weight.zero_()
            if lin.bias is not None:
                lin.bias.zero_()
    assert channels.stop < F


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_pruning_dead_heads_channels_and_a_block_leaves_the_logits_unchanged(
    cfg: ModelConfig,
) -> None:
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    _kill(model, group=1, channels=slice(4, 20), block=1)
    imp = measure_importance(model, _batches(cfg.vocab_size))
    assert int(imp.blocks.argmin()) == 1 and float(imp.blocks[1]) == pytest.approx(0, abs=1e-6)
    targets = PruneTargets(n_layer=2, n_kv_head=1, n_head=2, d_ff=cfg.ff_size - 16)
    pruned = prune_model(model, imp, targets)
    new = pruned.cfg
    assert (new.n_layer, new.n_head, new.kv_heads, new.ff_size) == (2, 2, 1, cfg.ff_size - 16)
    assert new.head_size == cfg.head_size and new.n_embd == cfg.n_embd
    n = sum(p.numel() for p in pruned.parameters())
    assert n == new.num_params() < cfg.num_params()
    x = _batches(cfg.vocab_size)[0]
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), model(x), rtol=0, atol=1e-5)
    # and a round trip through the config: the smaller model is an ordinary ModelConfig
    assert ModelConfig.from_dict(new.to_dict()) == new


def test_the_embedding_channels_kept_are_the_active_ones() -> None:
    torch.manual_seed(0)
    model = Transformer(LLAMA).eval()
    dead = [3, 17, 40]
    with torch.no_grad():  # nothing ever writes these channels of the residual stream
        model.wte.weight[:, dead] = 0
        for b in model.blocks:
            b.attn.proj.weight[dead] = 0
            b.mlp.proj.weight[dead] = 0
    imp = measure_importance(model, _batches(LLAMA.vocab_size))
    pruned = prune_model(model, imp, PruneTargets(n_embd=LLAMA.n_embd - 3))
    kept = [c for c in range(LLAMA.n_embd) if c not in dead]
    torch.testing.assert_close(pruned.wte.weight, model.wte.weight[:, kept])
    torch.testing.assert_close(
        pruned.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight[:, kept]
    )
    assert pruned.lm_head.weight is pruned.wte.weight  # still tied
    assert pruned.cfg.n_embd == 61 and pruned.cfg.num_params() == sum(
        p.numel() for p in pruned.parameters()
    )


def test_gqa_groups_stay_whole_and_each_keeps_its_best_query_heads() -> None:
    scores = torch.tensor([0.1, 0.9, 0.2, 0.3, 5.0, 0.0, 0.4, 0.05])  # 2 groups of 4 heads
    q, kv = kept_heads(scores, n_kv=2, n_head=4, groups=2)
    assert kv.tolist() == [0, 1] and q.tolist() == [1, 3, 4, 6]
    q, kv = kept_heads(scores, n_kv=1, n_head=2, groups=2)
    assert kv.tolist() == [1] and q.tolist() == [4, 6]  # group 1's sum is 5.45 > 1.5


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (PruneTargets(n_head=3), "--n-head 3 must be a multiple of --n-kv-head 2"),
        (PruneTargets(n_layer=9), "--n-layer 9: must be between 1 and the model's 3"),
        (PruneTargets(n_head=4, n_kv_head=1), "needs 4 query heads per group"),
    ],
)
def test_impossible_targets_are_refused_naming_the_flag(
    targets: PruneTargets, message: str
) -> None:
    model = Transformer(LLAMA).eval()
    imp = measure_importance(model, _batches(LLAMA.vocab_size)[:1])
    with pytest.raises(KilnError, match=message):
        prune_model(model, imp, targets)


def test_mixture_of_experts_is_refused_by_name() -> None:
    from kiln.model.config import MoEConfig

    cfg = dataclasses.replace(LLAMA, moe=MoEConfig(n_experts=2, top_k=1))
    model = Transformer(cfg).eval()
    with pytest.raises(KilnError, match=r"model\.moe"):
        prune_model(model, uniform_importance(cfg), PruneTargets(d_ff=8))


def uniform_importance(cfg: ModelConfig) -> Importance:
    """Every unit equally important (the scores do not matter for a refusal)."""
    L, H, C, F = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.ff_size
    return Importance([torch.ones(H)] * L, [torch.ones(F)] * L, torch.ones(C), torch.ones(L))
