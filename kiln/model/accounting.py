"""Parameter, FLOP and memory accounting of a ModelConfig, without building the model.

The one place these are counted: `ModelConfig.num_params`, `.param_breakdown` and
`.flops_per_token` call the functions here, `Transformer` checks the count against the module at
start-up, the trainer's MFU divides by `flops_per_token`, and the memory pre-flight and
`kiln scaling account` / `plan` build on the memory estimate. Conventions:

- A multiply-add is 2 FLOPs. Only matrix multiplies are counted (linear layers, the head, and
  attention's two T-dependent products q·kᵀ and p·v); norms, activations, softmax and RoPE are
  elementwise and left out, as in Kaplan et al. (2020) and the PaLM MFU convention.
- Attention is counted over the full T×T score matrix ("non-causal"): 2·2·L·H·head_dim·T
  forward FLOPs per token. That is what `flops_per_token` and kiln's MFU use, so
  figures compare with nanoGPT and PaLM. `causal=True` counts only the keys a query sees,
  (T+1)/2 on average (fewer under a sliding window): the work a causal kernel actually does.
- Recurrent mixers (Mamba-2, Gated DeltaNet, `layer_pattern`) count the matmuls of their
  chunked training form per token (`recurrent_mixing_flops`), which depend on the chunk length
  but not on T, plus their depthwise conv; their projections are matmul parameters as usual.
- Backward = 2 × forward (gradients with respect to the inputs and the weights).
- The "6N" approximation uses N = all parameters (embeddings included), as in Hoffmann et al.
  (2022); the exact count uses the matmul parameters (the head, not the embedding lookup).

Memory follows the usual breakdown (ZeRO, Rajbhandari et al. 2020): weights, gradients,
optimizer state, an fp32 master copy when the weights are kept in 16 bits, and activations as
in Korthikanti et al. (2022), re-derived for kiln's block (see `layer_activation_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.errors import KilnError

if TYPE_CHECKING:  # config.py calls into this module, so the type is only named here
    from kiln.model.config import ModelConfig

# ---- parameters --------------------------------------------------------------------------------

PARAM_COMPONENTS = ("embeddings", "attention", "mlp", "norms", "head")


def param_breakdown(cfg: ModelConfig, active: bool = False) -> dict[str, int]:
    """Parameters of the module by component (PARAM_COMPONENTS); a tied head counts 0.

    The one parameter count: `num_params` is its sum, `kiln scaling account` prints it, and
    `Transformer` checks it against the instantiated module. With `active`, a MoE layer
    counts only the top_k routed experts a token uses (plus router and shared experts).
    """
    d, L = cfg.n_embd, cfg.n_layer
    norm_scale = (2 if cfg.norm == "layernorm" and cfg.bias else 1) * cfg.norm_scale
    qk_norms = 2 * norm_scale * cfg.head_size if cfg.qk_norm else 0
    attn_norms = qk_norms
    final_norm = 0 if cfg.norm_placement == "post" else norm_scale * d  # post: blocks end normed
    if cfg.mla is not None:  # the latent RMSNorms (weight only)
        attn_norms += cfg.mla.kv_rank + (cfg.mla.q_rank or 0)
    sinks = cfg.n_head if cfg.attn_sinks else 0
    mixers, norms = 0, L * cfg.norms_per_block * norm_scale * d + final_norm
    for i in range(L):  # a recurrent mixer's gated RMSNorm counts as a norm, as q/k norms do
        kind = cfg.layer_mixer(i)
        if kind == "attention":
            mixers, norms = mixers + attention_params(cfg, cfg.bias) + sinks, norms + attn_norms
        else:
            mixers += recurrent_params(cfg, kind, cfg.bias)
            norms += cfg.mamba_inner if kind == "mamba2" else cfg.delta_head_dim
    return {
        "embeddings": cfg.padded_vocab_size * d
        + (cfg.block_size * d if cfg.pos_emb == "learned" else 0),
        "attention": mixers,  # the sequence mixers: attention, or Mamba-2 / Gated DeltaNet
        "mlp": sum(layer_mlp_params(cfg, i, cfg.bias, active) for i in range(L)),
        "norms": norms,  # every block's norms (+ q/k or gated mixer norms), the final one
        "head": 0 if cfg.tie_embeddings else cfg.padded_vocab_size * d,
    }


def recurrent_widths(cfg: ModelConfig, kind: str) -> tuple[int, int, int]:
    """(input projection width, conv channels, output projection input) of one recurrent mixer."""
    s = cfg.ssm
    if kind == "mamba2":
        conv = cfg.mamba_inner + 2 * s.n_groups * s.state_size
        return cfg.mamba_inner + conv + cfg.mamba_heads, conv, cfg.mamba_inner
    width = cfg.delta_heads * cfg.delta_head_dim
    return 4 * width + 2 * cfg.delta_heads, 3 * width, width


def recurrent_params(cfg: ModelConfig, kind: str, bias: bool, matmul_only: bool = False) -> int:
    """One Mamba-2 or Gated DeltaNet mixer without its gated norm (see kiln/model/ssm.py).

    Mamba-2: in/out projections, conv taps and biases, Δ bias, A and D per head. Gated
    DeltaNet: the same without conv biases or D. `matmul_only`: the two projections' weights.
    """
    d, (w_in, conv, w_out) = cfg.n_embd, recurrent_widths(cfg, kind)
    weights = d * w_in + w_out * d
    if matmul_only:
        return weights
    heads = cfg.mamba_heads if kind == "mamba2" else cfg.delta_heads
    extra = conv * cfg.ssm.conv_kernel + (conv + 3 * heads if kind == "mamba2" else 2 * heads)
    return weights + extra + (w_in + d if bias else 0)


def layer_mixer_matmul_params(cfg: ModelConfig, layer: int) -> int:
    """Matmul weights of one layer's sequence mixer (attention or recurrent)."""
    kind = cfg.layer_mixer(layer)
    if kind == "attention":
        return attention_params(cfg, bias=False)
    return recurrent_params(cfg, kind, bias=False, matmul_only=True)


