"""Hugging Face interop for the Llama-like families with experts or latent attention.

MixtralForCausalLM (softmax top-k, renormalised), Qwen3MoeForCausalLM (per-head q/k norms,
optional renormalisation, leading dense layers) and DeepseekV3ForCausalLM (MLA, sigmoid routing
with the balancing bias, shared experts, routed scaling, leading dense layers). llama.py calls
these for the config fields and the per-layer tensors that differ from Llama; embeddings, block
norms and the head are mapped there. All three store experts as HF does, fused
gate_up_proj (E, 2F, C) and down_proj (E, C, F), which are kiln's Experts weights unchanged.
DeepSeek's interleaved RoPE layout (rope_interleave) is a fixed permutation of the RoPE rows of
q and k, undone on import; kiln exports with rope_interleave = false.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import MLAConfig, ModelConfig, MoEConfig
from kiln.model.hf.tensors import take

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def family_of(cfg: ModelConfig) -> str | None:
    """The HF family of a kiln config with experts or MLA (None for plain Llama / GPT-2)."""
    if cfg.mla is not None:
        return "deepseek_v3"
    if cfg.moe is None:
        return None
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


# ---- configs ---------------------------------------------------------------------------------


def family_fields_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields a family sets beyond Llama's (moe, mla, qk_norm, widths)."""
    if model_type == "mixtral":
        if hf.get("sliding_window") is not None:
            raise KilnError("Mixtral with sliding_window is not supported on import")
        moe = MoEConfig(
            n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
            d_expert=hf["intermediate_size"],
        )  # fmt: skip
        return {"moe": moe}
    if model_type == "qwen3_moe":
        if hf.get("use_sliding_window") or hf.get("decoder_sparse_step", 1) != 1:
            raise KilnError(
                "Qwen3-MoE with sliding windows or decoder_sparse_step != 1 is not supported"
            )
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise KilnError(
                f"Qwen3-MoE mlp_only_layers {dense}: kiln supports leading dense layers only"
            )
        moe = MoEConfig(
            n_experts=hf.get("num_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            d_expert=hf["moe_intermediate_size"], norm_topk=bool(hf.get("norm_topk_prob", False)),
            first_dense=len(dense),
        )  # fmt: skip
        return {"moe": moe, "qk_norm": True}
    return _deepseek_fields(hf)


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """MLA and (unless every layer is dense) DeepSeek-V3's router."""
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if n_group != topk_group and n_group != 1:
        raise KilnError(
            f"DeepSeek-V3 group-limited routing (n_group={n_group}, topk_group={topk_group}) "
            "is not supported; kiln routes over all experts"
        )
    H = hf["num_attention_heads"]
    mla = MLAConfig(
        kv_rank=hf["kv_lora_rank"], q_rank=hf.get("q_lora_rank"), rope_dim=hf["qk_rope_head_dim"],
        nope_dim=hf["qk_nope_head_dim"], v_dim=hf["v_head_dim"],
    )  # fmt: skip
    fields: dict[str, Any] = {
        "mla": mla,
        "head_dim": None if hf["hidden_size"] % H == 0 else hf["v_head_dim"],
    }
    first_dense = hf.get("first_k_dense_replace") or 0
    if first_dense < hf["num_hidden_layers"]:
        fields["moe"] = MoEConfig(
            n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
            d_expert=hf["moe_intermediate_size"], n_shared=hf.get("n_shared_experts") or 0,
            score="sigmoid", norm_topk=bool(hf.get("norm_topk_prob", True)),
            routed_scale=float(hf.get("routed_scaling_factor", 1.0)), first_dense=first_dense,
            expert_bias=True,
        )  # fmt: skip
    return fields


def family_config_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The HF config fields of a family beyond Llama's; a clear error for what it cannot express."""
    m = cfg.moe
    if cfg.bias:
        raise KilnError(f"HF {family} export needs bias = false")
    if cfg.attn_sinks or cfg.sliding_window is not None:
        raise KilnError(f"no HF {family} equivalent for attn_sinks / sliding_window")
    if family in ("mixtral", "qwen3_moe"):
        assert m is not None
        if m.score != "softmax" or m.n_shared or m.routed_scale != 1.0 or m.expert_bias:
            raise KilnError(
                f"HF {family} routes by softmax without shared experts, scaling or bias; this "
                "MoE config needs DeepSeek-V3 (set mla) or has no HF equivalent"
            )
        if family == "mixtral":
            if not m.norm_topk or m.first_dense:
                raise KilnError(
                    "HF Mixtral renormalises top-k and has no dense layers (try qk_norm: Qwen3-MoE)"
                )
            return {
                "num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k,
                "intermediate_size": cfg.expert_size, "sliding_window": None,
                "router_aux_loss_coef": m.aux_loss, "router_jitter_noise": 0.0,
            }  # fmt: skip
        return {
            "num_experts": m.n_experts, "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": cfg.expert_size, "norm_topk_prob": m.norm_topk,
            "mlp_only_layers": list(range(m.first_dense)), "decoder_sparse_step": 1,
            "use_sliding_window": False, "router_aux_loss_coef": m.aux_loss,
        }  # fmt: skip
    assert cfg.mla is not None
    mla = cfg.mla
    out: dict[str, Any] = {
        "kv_lora_rank": mla.kv_rank, "q_lora_rank": mla.q_rank, "qk_rope_head_dim": mla.rope_dim,
        "qk_nope_head_dim": cfg.qk_head_dim - mla.rope_dim, "v_head_dim": cfg.v_head_dim,
        "rope_interleave": False, "num_key_value_heads": cfg.n_head, "n_group": 1,
        "head_dim": mla.rope_dim,  # HF derives it so; RoPE tables are built at this width
        "topk_group": 1,
    }  # fmt: skip
    if m is None:  # every layer dense
        out.update(first_k_dense_replace=cfg.n_layer, n_routed_experts=1, num_experts_per_tok=1,
                   moe_intermediate_size=1, n_shared_experts=1)  # fmt: skip
        return out
    if m.score != "sigmoid" or not m.n_shared:
        raise KilnError(
            "HF DeepSeek-V3 routes by sigmoid and has shared experts (moe.score, moe.n_shared)"
        )
    out.update(
        first_k_dense_replace=m.first_dense, n_routed_experts=m.n_experts,
        num_experts_per_tok=m.top_k, moe_intermediate_size=cfg.expert_size,
        n_shared_experts=m.n_shared, norm_topk_prob=m.norm_topk,
        routed_scaling_factor=m.routed_scale,
    )  # fmt: skip
    return out


# ---- weights ---------------------------------------------------------------------------------


def _interleave_to_half(rows: Tensor, rope_dim: int) -> Tensor:
    """Reorder the last rope_dim rows of each head from pairs (x0, x1), (x2, x3)... to halves."""
    perm = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    head = rows.shape[1:]
    nope = rows.size(0) - rope_dim
    return torch.cat((rows[:nope], rows[nope:][perm])).reshape(-1, *head)


def layer_to_hf(cfg: ModelConfig, sd: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Layer i's MLA attention, MoE MLP and q/k norms under HF names (Llama's parts aside)."""
    k, h = f"blocks.{i}.", f"model.layers.{i}."
    out: dict[str, Tensor] = {}
    for hf_name, kiln_name in _names(cfg, i):
        out[h + hf_name] = sd[k + kiln_name]
    if cfg.is_moe_layer(i) and cfg.moe is not None and cfg.moe.n_shared:
        gate, up = sd[f"{k}mlp.shared.fc.weight"].chunk(2)
        out[f"{h}mlp.shared_experts.gate_proj.weight"] = gate
        out[f"{h}mlp.shared_experts.up_proj.weight"] = up
        out[f"{h}mlp.shared_experts.down_proj.weight"] = sd[f"{k}mlp.shared.proj.weight"]
    m = cfg.moe
    if cfg.mla is not None and m is not None and cfg.is_moe_layer(i) and not m.expert_bias:
        # DeepSeek always has the buffer; kiln's absent one is zero
        out[f"{h}mlp.gate.e_score_correction_bias"] = torch.zeros(m.n_experts)
    return out


def layer_from_hf(
    cfg: ModelConfig, hf: dict[str, Tensor], i: int, interleaved: bool
) -> dict[str, Tensor]:
    """Layer i's MLA attention, MoE MLP and q/k norms under kiln names."""
    k, h = f"blocks.{i}.", f"model.layers.{i}."
    if cfg.moe is not None and cfg.is_moe_layer(i):
        hf = {**hf, **_fused_experts(hf, h, cfg.moe.n_experts)}
    out = {k + kiln_name: take(hf, h + hf_name) for hf_name, kiln_name in _names(cfg, i)}
    if cfg.is_moe_layer(i) and cfg.moe is not None and cfg.moe.n_shared:
        gate_up = [take(hf, f"{h}mlp.shared_experts.{p}_proj.weight") for p in ("gate", "up")]
        out[f"{k}mlp.shared.fc.weight"] = torch.cat(gate_up)
        out[f"{k}mlp.shared.proj.weight"] = take(hf, f"{h}mlp.shared_experts.down_proj.weight")
    if cfg.mla is not None and interleaved:
        r, H = cfg.mla.rope_dim, cfg.n_head
        q_name = f"{k}attn.{'wq' if cfg.mla.q_rank is None else 'wq_b'}.weight"
        q = out[q_name].view(H, cfg.qk_head_dim, -1)
        out[q_name] = torch.stack([_interleave_to_half(q[j], r) for j in range(H)]).flatten(0, 1)
        out[f"{k}attn.wkv_a.weight"] = _interleave_to_half(out[f"{k}attn.wkv_a.weight"], r)
    return out


def _fused_experts(hf: dict[str, Tensor], h: str, n_experts: int) -> dict[str, Tensor]:
    """Per-expert tensors as `save_pretrained` writes them (experts.j.gate_proj, or Mixtral's
    block_sparse_moe.experts.j.w1/w3/w2), stacked into the fused layout; {} if already fused."""
    if f"{h}mlp.experts.gate_up_proj" in hf:
        return {}
    if f"{h}block_sparse_moe.experts.0.w1.weight" in hf:
        prefix, (gate, up, down) = f"{h}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        prefix, (gate, up, down) = f"{h}mlp.", ("gate_proj", "up_proj", "down_proj")

    def expert(j: int, name: str) -> Tensor:
        return take(hf, f"{prefix}experts.{j}.{name}.weight")

    experts = range(n_experts)
    return {
        f"{h}mlp.gate.weight": take(hf, f"{prefix}gate.weight"),
        f"{h}mlp.experts.gate_up_proj": torch.stack(
            [torch.cat((expert(j, gate), expert(j, up))) for j in experts]
        ),
        f"{h}mlp.experts.down_proj": torch.stack([expert(j, down) for j in experts]),
    }


def _names(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(HF name, kiln name) pairs of the tensors mapped one to one in layer i."""
    names: list[tuple[str, str]] = []
    if cfg.qk_norm:
        names += [("self_attn.q_norm.weight", "attn.q_norm.weight"),
                  ("self_attn.k_norm.weight", "attn.k_norm.weight")]  # fmt: skip
    if cfg.mla is not None:
        if cfg.mla.q_rank is None:
            names.append(("self_attn.q_proj.weight", "attn.wq.weight"))
        else:
            names += [("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
                      ("self_attn.q_a_layernorm.weight", "attn.q_a_norm.weight"),
                      ("self_attn.q_b_proj.weight", "attn.wq_b.weight")]  # fmt: skip
        names += [("self_attn.kv_a_proj_with_mqa.weight", "attn.wkv_a.weight"),
                  ("self_attn.kv_a_layernorm.weight", "attn.kv_a_norm.weight"),
                  ("self_attn.kv_b_proj.weight", "attn.wkv_b.weight"),
                  ("self_attn.o_proj.weight", "attn.proj.weight")]  # fmt: skip
    if cfg.is_moe_layer(i):
        names += [("mlp.gate.weight", "mlp.router.weight"),
                  ("mlp.experts.gate_up_proj", "mlp.experts.fc.weight"),
                  ("mlp.experts.down_proj", "mlp.experts.proj.weight")]  # fmt: skip
        if cfg.moe is not None and cfg.moe.expert_bias:
            names.append(("mlp.gate.e_score_correction_bias", "mlp.expert_bias"))
    return names
