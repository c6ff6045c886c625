"""The Transformer module: shapes, causality, tying, initialisation, loss formulas, backends."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kiln.model.loss
from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer, attention
from kiln.model.attention_maps import attention_maps
from kiln.model.generate import generate
from kiln.model.loss import lm_loss, logits_loss, teacher_topk, topk_lm_loss
from tests.model.helpers import build, gpt2_small, llama_small

FAMILIES = {
    "gpt2": gpt2_small(),
    "llama": llama_small(),
    "llama-mqa-window-qknorm": llama_small(
        n_kv_head=1, sliding_window=5, window_pattern="LG", qk_norm=True
    ),
}


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=FAMILIES.keys())
def test_logits_shape_uses_the_real_vocab(cfg: ModelConfig) -> None:
    cfg = dataclasses.replace(cfg, vocab_multiple=128)
    model = build(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (3, 17)))
    assert cfg.padded_vocab_size == 384
    assert logits.shape == (3, 17, cfg.vocab_size)


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=FAMILIES.keys())
def test_changing_a_future_token_never_changes_earlier_logits(cfg: ModelConfig) -> None:
    model = build(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 24))
    base = model(idx)
    for t in (0, 7, 23):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t])  # the position itself does change


def test_sliding_window_hides_tokens_further_back() -> None:
    cfg = llama_small(n_layer=1, sliding_window=4)
    model = build(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 20))
    changed = idx.clone()
    changed[0, 5] = (changed[0, 5] + 1) % cfg.vocab_size
    a, b = model(idx), model(changed)
    # Position t sees keys t-3..t: position 5 is visible from 5..8 and from nowhere after.
    torch.testing.assert_close(a[0, 9:], b[0, 9:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[0, 8], b[0, 8])
    global_model = build(dataclasses.replace(cfg, window_pattern="G"))
    assert not torch.allclose(global_model(idx)[0, 15], global_model(changed)[0, 15])


def test_tied_head_shares_storage_with_the_embedding() -> None:
    model = Transformer(gpt2_small())
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, 300, (2, 8)), torch.randint(0, 300, (2, 8))).backward()
    opt.step()
    assert torch.equal(model.lm_head.weight, model.wte.weight)
    untied = Transformer(gpt2_small(tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()


def test_materialising_from_meta_keeps_the_head_tied() -> None:
    with torch.device("meta"):
        model = Transformer(llama_small())
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.lm_head.weight is model.wte.weight
    assert sum(p.numel() for p in model.parameters()) == model.cfg.num_params()
    assert torch.isfinite(model(torch.randint(0, 300, (1, 8)))).all()
    # RoPE tables are rebuilt, equal to those of a model built directly.
    torch.testing.assert_close(model.rope_cos, Transformer(llama_small()).rope_cos)


def test_gpt2_initialisation() -> None:
    cfg = gpt2_small(n_layer=8, n_embd=256, vocab_size=5000, vocab_multiple=64)
    model = Transformer(cfg)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif p.dim() == 1:
            assert torch.all(p == 1), name
        elif name.endswith("proj.weight"):
            assert p.std().item() == pytest.approx(resid_std, rel=0.05), name
        else:
            assert p[: cfg.vocab_size].std().item() == pytest.approx(0.02, rel=0.05), name
    assert torch.count_nonzero(model.wte.weight[cfg.vocab_size :]) == 0  # padding rows


def test_vocab_padding_changes_nothing_but_the_matmul_shape() -> None:
    plain = build(gpt2_small())
    padded = Transformer(gpt2_small(vocab_multiple=128)).eval()
    with torch.no_grad():
        for p, q in zip(padded.parameters(), plain.parameters(), strict=True):
            p[: q.size(0)].copy_(q)  # embedding rows 300..383 stay as initialised: zero
    idx, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    torch.testing.assert_close(padded(idx), plain(idx))
    torch.testing.assert_close(padded(idx, targets), plain(idx, targets))


def _reference_loss(
    logits_raw: torch.Tensor, targets: torch.Tensor, softcap: float | None, z_weight: float
) -> torch.Tensor:
    """The loss formula written out plainly over full logits."""
    s = softcap * torch.tanh(logits_raw / softcap) if softcap else logits_raw
    valid = targets >= 0
    lse = torch.logsumexp(s, dim=-1)
    ce = F.cross_entropy(s.reshape(-1, s.size(-1)), targets.reshape(-1), ignore_index=-1)
    return ce + z_weight * lse[valid].square().mean()


def test_z_loss_adds_its_weight_times_mean_squared_logsumexp() -> None:
    base = build(llama_small())
    with_z = Transformer(llama_small(z_loss=1e-2)).eval()
    with_z.load_state_dict(base.state_dict())
    idx, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    logits = base(idx)
    lse = torch.logsumexp(logits, dim=-1)
    ce = F.cross_entropy(logits.reshape(-1, 300), targets.reshape(-1))
    torch.testing.assert_close(base(idx, targets), ce)
    torch.testing.assert_close(with_z(idx, targets), ce + 1e-2 * lse.square().mean())
    assert with_z(idx, targets) > base(idx, targets)


@pytest.mark.parametrize("switches", [{}, {"logit_softcap": 2.0, "z_loss": 1e-2},
                                      {"mup_base_width": 32, "embed_scale": True}])  # fmt: skip
def test_the_models_parts_compose_to_its_forward_and_loss(switches: dict) -> None:
    # a pipeline stage runs these parts (embed, run_blocks, head) and logits_loss on its own
    model = build(llama_small(**switches))
    idx, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    targets[0, :3] = -1  # ignored targets
    pos = torch.arange(16)
    x = model.embed(idx, pos)
    masks = model.attention_masks(pos, 16, None, None)
    x = model.run_blocks(x, model.rope_at(pos), masks, None, 0, 1)
    x = model.run_blocks(x, model.rope_at(pos), masks, None, 1, None)  # the rest, as stage 2
    logits = model.head(x)
    torch.testing.assert_close(logits, model(idx))
    torch.testing.assert_close(logits_loss(logits, targets, model.cfg.z_loss), model(idx, targets))


def test_softcap_bounds_logits_as_c_tanh_of_raw() -> None:
    base = build(gpt2_small())
    capped = Transformer(gpt2_small(logit_softcap=2.0)).eval()
    capped.load_state_dict(base.state_dict())
    idx, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    raw = base(idx)
    assert raw.abs().max() > 2.0  # the cap must actually bite for this test to mean anything
    torch.testing.assert_close(capped(idx), 2.0 * torch.tanh(raw / 2.0))
    assert capped(idx).abs().max() < 2.0
    torch.testing.assert_close(capped(idx, targets), _reference_loss(raw, targets, 2.0, 0.0))


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("z_weight", [0.0, 1e-3])
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_chunked_loss_value_and_gradients_match_the_plain_formula(
    softcap: float | None, z_weight: float, chunk: int | None
) -> None:
    N, C, V, V_pad = 12, 8, 50, 64
    h = torch.randn(N, C, requires_grad=True)
    w = torch.randn(V_pad, C, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    targets[[2, 7]] = -1  # ignored positions
    loss = lm_loss(h, w, targets, V, softcap, z_weight, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad(loss, (h, w))
    h_ref, w_ref = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = _reference_loss(h_ref @ w_ref[:V].T, targets, softcap, z_weight)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h_ref, w_ref))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gh, gh_ref)
    torch.testing.assert_close(gw, gw_ref)
    assert torch.count_nonzero(gw[V:]) == 0  # padding rows get no gradient


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(("chunk", "fits"), [(256, True), (2048, False)])
def test_loss_memory_does_not_scale_with_tokens_times_vocab(chunk: int, fits: bool) -> None:
    N, C, V = 2048, 16, 1000
    h = torch.randn(N, C, requires_grad=True)
    w = torch.randn(V, C, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    with _LargestTensor() as probe:
        lm_loss(h, w, targets, V, softcap=10.0, z_loss=1e-4, chunk_tokens=chunk).backward()
    # With 256-token chunks no tensor holds more than one chunk's logits; the unchunked
    # control shows the probe does see a full (N, V) tensor when there is one.
    assert probe.largest <= chunk * V
    assert (probe.largest < N * V) == fits


@pytest.mark.parametrize(("chunk", "fits"), [(256, True), (2048, False)])
def test_topk_loss_memory_does_not_scale_with_tokens_times_vocab(
    chunk: int, fits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    N, C, V = 2048, 16, 1000
    h = torch.randn(N, C, requires_grad=True)
    w = torch.randn(V, C, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    topk = teacher_topk(torch.randn(N, V), 8, 2.0)  # the teacher's (N, V), outside the probe
    monkeypatch.setattr(kiln.model.loss, "CHUNK_ELEMENTS", chunk * V)
    with _LargestTensor() as probe:
        topk_lm_loss(h, w, V, topk, targets, 2.0, 0.7, 0.3).backward()
    assert probe.largest <= chunk * V
    assert (probe.largest < N * V) == fits


def test_loss_with_no_valid_target_is_zero_not_nan() -> None:
    model = build(gpt2_small())
    loss = model(torch.randint(0, 300, (1, 4)), torch.full((1, 4), -100))
    assert loss.item() == 0.0


def test_loss_under_bf16_autocast_is_close_to_fp32() -> None:
    model = build(llama_small(), seed=1)
    idx, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    ref = model(idx, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, targets)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.kernels
@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=FAMILIES.keys())
def test_math_and_sdpa_backends_agree(cfg: ModelConfig) -> None:
    sdpa = build(cfg)
    math_model = Transformer(dataclasses.replace(cfg, attention_backend="math")).eval()
    math_model.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 20))
    torch.testing.assert_close(math_model(idx), sdpa(idx), rtol=1e-5, atol=1e-5)


def test_attention_maps_are_causal_distributions() -> None:
    cfg = llama_small(sliding_window=3, window_pattern="LG")
    model = build(cfg)
    maps = attention_maps(model, torch.randint(0, 300, (2, 10)))
    assert len(maps) == cfg.n_layer
    for layer, w in enumerate(maps):
        assert w.shape == (2, cfg.n_head, 10, 10)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, cfg.n_head, 10))
        assert torch.all(w.triu(diagonal=1) == 0)
        if cfg.layer_window(layer) == 3:
            assert torch.all(w.tril(diagonal=-3) == 0)
        else:
            assert torch.all(w.tril(diagonal=-3).sum((-1, -2)) > 0)


@pytest.mark.parametrize(
    "cfg",
    [llama_small(), llama_small(attn_sinks=True), llama_small(mla={"kv_rank": 16, "rope_dim": 8})],
    ids=["gqa", "sinks", "mla"],
)
def test_attention_maps_are_the_weights_the_forward_pass_uses(cfg: ModelConfig) -> None:
    # The maps are recomputed from each layer's inputs: weights · v through the output projection
    # must give exactly what the (SDPA) layer returned in the forward pass.
    model = build(cfg)
    idx = torch.randint(0, 300, (2, 10))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    attn = model.blocks[1].attn
    handle = attn.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    maps = attention_maps(model, idx)
    handle.remove()
    (x, out), weights = seen[0], maps[1]
    _, _, v = attn.heads(x, (model.rope_cos[:10], model.rope_sin[:10]))
    v = v.repeat_interleave(weights.size(1) // v.size(1), dim=1)  # (B, H, T, D)
    y = (weights @ v).transpose(1, 2).reshape(2, 10, -1)
    torch.testing.assert_close(attn.proj(y), out, rtol=1e-5, atol=1e-5)
    assert not model.blocks[0].attn._forward_pre_hooks  # the hooks are gone afterwards


def test_triton_backend_falls_back_to_sdpa_with_a_warning(monkeypatch) -> None:
    def declining_kernel(q, k, v, causal=True, scale=None):
        # What kiln.kernels does for CPU tensors outside Triton's interpreter.
        raise ValueError("flash_attention: q is on cpu, the Triton kernels need CUDA tensors")

    monkeypatch.setattr(attention, "_flash_attention", lambda: declining_kernel)
    sdpa = build(llama_small())
    triton = Transformer(llama_small(attention_backend="triton")).eval()
    triton.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 300, (1, 12))
    with pytest.warns(RuntimeWarning, match="using SDPA"):
        out = triton(idx)
    torch.testing.assert_close(out, sdpa(idx))


def test_triton_backend_without_kiln_kernels_warns(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_kernels(name, *args, **kwargs):
        if name == "kiln.kernels":
            raise ImportError("simulated: no triton")
        return real_import(name, *args, **kwargs)

    attention._flash_attention.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_kernels)
    try:
        with pytest.warns(RuntimeWarning, match="kiln.kernels is unavailable"):
            assert attention._flash_attention() is None
    finally:
        attention._flash_attention.cache_clear()


def test_triton_backend_hands_causal_attention_to_the_kernel(monkeypatch) -> None:
    calls: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []

    def fake_kernel(q, k, v, causal=True, scale=None):
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        return attention.sdpa_attention(q, k, v, None)

    monkeypatch.setattr(attention, "_flash_attention", lambda: fake_kernel)
    cfg = llama_small()  # 4 query heads, 2 kv heads, head_dim 16
    sdpa = build(cfg)
    triton = Transformer(dataclasses.replace(cfg, attention_backend="triton")).eval()
    triton.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 300, (1, 12))
    torch.testing.assert_close(triton(idx), sdpa(idx))
    assert calls == [((1, 4, 12, 16), (1, 2, 12, 16), True)] * cfg.n_layer  # K/V not repeated
    calls.clear()
    generate(triton, [idx[0].tolist()], 3, temperature=0)
    assert len(calls) == cfg.n_layer  # the prefill only: decode steps against the cache use SDPA


@pytest.mark.kernels
def test_dropout_only_in_training_mode() -> None:
    model = Transformer(gpt2_small(dropout=0.5))
    idx = torch.randint(0, 300, (1, 8))
    model.train()
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_too_long_input_is_a_clear_error() -> None:
    model = Transformer(gpt2_small(block_size=8))
    with pytest.raises(KilnError, match="longer than block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_training_reduces_the_loss() -> None:
    cfg = llama_small(n_layer=1)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, cfg.vocab_size, (4, 16))
    first = None
    for _ in range(20):
        loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
