"""Language-model loss from final hidden states, chunked so fp32 logits never exist for all tokens.

For each chunk of tokens the head matmul, optional soft-cap, cross-entropy, optional z-loss and
the gradients with respect to the hidden states and head weight are computed together, and the
chunk's logits are freed before the next one: memory is O(chunk · V), not O(B · T · V), and no
matmul is recomputed (unlike checkpointing the head). The formulas, per valid target y:

    s = c·tanh(z / c) if soft-capped else z,     z = h·Wᵀ (real vocab columns only)
    loss = mean[ logsumexp(s) - s_y + w_z · logsumexp(s)² ]
    ∂loss/∂s = softmax(s) · (1 + 2·w_z·logsumexp(s)) - onehot(y),    ∂s/∂z = 1 - (s/c)²

One driver, `_ChunkedLoss`, owns the chunk loop (head matmul, masking, the mean, the gradient
matmuls); a loss is a per-chunk function from the chunk's logits to its per-row losses and
∂loss/∂z: `_ce_chunk` for `lm_loss`, `_topk_chunk` for `topk_lm_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

# Logit elements per chunk (128 MB in fp32): rows enough for efficient matmuls (~670 at a 50k
# vocabulary) while the transient memory stays fixed whatever the batch size.
CHUNK_ELEMENTS = 2**25

# (z (n, V) fp32 logits, the chunk's rows, targets y (n, 1) clamped to >= 0, scale (n,) = valid
# / n_valid or None without gradients) -> (per-row loss (n,), ∂loss/∂z (n, V) fp32 or None).
_ChunkLoss = Callable[[Tensor, slice, Tensor, Tensor | None], tuple[Tensor, Tensor | None]]


def lm_loss(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_size: int,
    softcap: float | None = None,
    z_loss: float = 0.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """Mean cross-entropy (+ z-loss) of h (..., C) through the head weight (V_pad, C).

    Targets < 0 are ignored (nanoGPT's -1 and HF's -100 both work); columns at and beyond
    vocab_size (vocabulary padding) never take part. Returns a scalar fp32 tensor.
    """
    chunk = partial(_ce_chunk, softcap=softcap, z_weight=z_loss)
    return _chunked_loss(h, weight, targets, vocab_size, chunk, chunk_tokens)


def _chunked_loss(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_size: int,
    chunk_loss: _ChunkLoss,
    chunk_tokens: int | None = None,
) -> Tensor:
    """Mean over targets >= 0 of chunk_loss's per-row losses, from h (..., C) and weight (V_pad, C).

    The logits are made chunk by chunk in the autocast dtype (or h's) and freed after each;
    chunk_tokens defaults to CHUNK_ELEMENTS // vocab_size rows (at least 64).
    """
    chunk_tokens = chunk_tokens or max(64, CHUNK_ELEMENTS // vocab_size)
    dtype = (
        torch.get_autocast_dtype(h.device.type)
        if torch.is_autocast_enabled(h.device.type)
        else h.dtype
    )
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    h2 = h.reshape(-1, h.size(-1))  # (N, C)
    return _ChunkedLoss.apply(
        h2, weight, targets.reshape(-1), vocab_size, chunk_loss, chunk_tokens, dtype, need_grad
    )


class _ChunkedLoss(torch.autograd.Function):
    """Loss and its gradients in one chunked pass; backward only scales the stored gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        weight: Tensor,
        targets: Tensor,
        vocab_size: int,
        chunk_loss: _ChunkLoss,
        chunk_tokens: int,
        dtype: torch.dtype,
        need_grad: bool,
    ) -> Tensor:
        """Scalar loss; stashes dloss/dh (N, C) and dloss/dW (V_pad, C) for backward."""
        with torch.autocast(h.device.type, enabled=False):  # dtypes below are explicit
            w = weight.to(dtype)[:vocab_size]  # (V, C): padding rows never score
            hc = h.to(dtype)  # (N, C)
            valid = targets >= 0  # (N,)
            n_valid = valid.sum().clamp(min=1).float()
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(h) if need_grad else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
            for start in range(0, h.size(0), chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                z = (hc[rows] @ w.T).float()  # (n, V)
                y = targets[rows].clamp(min=0)[:, None]  # (n, 1); invalid rows masked below
                row_valid = valid[rows].float()  # (n,)
                scale = row_valid / n_valid if need_grad else None  # (n,): mean over valid
                row_loss, g = chunk_loss(z, rows, y, scale)
                del z  # the chunk's logits; only their gradient g outlives chunk_loss
                total += (row_loss * row_valid).sum()
                if g is None:
                    continue
                g = g.to(dtype)
                grad_h[rows] = (g @ w).to(h.dtype)  # (n, C)
                if dtype == torch.float32:  # accumulate in place, no (V, C) temporary
                    grad_w[:vocab_size].addmm_(g.T, hc[rows])  # (V, C)
                else:
                    grad_w[:vocab_size] += g.T @ hc[rows]  # low-precision product, fp32 sum
                del g  # free this chunk's gradient before the next chunk's logits
            if need_grad:
                ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
            return total / n_valid

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        """Chain rule: the stored gradients times the incoming scalar."""
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None, None, None, None


def _ce_chunk(
    z: Tensor,
    rows: slice,
    y: Tensor,
    scale: Tensor | None,
    *,
    softcap: float | None,
    z_weight: float,
) -> tuple[Tensor, Tensor | None]:
    """One chunk of `lm_loss`: per-row CE (+ z-loss) and, given scale, ∂loss/∂z (module doc)."""
    s = softcap * torch.tanh(z / softcap) if softcap else z
    logp = torch.log_softmax(s, dim=-1)  # (n, V), one fused pass
    lse = s[:, 0] - logp[:, 0]  # (n,) logsumexp, read off any column
    row_loss = -logp.gather(1, y).squeeze(1) + z_weight * lse.square()
    if scale is None:
        return row_loss, None
    g = logp.exp_()  # (n, V) softmax, in place of logp
    g.mul_((scale * (1 + 2 * z_weight * lse))[:, None])
    g.scatter_add_(1, y, -scale[:, None])  # minus the one-hot target
    if softcap:
        g.mul_(1 - (s / softcap).square())
    return row_loss, g


def logits_loss(logits: Tensor, targets: Tensor, z_loss: float = 0.0) -> Tensor:
    """`lm_loss` of logits already made (..., V): mean cross-entropy (+ z-loss), in fp32.

    For a pipeline's last stage, whose logits go to the schedule's loss function. Targets < 0
    are ignored; soft-capping is the head's (`Transformer.logits`), done before.
    """
    s = logits.float().reshape(-1, logits.size(-1))  # (N, V)
    y = targets.reshape(-1)  # (N,)
    valid = y >= 0
    lse = torch.logsumexp(s, dim=-1)  # (N,)
    picked = s.gather(1, y.clamp(min=0)[:, None]).squeeze(1)  # (N,)
    per_token = lse - picked + z_loss * lse.square()
    return (per_token * valid).sum() / valid.sum().clamp(min=1)


def distill_loss(
    student: Tensor,
    teacher: Tensor,
    targets: Tensor,
    kind: str = "forward_kl",
    temperature: float = 1.0,
) -> Tensor:
    """Mean KL between teacher and student logits (..., V) at temperature τ, times τ².

    forward_kl: KL(p_teacher ‖ p_student), which covers the teacher's modes (Hinton et al.);
    reverse_kl: KL(p_student ‖ p_teacher), which seeks one mode (MiniLLM, GKD). The τ² factor
    keeps the gradient's scale independent of τ. Positions with targets < 0 do not count.
    """
    if kind not in ("forward_kl", "reverse_kl"):
        raise ValueError(f"distill loss kind must be forward_kl or reverse_kl, got {kind!r}")
    keep = targets.reshape(-1) >= 0  # (N,)
    V = student.size(-1)
    s = torch.log_softmax(student.reshape(-1, V)[keep].float() / temperature, dim=-1)  # (n, V)
    t = torch.log_softmax(teacher.reshape(-1, V)[keep].float() / temperature, dim=-1)  # (n, V)
    p, q = (t, s) if kind == "forward_kl" else (s, t)  # KL(p ‖ q) in log space
    kl = (p.exp() * (p - q)).sum(-1)  # (n,)
    if kl.numel() == 0:
        return student.sum() * 0.0
    return kl.mean() * temperature**2


def topk_distill_loss(
    student: Tensor,
    ids: Tensor,
    teacher_logp: Tensor,
    teacher_log_tail: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """Forward KL over K + 1 buckets (the teacher's top-k ids and "everything else"), times τ².

    student (..., V) logits; ids (..., K) the teacher's top-k token ids; teacher_logp (..., K)
    its log-probabilities there at temperature τ; teacher_log_tail (...) the log of its mass
    outside them, log(1 − Σ p_k). The student's buckets are its softmax at τ read at the ids and
    its mass outside them, so both distributions sum to one: the student is neither free to put
    mass outside the top-k nor pushed to put the teacher's tail into it. With K = V the tail is
    empty and the loss is `distill_loss`'s forward KL. Positions with targets < 0 do not count.
    """
    keep = targets.reshape(-1) >= 0  # (N,)
    V, K = student.size(-1), ids.size(-1)
    full = torch.log_softmax(student.reshape(-1, V)[keep].float() / temperature, dim=-1)  # (n, V)
    index = ids.reshape(-1, K)[keep]  # (n, K)
    s = full.gather(1, index)  # (n, K)
    # The student's tail, log(1 − Σ q_k), from the K values: no second (n, V) pass. Floored at
    # 1e-30 so an empty tail (K = V, where the teacher's bucket weighs 0) stays finite.
    s_tail = (-torch.expm1(s.logsumexp(-1))).clamp_min(1e-30).log()  # (n,)
    t = teacher_logp.reshape(-1, K)[keep].float()  # (n, K)
    t_tail = teacher_log_tail.reshape(-1)[keep].float()  # (n,)
    p_tail = t_tail.exp() if K < V else torch.zeros_like(t_tail)  # K = V: no tail, whatever stored
    kl = (t.exp() * (t - s)).sum(-1)  # (n,)
    kl = kl + torch.where(p_tail > 0, p_tail * (t_tail.clamp_min(-1e4) - s_tail), 0.0)
    if kl.numel() == 0:
        return student.sum() * 0.0
    return kl.mean() * temperature**2


def teacher_topk(logits: Tensor, k: int, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(ids (..., K), log-probs at τ there (..., K), log of the mass outside them (...))."""
    z = logits.float() / temperature  # (..., V)
    values, ids = z.topk(k, dim=-1)
    logp = values - z.logsumexp(-1, keepdim=True)  # (..., K)
    # log(1 − Σ p_k) in float64: the tail stays accurate down to ~1e-15 of the mass
    rest = -torch.expm1(logp.double().logsumexp(-1))  # (...)
    if k == z.size(-1):  # nothing is outside; rounding would leave a spurious ~1e-8
        rest = torch.zeros_like(rest)
    return ids, logp, rest.clamp_min(0).log().float()


def topk_lm_loss(
    h: Tensor,
    weight: Tensor,
    vocab_size: int,
    topk: tuple[Tensor, Tensor, Tensor],
    targets: Tensor,
    temperature: float,
    kl_weight: float,
    ce_weight: float,
) -> Tensor:
    """kl_weight · `topk_distill_loss` + ce_weight · CE from hidden states h (..., C), chunked.

    The student's logits are made chunk by chunk through the head weight (V_pad, C) and freed,
    with their gradients, as in `lm_loss` (no soft-cap). topk = (ids, log-probs, log tail) of the
    teacher. Per row, at τ, with q = softmax(z / τ) and the teacher's buckets p_k, p_tail:

        ∂(τ² KL)/∂z_j = τ · (q_j − t_j),   t_j = p_j on the K ids, p_tail · q_j / q_tail elsewhere
    """
    ids, logp, tail = topk
    K = ids.size(-1)
    teacher = (ids.reshape(-1, K), logp.reshape(-1, K).float(), tail.reshape(-1).float())
    chunk = partial(
        _topk_chunk,
        teacher=teacher,
        weights=(temperature, kl_weight, ce_weight),
        has_tail=ids.size(-1) < vocab_size,
    )
    return _chunked_loss(h, weight, targets, vocab_size, chunk)


def _topk_chunk(
    z: Tensor,
    rows: slice,
    y: Tensor,
    scale: Tensor | None,
    *,
    teacher: tuple[Tensor, Tensor, Tensor],
    weights: tuple[float, float, float],
    has_tail: bool,
) -> tuple[Tensor, Tensor | None]:
    """One chunk of `topk_lm_loss`: per-row τ²·KL (+ CE) and, given scale, ∂loss/∂z."""
    tau, kl_w, ce_w = weights
    ids, logp, tail = teacher
    zt = torch.log_softmax(z / tau, dim=-1)  # (n, V) log q
    k_ids, p_log = ids[rows], logp[rows]  # (n, K)
    q_log = zt.gather(1, k_ids)  # (n, K)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)  # (n,)
    q_tail = (-torch.expm1(q_log.logsumexp(-1))).clamp_min(1e-30)  # (n,)
    p_tail = tail[rows].exp() if has_tail else torch.zeros_like(q_tail)
    kl = kl + torch.where(p_tail > 0, p_tail * (tail[rows].clamp_min(-1e4) - q_tail.log()), 0.0)
    row_loss = kl_w * tau**2 * kl
    if ce_w:
        lp1 = zt if tau == 1 else torch.log_softmax(z, dim=-1)
        row_loss = row_loss - ce_w * lp1.gather(1, y).squeeze(1)
    if scale is None:
        return row_loss, None
    q = zt.exp_()  # (n, V), in place of log q
    g = q * (-kl_w * tau * scale * p_tail / q_tail)[:, None]  # the tail's target
    g.scatter_(1, k_ids, (-kl_w * tau * scale)[:, None] * p_log.exp())
    g.add_(q * (kl_w * tau * scale)[:, None])
    if ce_w:
        g.add_((q if tau == 1 else lp1.exp()) * (ce_w * scale)[:, None])
        g.scatter_add_(1, y, -(ce_w * scale)[:, None])
    return row_loss, g