def recurrent_mixing_flops(cfg: ModelConfig, layer: int, seq_len: int) -> int:
    """Forward FLOPs per token of a recurrent mixer's chunked form, outside its projections.

    With chunk length L = min(chunk_size, T) and the conv's 2·channels·K. Mamba-2 (H heads of
    P, state N, G groups): C·Bᵀ 2LNG, the masked product with x 2LHP, state in and out 4HPN.
    Gated DeltaNet (per head, Dk = Dv = D): β·K·Kᵀ, Q·Kᵀ, the UT products on K and V, the
    scores on V' 2L·5D, and W·S, Q·S, Kᵀ·V' 6D²; its L×L triangular solve per chunk (L²/2
    multiply-adds per token and head) is not a matmul and, as FlopCounterMode, is left out.
    A sequence shorter than a multiple of L is padded, which this per-token figure ignores.
    """
    kind, s = cfg.layer_mixer(layer), cfg.ssm
    L = min(s.chunk_size, seq_len)
    conv = 2 * recurrent_widths(cfg, kind)[1] * s.conv_kernel
    if kind == "mamba2":
        H, P, N = cfg.mamba_heads, s.head_dim, s.state_size
        return conv + 2 * L * N * s.n_groups + 2 * L * H * P + 4 * H * P * N
    H, D = cfg.delta_heads, cfg.delta_head_dim
    return conv + H * (10 * L * D + 6 * D * D)


