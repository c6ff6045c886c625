"""Parameter groups: which parameters are decayed, and the Muon split."""

from __future__ import annotations

import copy

import torch

from kiln.model import ModelConfig, Transformer
from kiln.train.config import OptimConfig
from kiln.train.optim import build_optimizer, set_lr, split_parameters

CPU = torch.device("cpu")


def _names(group: dict) -> set[str]:
    return set(group["names"])


def test_adamw_decays_matrices_only_and_the_tied_embedding_not() -> None:
    model = Transformer(ModelConfig.preset("tiny"))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), CPU)
    (adamw,) = opt.optimizers
    decayed, undecayed = adamw.param_groups
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0
    params = dict(model.named_parameters())
    assert _names(decayed) == {n for n, p in params.items() if p.dim() == 2 and n != "wte.weight"}
    assert "blocks.0.attn.qkv.weight" in _names(decayed) or any(
        "attn" in n for n in _names(decayed)
    )
    assert "wte.weight" in _names(undecayed)  # the embedding (and the tied head) is not decayed
    assert all(params[n].dim() == 1 or n == "wte.weight" for n in _names(undecayed))
    assert _names(decayed) | _names(undecayed) == set(params)  # every parameter, once
    assert adamw.defaults["fused"] is True


def test_untied_head_and_learned_positions_and_biases() -> None:
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16,
                      tie_embeddings=False)  # fmt: skip
    model = Transformer(cfg)
    roles = split_parameters(model)
    assert [n for n, _ in roles["embedding"]] == ["wte.weight", "wpe.weight"]
    assert [n for n, _ in roles["head"]] == ["lm_head.weight"]
    assert all(n.endswith(("bias", "weight")) and p.dim() == 1 for n, p in roles["vector"])
    assert any(n.endswith("bias") for n, _ in roles["vector"])
    decayed, undecayed = build_optimizer(model, OptimConfig(), CPU).param_groups
    assert "lm_head.weight" in _names(decayed)
    assert {"wte.weight", "wpe.weight"} <= _names(undecayed)
    assert not any(n.endswith("bias") for n in _names(decayed))


def test_muon_takes_hidden_matrices_and_adamw_the_rest() -> None:
    model = Transformer(ModelConfig.preset("tiny", tie_embeddings=False))
    opt = build_optimizer(model, OptimConfig(name="muon", lr=1e-3), CPU)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    hidden = {n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")}
    assert _names(muon.param_groups[0]) == hidden
    rest = set().union(*(_names(g) for g in adamw.param_groups))
    assert rest == set(dict(model.named_parameters())) - hidden
    assert set_lr(opt, 0.5) == 5e-4
    assert all(g["lr"] == 5e-4 for g in opt.param_groups)
    x = torch.randint(0, 512, (2, 8))
    model(x, x).backward()
    opt.step()  # both optimizers update
    state = copy.deepcopy(opt.state_dict())  # a snapshot: state_dict() returns live tensors
    again = build_optimizer(model, OptimConfig(name="muon", lr=1e-3), CPU)
    again.load_state_dict(copy.deepcopy(state))
    restored = again.state_dict()
    for saved, loaded in zip(state["optimizers"], restored["optimizers"], strict=True):
        assert saved["state"].keys() == loaded["state"].keys() and saved["state"]
        for key, values in saved["state"].items():  # every buffer's values, not just its name
            assert values.keys() == loaded["state"][key].keys()
            for name, value in values.items():
                assert torch.equal(
                    torch.as_tensor(value), torch.as_tensor(loaded["state"][key][name])
                )
    # Restored state steps alike: the next update equals that of the optimizer it came from.
    opt.zero_grad(set_to_none=True)
    twin = copy.deepcopy(model)
    again_twin = build_optimizer(twin, OptimConfig(name="muon", lr=1e-3), CPU)
    again_twin.load_state_dict(copy.deepcopy(state))
    for m, o in ((model, opt), (twin, again_twin)):
        m(x, x).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), name
