"""Triton kernels for exact (flash) attention: tiled forward and FlashAttention-2 backward.

Layout: q is (B, H, T, D), k and v are (B, H_kv, T, D); query head h reads kv head h // GROUP,
so grouped-query attention never copies K/V. Scores are kept in log2 units (scaled by
softmax_scale · log2(e)) so the kernels use exp2; LSE is saved in the same units, one fp32 value
per query row, and the backward recomputes probabilities from it instead of storing them.

Causal masking: with the query block [m, m + BLOCK_M), the key blocks before m are fully visible
(no mask), the ones in [m, m + BLOCK_M) are diagonal (masked), and the ones after are skipped.
Edge masking (T not a multiple of the blocks) is compiled in only when the heuristics say so.

Every tl.dot casts its operands to DOT: the input dtype when compiled (a no-op), fp32 in the
interpreter for bf16 inputs, whose tl.dot multiplies bf16 bit patterns (triton issue 11584,
"not supported yet"); operands are first rounded to the input dtype, so the numerics match.
"""

import os

import triton
import triton.language as tl

# Decided when the kernels are decorated (triton reads TRITON_INTERPRET at @triton.jit time).
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def _configs(blocks: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """Autotune configs from (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in blocks
    ]


# The forward and dQ kernels need BLOCK_M % BLOCK_N == 0, dK/dV needs BLOCK_N % BLOCK_M == 0,
# so diagonal tiles are whole sub-blocks of the outer block. The first config of each list is
# small enough to fit shared memory for every dtype and head dim (fp32 at D=128 included).
FWD_CONFIGS = _configs(
    [
        (64, 32, 4, 2),
        (64, 64, 4, 3),
        (128, 32, 4, 4),
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
    ]
)
BWD_DKDV_CONFIGS = _configs(  # BLOCK_M: query rows, BLOCK_N: keys
    [(32, 64, 4, 2), (32, 128, 8, 2), (64, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3)]
)
BWD_DQ_CONFIGS = _configs(
    [(64, 32, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3)]
)
if INTERPRET:
    # The interpreter runs every config it is given, so it gets one, with blocks small enough
    # that the tests' short sequences span several blocks, diagonal tiles and ragged edges.
    FWD_CONFIGS = _configs([(32, 16, 4, 1)])
    BWD_DKDV_CONFIGS = _configs([(16, 32, 4, 1)])
    BWD_DQ_CONFIGS = _configs([(32, 16, 4, 1)])
elif os.environ.get("KILN_KERNELS_AUTOTUNE") == "0":
    # Correctness runs on a GPU: autotuning would only add compile time.
    FWD_CONFIGS, BWD_DKDV_CONFIGS, BWD_DQ_CONFIGS = (
        FWD_CONFIGS[:1],
        BWD_DKDV_CONFIGS[:1],
        BWD_DQ_CONFIGS[:1],
    )

PREPROCESS_BLOCK = 32 if INTERPRET else 64

_KEY = ["T", "D", "CAUSAL", "GROUP"]
# True when no block in this launch touches a ragged edge, so loads need no bounds masks.
_EVEN_T = {"EVEN_T": lambda a: a["T"] % a["BLOCK_M"] == 0 and a["T"] % a["BLOCK_N"] == 0}


@triton.jit
def _fwd_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_m,
    offs_d,
    T,
    qk_scale,
    lo,
    hi,
    BLOCK_N: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi): update the running max, sum and output."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]  # (D, BLOCK_N)
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]  # (BLOCK_N, D)
        if MASK_KEYS:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < T, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        qk = (
            tl.dot(q.to(DOT), kt.to(DOT), input_precision=PRECISION) * qk_scale
        )  # (BLOCK_M, BLOCK_N)
        if MASK_CAUSAL:
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
        if MASK_KEYS:
            qk = tl.where(offs_n[None, :] < T, qk, float("-inf"))
        # Every row has seen a visible key by its first block, so m_new is finite: no NaN here.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(
            p.to(v.dtype).to(DOT), v.to(DOT), acc * alpha[:, None], input_precision=PRECISION
        )
        m_i = m_new
    return acc, m_i, l_i


@triton.autotune(configs=FWD_CONFIGS, key=_KEY)
@triton.heuristics(_EVEN_T)
@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_ot,
    H,
    GROUP,
    T,
    qk_scale,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_T: tl.constexpr,
):
    """One (query block, batch·head) program: O = softmax(Q Kᵀ·scale) V and the row LSE."""
    # Reverse order: causal blocks near the end do the most work, so they are scheduled first.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    h_kv = h // GROUP
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs) if EVEN_T else tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T, qk_scale,
            0, start_m, BLOCK_N, False, False, PRECISION, DOT,
        )  # fmt: skip
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T, qk_scale,
            start_m, start_m + BLOCK_M, BLOCK_N, True, not EVEN_T, PRECISION, DOT,
        )  # fmt: skip
    else:
        t_full = (T // BLOCK_N) * BLOCK_N
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T, qk_scale,
            0, t_full, BLOCK_N, False, False, PRECISION, DOT,
        )  # fmt: skip
        if not EVEN_T:
            acc, m_i, l_i = _fwd_tiles(
                acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T,
                qk_scale, t_full, T, BLOCK_N, False, True, PRECISION, DOT,
            )  # fmt: skip

    acc = acc / l_i[:, None]
    lse = m_i + tl.log2(l_i)  # (BLOCK_M,) log2 units, what the backward needs
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    lse_ptrs = LSE + pid_bh.to(tl.int64) * T + offs_m
    if EVEN_T:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty))
        tl.store(lse_ptrs, lse)
    else:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
        tl.store(lse_ptrs, lse, mask=offs_m < T)


@triton.jit
def attn_bwd_preprocess_kernel(
    Out,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_dob,
    stride_doh,
    stride_dot,
    H,
    T,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32, the softmax-gradient term shared by dQ and dK."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.arange(0, D)
    rows = offs_m[:, None] < T
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
                mask=rows, other=0.0)  # fmt: skip
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
        mask=rows, other=0.0,
    )  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _bwd_dkdv_tiles(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qt,
    stride_dot,
    offs_n,
    offs_d,
    T,
    qk_scale,
    lo,
    hi,
    BLOCK_M: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi) of one query head."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt_ptrs = q_base + offs_m[None, :] * stride_qt + offs_d[:, None]  # (D, BLOCK_M)
        do_ptrs = do_base + offs_m[:, None] * stride_dot + offs_d[None, :]  # (BLOCK_M, D)
        if MASK_ROWS:
            rows = offs_m < T
            qt = tl.load(qt_ptrs, mask=rows[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=rows[:, None], other=0.0)
            # LSE = +inf past the end makes those rows' probabilities exactly 0.
            lse = tl.load(lse_base + offs_m, mask=rows, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=rows, other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        qkt = (
            tl.dot(k.to(DOT), qt.to(DOT), input_precision=PRECISION) * qk_scale
        )  # (BLOCK_N, BLOCK_M)
        if MASK_CAUSAL:
            qkt = tl.where(offs_m[None, :] >= offs_n[:, None], qkt, float("-inf"))
        pt = tl.exp2(qkt - lse[None, :])  # Pᵀ, recomputed from the saved LSE
        dv = tl.dot(pt.to(do.dtype).to(DOT), do.to(DOT), dv, input_precision=PRECISION)
        dpt = tl.dot(
            v.to(DOT), tl.trans(do).to(DOT), input_precision=PRECISION
        )  # (BLOCK_N, BLOCK_M)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype).to(DOT), tl.trans(qt).to(DOT), dk, input_precision=PRECISION)
    return dk, dv


@triton.autotune(configs=BWD_DKDV_CONFIGS, key=_KEY)
@triton.heuristics(_EVEN_T)
@triton.jit
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dkb,
    stride_dkh,
    stride_dkt,
    H,
    H_KV,
    GROUP,
    T,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_T: tl.constexpr,
):
    """One (key block, batch·kv head) program: dK and dV summed over the kv head's query heads."""
    start_n = tl.program_id(0) * BLOCK_N
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
    if EVEN_T:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
        v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)

    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    t_full = (T // BLOCK_M) * BLOCK_M
    # Looping over the group here (rather than one program per query head) sums the GQA
    # gradient in registers: no atomics, no (B, H, T, D) scratch, deterministic.
    for g in range(GROUP):
        h = h_kv * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = LSE + (b * H + h) * T
        delta_base = DELTA + (b * H + h) * T
        lo = 0
        tail_lo = t_full
        if CAUSAL:
            # Queries in [start_n, start_n + BLOCK_N) see this block partly: the diagonal tiles.
            dk, dv = _bwd_dkdv_tiles(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                offs_n, offs_d, T, qk_scale, start_n, start_n + BLOCK_N, BLOCK_M, True,
                not EVEN_T, PRECISION, DOT,
            )  # fmt: skip
            lo = start_n + BLOCK_N
            tail_lo = tl.maximum(lo, t_full)
        # Queries after the diagonal see the whole block; only the ragged last block is masked.
        dk, dv = _bwd_dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
            offs_n, offs_d, T, qk_scale, lo, t_full, BLOCK_M, False, False, PRECISION, DOT,
        )  # fmt: skip
        if not EVEN_T:
            dk, dv = _bwd_dkdv_tiles(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                offs_n, offs_d, T, qk_scale, tail_lo, T, BLOCK_M, False, True,
                PRECISION, DOT,
            )  # fmt: skip

    dk = dk * sm_scale
    dk_ptrs = (
        DK + b * stride_dkb + h_kv * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :]
    )
    dv_ptrs = (
        DV + b * stride_dkb + h_kv * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :]
    )
    if EVEN_T:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))
    else:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)