def num_params(cfg: ModelConfig) -> int:
    """Parameters of the module (a tied head counted once; padded vocab rows included)."""
    return sum(param_breakdown(cfg).values())


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses: `num_params` less the routed experts it is not sent to."""
    return sum(param_breakdown(cfg, active=True).values())


def num_matmul_params(cfg: ModelConfig) -> int:
    """Weights used in a matrix multiply per token: every block's linear layers and the head.

    For MoE layers these are the active ones: router, top_k routed experts, shared experts.
    """
    layers = sum(
        layer_mixer_matmul_params(cfg, i) + layer_mlp_params(cfg, i, False, active=True)
        for i in range(cfg.n_layer)
    )
    return layers + cfg.padded_vocab_size * cfg.n_embd


def non_embedding_params(cfg: ModelConfig) -> int:
    """Parameters outside the token and position embeddings (Kaplan et al.'s N)."""
    return num_params(cfg) - param_breakdown(cfg)["embeddings"]


def attention_params(cfg: ModelConfig, bias: bool) -> int:
    """One block's QKV and output projections (with their biases if `bias`)."""
    if cfg.mla is not None:
        return mla_params(cfg, bias)
    d, q_out, kv_out = cfg.n_embd, cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    weights = d * (q_out + 2 * kv_out) + q_out * d
    return weights + (q_out + 2 * kv_out + d if bias else 0)


def mla_params(cfg: ModelConfig, bias: bool) -> int:
    """One MLA block's projections; biases (as DeepSeek's) on the down-projections and output."""
    assert cfg.mla is not None
    d, H, m = cfg.n_embd, cfg.n_head, cfg.mla
    qk, v, nope = cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_head_dim - m.rope_dim
    if m.q_rank is None:
        q = d * H * qk
    else:
        q = d * m.q_rank + m.q_rank * H * qk + (m.q_rank if bias else 0)
    kv = d * (m.kv_rank + m.rope_dim) + m.kv_rank * H * (nope + v)
    out = H * v * d
    return q + kv + out + ((m.kv_rank + m.rope_dim + d) if bias else 0)


def mlp_params(cfg: ModelConfig, bias: bool, ff: int | None = None) -> int:
    """One block's MLP: fused gate+up (SwiGLU) or fc, then proj (with their biases if `bias`)."""
    d, ff = cfg.n_embd, ff or cfg.ff_size
    n_in = 2 if cfg.gated else 1
    return (n_in + 1) * d * ff + (n_in * ff + d if bias else 0)


def layer_mlp_params(cfg: ModelConfig, layer: int, bias: bool, active: bool = False) -> int:
    """One layer's MLP: dense, or router + routed experts (all, or top_k) + shared experts."""
    if cfg.moe is None or not cfg.is_moe_layer(layer):
        return mlp_params(cfg, bias) if cfg.has_mlp else 0
    m, d, fe = cfg.moe, cfg.n_embd, cfg.expert_size
    expert = (3 if cfg.gated else 2) * d * fe  # experts have no biases
    shared = mlp_params(cfg, bias, m.n_shared * fe) if m.n_shared else 0
    return d * m.n_experts + (m.top_k if active else m.n_experts) * expert + shared


# ---- FLOPs -------------------------------------------------------------------------------------


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6·N_matmul + 6·L·H·(d_qk + d_v)·T.

    N_matmul counts active weights only (MoE). The attention term counts the full T×T score
    matrix (the PaLM / nanoGPT convention, no causal or window discount), so MFU figures
    compare across implementations; with d_qk = d_v = head_dim it is 12·L·H·head_dim·T.
    """
    attn = 6 * attention_layers(cfg) * cfg.n_head * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len
    return 6 * num_matmul_params(cfg) + attn + 3 * recurrent_flops(cfg, seq_len)


def attention_layers(cfg: ModelConfig) -> int:
    """Layers whose mixer is attention (all of them unless `layer_pattern` says otherwise)."""
    return sum(cfg.layer_mixer(i) == "attention" for i in range(cfg.n_layer))


def recurrent_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Forward mixing FLOPs per token of every recurrent layer (`recurrent_mixing_flops`)."""
    return sum(
        recurrent_mixing_flops(cfg, i, seq_len)
        for i in range(cfg.n_layer)
        if cfg.layer_mixer(i) != "attention"
    )


@dataclass(frozen=True)
class FlopCount:
    """FLOPs per token of one training step, by part, for sequences of `seq_len` tokens."""

    seq_len: int
    causal: bool
    forward_matmul: int  # 2 · N_matmul
    forward_attention: float  # q·kᵀ and p·v: 4·L·H·head_dim · (keys per query)
    six_n: int  # the 6N approximation, N = all parameters
    forward_recurrent: int = 0  # recurrent mixers' chunked-form products and convs

    @property
    def forward(self) -> float:
        """Forward FLOPs per token."""
        return self.forward_matmul + self.forward_attention + self.forward_recurrent

    @property
    def backward(self) -> float:
        """Backward FLOPs per token (2 × forward)."""
        return 2 * self.forward

    @property
    def total(self) -> float:
        """Training FLOPs per token (forward + backward)."""
        return 3 * self.forward


def mean_keys_per_query(cfg: ModelConfig, seq_len: int, causal: bool) -> float:
    """Keys each query scores, averaged over positions and attention layers."""
    if not causal:
        return float(seq_len)
    total = 0
    layers = [i for i in range(cfg.n_layer) if cfg.layer_mixer(i) == "attention"]
    for layer in layers:
        w = cfg.layer_window(layer)
        if w is None or w >= seq_len:
            total += seq_len * (seq_len + 1) // 2
        else:  # positions before w see t+1 keys, the rest see w
            total += w * (w + 1) // 2 + (seq_len - w) * w
    return total / (max(len(layers), 1) * seq_len)


def flop_count(cfg: ModelConfig, seq_len: int, causal: bool = False) -> FlopCount:
    """FLOPs per token; with causal=False, `total` equals `flops_per_token(cfg, seq_len)`."""
    if seq_len < 1:
        raise KilnError(f"seq_len must be >= 1, got {seq_len}")
    keys = mean_keys_per_query(cfg, seq_len, causal)
    attn = 2 * attention_layers(cfg) * cfg.n_head * (cfg.qk_head_dim + cfg.v_head_dim) * keys
    return FlopCount(
        seq_len, causal, 2 * num_matmul_params(cfg), attn, 6 * num_active_params(cfg),
        recurrent_flops(cfg, seq_len),
    )  # fmt: skip


# ---- memory ------------------------------------------------------------------------------------

# Bytes per parameter for (weights, gradients, fp32 master copy). "amp-bf16" is what kiln's
# trainer does (fp32 weights, bf16 autocast for matmuls); "bf16" keeps 16-bit weights and
# gradients with an fp32 master copy in the optimizer (Megatron / ZeRO mixed precision).
PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 0),
    "amp-bf16": (4, 4, 0),
    "bf16": (2, 2, 4),
}
OPTIMIZERS = ("adamw", "muon", "sgd")


