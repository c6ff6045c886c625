"""The model with attention_backend="triton" runs the real kernel and matches the SDPA backend."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from kiln.model import ModelConfig, Transformer


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_triton_backend_matches_sdpa_forward_and_backward(device, n_kv_head) -> None:
    cfg = ModelConfig(
        vocab_size=97,
        block_size=64,
        n_layer=2,
        n_head=4,
        n_kv_head=n_kv_head,
        n_embd=64,  # head_dim 16
        mlp="swiglu",
        norm="rmsnorm",
        pos_emb="rope",
        bias=False,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    sdpa = Transformer(cfg).to(device)
    triton = Transformer(dataclasses.replace(cfg, attention_backend="triton")).to(device)
    triton.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 37), device=device)  # T not a block multiple
    targets = torch.randint(0, cfg.vocab_size, (2, 37), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to SDPA warns: that would be a failure here
        loss_triton = triton(idx, targets)
        loss_triton.backward()
    loss_sdpa = sdpa(idx, targets)
    loss_sdpa.backward()
    torch.testing.assert_close(loss_triton, loss_sdpa, atol=2e-5, rtol=1e-4)
    for (name, p_t), p_s in zip(triton.named_parameters(), sdpa.parameters(), strict=True):
        torch.testing.assert_close(p_t.grad, p_s.grad, atol=2e-5, rtol=1e-4, msg=name)