@triton.jit
def _bwd_dq_tiles(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_m,
    offs_d,
    T,
    qk_scale,
    lo,
    hi,
    BLOCK_N: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]  # (D, BLOCK_N)
        vt_ptrs = v_base + offs_n[None, :] * stride_vt + offs_d[:, None]  # (D, BLOCK_N)
        if MASK_KEYS:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < T, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_n[None, :] < T, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        qk = (
            tl.dot(q.to(DOT), kt.to(DOT), input_precision=PRECISION) * qk_scale
        )  # (BLOCK_M, BLOCK_N)
        if MASK_CAUSAL:
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
        if MASK_KEYS:
            qk = tl.where(offs_n[None, :] < T, qk, float("-inf"))
        p = tl.exp2(qk - lse[:, None])
        dp = tl.dot(do.to(DOT), vt.to(DOT), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype).to(DOT), tl.trans(kt).to(DOT), dq, input_precision=PRECISION)
    return dq


@triton.autotune(configs=BWD_DQ_CONFIGS, key=_KEY)
@triton.heuristics(_EVEN_T)
@triton.jit
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dqb,
    stride_dqh,
    stride_dqt,
    H,
    GROUP,
    T,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_T: tl.constexpr,
):
    """One (query block, batch·head) program: dQ = scale · dS K, with dS recomputed per tile."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    h_kv = h // GROUP
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    do_ptrs = DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :]
    lse_ptrs = LSE + pid_bh.to(tl.int64) * T + offs_m
    delta_ptrs = DELTA + pid_bh.to(tl.int64) * T + offs_m
    if EVEN_T:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    else:
        rows = offs_m < T
        q = tl.load(q_ptrs, mask=rows[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=rows[:, None], other=0.0)
        lse = tl.load(lse_ptrs, mask=rows, other=float("inf"))
        delta = tl.load(delta_ptrs, mask=rows, other=0.0)

    dq = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        dq = _bwd_dq_tiles(
            dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T,
            qk_scale, 0, start_m, BLOCK_N, False, False, PRECISION, DOT,
        )  # fmt: skip
        dq = _bwd_dq_tiles(
            dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T,
            qk_scale, start_m, start_m + BLOCK_M, BLOCK_N, True, not EVEN_T, PRECISION, DOT,
        )  # fmt: skip
    else:
        t_full = (T // BLOCK_N) * BLOCK_N
        dq = _bwd_dq_tiles(
            dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T,
            qk_scale, 0, t_full, BLOCK_N, False, False, PRECISION, DOT,
        )  # fmt: skip
        if not EVEN_T:
            dq = _bwd_dq_tiles(
                dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T,
                qk_scale, t_full, T, BLOCK_N, False, True, PRECISION, DOT,
            )  # fmt: skip

    dq = dq * sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :]
    if EVEN_T:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)