@dataclass(frozen=True)
class MemoryEstimate:
    """Training memory in bytes, by part, for one process holding the whole model."""

    weights: int
    gradients: int
    master_weights: int
    optimizer: int
    activations: int
    activation_checkpointing: bool

    @property
    def states(self) -> int:
        """Everything but the activations (what ZeRO/FSDP shard)."""
        return self.weights + self.gradients + self.master_weights + self.optimizer

    @property
    def total(self) -> int:
        """Every part together."""
        return self.states + self.activations


def optimizer_state_bytes(cfg: ModelConfig, optimizer: str = "adamw") -> int:
    """Optimizer state bytes, as torch keeps it (fp32 parameters).

    AdamW: two fp32 moments per parameter plus a 4-byte step counter per parameter tensor.
    Muon (kiln's optimizer set): a momentum buffer per hidden matrix; AdamW for the rest.
    """
    if optimizer not in OPTIMIZERS:
        raise KilnError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if optimizer == "sgd":
        return 0
    n, tensors = num_params(cfg), param_tensor_count(cfg)
    if optimizer == "adamw":
        return 8 * n + 4 * tensors
    hidden = num_matmul_params(cfg) - cfg.padded_vocab_size * cfg.n_embd
    hidden_tensors = cfg.n_layer * _linears_per_layer(cfg)  # qkv, attn proj, mlp fc, mlp proj
    return 4 * hidden + 8 * (n - hidden) + 4 * (tensors - hidden_tensors)


def _linears_per_layer(cfg: ModelConfig) -> int:
    """Linear layers in one dense block: 4, or 3 when a parallel block fuses qkv and the MLP input."""
    return 3 if cfg.fused_input else 4


def param_tensor_count(cfg: ModelConfig) -> int:
    """Number of distinct parameter tensors (a tied head is the embedding's own)."""
    norm_scale = (2 if cfg.norm == "layernorm" and cfg.bias else 1) * cfg.norm_scale
    linears = _linears_per_layer(cfg) * (2 if cfg.bias else 1)
    qk_norms = 2 * norm_scale if cfg.qk_norm else 0
    per_layer = linears + cfg.norms_per_block * norm_scale + qk_norms
    final_norm = 0 if cfg.norm_placement == "post" else norm_scale
    outside = 1 + (cfg.pos_emb == "learned") + (not cfg.tie_embeddings) + final_norm
    return cfg.n_layer * per_layer + outside


def _norm_bytes(cfg: ModelConfig, precision: str) -> int:
    """Bytes one norm saves per token: RMSNorm upcasts, so its input and output are fp32."""
    if cfg.norm == "rmsnorm":
        return 2 * cfg.n_embd * 4 + 4  # fp32 input and normalised input, rstd
    return cfg.n_embd * (2 if precision == "bf16" else 4) + 2 * 4  # input, mean and rstd


def layer_activation_bytes(
    cfg: ModelConfig, precision: str = "amp-bf16", layer: int | None = None
) -> int:
    """Bytes one block saves for backward, per token, with a fused attention kernel, no dropout.

    An attention block unless `layer` names a Mamba-2 / Gated DeltaNet layer: then the mixer's
    part is `recurrent_activation_bytes` instead (the norms and the MLP stay).

    Counted from what autograd keeps in kiln's block (the test measures it with saved-tensor
    hooks): the two norms (see `_norm_bytes`); the qkv and MLP inputs, d each; the qkv output,
    q_out + 2·kv_out, kept whole because v is a view of it; the rotated q and k with RoPE,
    q_out + kv_out; the attention output, q_out (the projection's input is a view of it) and
    its log-sum-exp, H fp32 values; the MLP hidden, 4·F for SwiGLU (gate‖up, silu(gate), the
    product) or 2·F for GELU. Matmul-side tensors are 16-bit under autocast, the residual side
    stays fp32. Korthikanti et al. (2022) count the same tensors for GPT-3 (34·s·b·h bytes per
    layer with dropout masks, which kiln does not have, plus 5·a·s²·b for a materialised
    softmax, which a fused kernel does not keep). With qk_norm see `_qk_norm_bytes`.
    """
    act = 4 if precision == "fp32" else 2
    d, ff, n_head = cfg.n_embd, cfg.ff_size, cfg.n_head
    if layer is not None and cfg.layer_mixer(layer) != "attention":
        mlp = (d + (4 * ff if cfg.gated else ff if cfg.mlp == "relu" else 2 * ff)) * act
        norms = cfg.norms_per_block * _norm_bytes(cfg, precision)
        return norms + (mlp if cfg.has_mlp else 0) + recurrent_activation_bytes(cfg, layer)
    q_out, kv_out = n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    elements = 2 * d + (q_out + 2 * kv_out) + q_out
    elements += q_out + kv_out if cfg.pos_emb == "rope" else 0
    # gated: gate, up, act(gate), product; ReLU's output is also proj's input; else input + output
    elements += 4 * ff if cfg.gated else ff if cfg.mlp == "relu" else 2 * ff
    return 2 * _norm_bytes(cfg, precision) + elements * act + 4 * n_head + _qk_norm_bytes(cfg)


def recurrent_activation_bytes(cfg: ModelConfig, layer: int) -> int:
    """Bytes a Mamba-2 or Gated DeltaNet mixer saves for backward, per token (fp32: the chunked
    forms of kiln/model/ssm.py upcast, and the projections are counted at fp32 too).

    Besides widths per token (projections, conv, gates) the chunked form keeps, per chunk of L
    tokens, L×L decay and score matrices per head (so ∝ H·L per token) and the state entering
    the chunk (H·P·N for Mamba-2, H·Dk·Dv for DeltaNet, so ∝ 1/L per token). The coefficients
    are fitted to what autograd saves (saved-tensor hooks over widths, chunk and state sizes)
    and rounded; tests/train/test_preflight.py checks the estimate within 5% of a measurement.
    """
    s, d, L = cfg.ssm, cfg.n_embd, cfg.ssm.chunk_size
    if cfg.layer_mixer(layer) == "mamba2":
        H, P, N, G = cfg.mamba_heads, s.head_dim, s.state_size, s.n_groups
        elements = 4 * d + 8 * cfg.mamba_inner + 8 * G * N + 10 * H + 4 * H * L + 4 * H * N
        elements += H * P * N / L
    else:
        H, D = cfg.delta_heads, cfg.delta_head_dim
        elements = d + 27 * H * D + 17 * H + 6 * H * L + H * D * D / L
    return int(4 * elements)


def _qk_norm_bytes(cfg: ModelConfig) -> int:
    """What per-head q/k norms add per token: fp32 copies and per-head statistics.

    Measured in fp32; under autocast the true figure is a few percent of a block higher (the
    norms keep extra bf16 copies), which this count leaves out.
    """
    if not cfg.qk_norm:
        return 0
    q_out, kv_out = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    heads = cfg.n_head + cfg.kv_heads
    if cfg.norm == "rmsnorm":
        return 4 * (2 * q_out + kv_out + heads)
    return 4 * (q_out + 2 * heads)


def activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "amp-bf16",
    checkpointing: bool = False,
) -> int:
    """Bytes of tensors saved for backward by one micro-batch (the activation memory).

    Without checkpointing every block's saved tensors stay until its backward. With full
    activation checkpointing (each block recomputed in backward) only the blocks' fp32 inputs
    are kept, plus one block's saved tensors while it is recomputed. Outside the blocks, per
    token: the token ids (int64), the final norm, and the fp32 hidden-state gradient that kiln's
    chunked loss computes in the forward; once per step: that loss's fp32 head-weight gradient,
    and under autocast the bf16 copies of the block weights and of the RoPE tables.
    """
    tokens = micro_batch * seq_len
    per_layer = [layer_activation_bytes(cfg, precision, i) for i in range(cfg.n_layer)]
    # Checkpointing keeps each block's fp32 input, and one block's tensors while recomputing it.
    kept = cfg.n_layer * cfg.n_embd * 4 + max(per_layer) if checkpointing else sum(per_layer)
    outside = 8 + _norm_bytes(cfg, precision) + 4 * cfg.n_embd
    fixed = 4 * cfg.padded_vocab_size * cfg.n_embd
    fixed += 8 * seq_len if cfg.pos_emb == "learned" else 0  # position ids, shared by the batch
    if precision == "amp-bf16":
        head_matmul = cfg.padded_vocab_size * cfg.n_embd
        fixed += 2 * (num_matmul_params(cfg) - head_matmul)
        if cfg.pos_emb == "rope":  # cos and sin cast for q and for k, in every layer
            fixed += cfg.n_layer * 4 * seq_len * cfg.head_size * 2
    return tokens * (kept + outside) + fixed


def memory_estimate(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "amp-bf16",
    optimizer: str = "adamw",
    checkpointing: bool = False,
) -> MemoryEstimate:
    """Training memory of one replica running micro-batches of `micro_batch` × `seq_len`."""
    if precision not in PRECISION_BYTES:
        raise KilnError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got {precision!r}")
    w, g, master = PRECISION_BYTES[precision]
    n = num_params(cfg)
    return MemoryEstimate(
        weights=w * n,
        gradients=g * n,
        master_weights=master * n,
        optimizer=optimizer_state_bytes(cfg, optimizer),
        activations=activation_bytes(cfg, micro_batch, seq_len, precision, checkpointing),
        activation_checkpointing=checkpointing,
    )
