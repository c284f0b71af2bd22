"""Paged decode attention: one new query token per row attending over its own cached keys, read in place
through the row's block table (no gathered copy of the keys), as vLLM's PagedAttention (Kwon et al. 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", Sec. 4.1) and split
over the key axis as flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference").

Shapes: B rows, nh query heads, nkv kv heads (G = nh / nkv queries per kv head), Dk / Dv head dims,
W blocks read per row (the block-table width), bs tokens per block, N token slots of the cache.

    q:       [B, nh, Dk]          the rows' queries (after RoPE)
    k_cache: [N, nkv, Dk]         one layer's keys (``PagedKVCache.k[layer]``), v_cache [N, nkv, Dv]
    table:   [B, W] int64         row b's j-th block; key position p sits in slot table[b, p // bs] * bs + p % bs
    lengths: [B] int64            row b attends keys 0..lengths[b]-1 (lengths[b] <= W * bs)
    out:     [B, nh, Dv]          softmax(q k^T * scale) v per row and head, in q's dtype

The Triton kernel reads each row's keys up to its own length only, so a batch's short rows cost their own
length, not the longest row's (the gather path reads W * bs keys for every row). Each program handles one
(row, kv head, key split) and keeps the softmax online (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax", Alg. 3); the splits' partial results are merged with their log-sum-exp weights.
Every launch shape is a function of (B, W) only, so a decode step using it can be captured in a CUDA graph.

Rows that share leading cache blocks (a GRPO group's prompt, ``PrefixGroups``) can have those keys read
once per group: a group program (``_group_program``) attends them for all the group's rows in one query
tile, each row's own program (``_row_program``) attends the rest, both in the same launch, and the two
partial softmaxes merge by log-sum-exp like the splits (cascade attention, as FlashInfer's and SGLang's
shared-prefix decode).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moerl.models.fast_paths import triton, use_triton

if triton is not None:
    import triton.language as tl


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """The definition, in tensor ops (float32 softmax): gathers each row's W * bs keys and masks those at
    positions >= its length. Shapes as in the module docstring; returns [B, nh, Dv] in q's dtype (0 for a
    row of length 0)."""
    b, nh, _ = q.shape
    nkv, bs, w = k_cache.shape[1], block_size, table.shape[1]
    pos = torch.arange(w * bs, device=q.device)
    slots = (table[:, :, None] * bs + torch.arange(bs, device=q.device)).reshape(b, w * bs)
    k = k_cache[slots].float()  # [B, R, nkv, Dk]
    v = v_cache[slots].float()
    qf = q.float().view(b, nkv, nh // nkv, -1)
    s = torch.einsum("bhgd,brhd->bhgr", qf, k) * scale
    s = s.masked_fill(~(pos[None, :] < lengths[:, None])[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgr,brhd->bhgd", p, v).reshape(b, nh, -1).to(q.dtype)


def paged_decode_supported(k_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention`` runs the Triton kernel for this cache: Triton installed, a CUDA
    cache, moerl's fast paths on (``moerl.models.fast_paths``)."""
    return use_triton(k_cache)


def _num_splits(b: int, nkv: int, keys: int, block_n: int) -> tuple[int, int]:
    """(splits S, keys per split at the table's width): enough programs to cover a GPU's ~132
    multiprocessors twice when B * nkv alone does not, never splits shorter than 4 * block_n keys at the
    width. Host ints of the shape only (graph-safe). On the GPU each row divides its own length into the S
    splits (at least 4 * block_n keys each), so a wide table costs its rows nothing."""
    want = max(1, -(-264 // max(b * nkv, 1)))
    splits = max(1, min(want, keys // (4 * block_n)))
    per = -(-keys // splits)
    per = -(-per // block_n) * block_n
    return -(-keys // per), per


def _prefix_splits(groups: int, nkv: int, keys: int, block_n: int) -> tuple[int, int]:
    """(splits SP, keys per split at the table's width) of the shared-prefix pass over ``groups`` group
    slots: enough programs for ~264 (two per multiprocessor), at most 8, each at least one block_n tile (a
    group's prompt is a few hundred keys: with the row kernel's 4-tile floor a 512-key prompt was one
    program per group and head, latency-bound at small B). Host ints of the shape only (graph-safe); on
    the GPU each group divides its own shared length into the SP splits."""
    splits = max(1, min(8, -(-264 // (max(groups, 1) * nkv)), keys // block_n))
    per = -(-keys // splits)
    per = -(-per // block_n) * block_n
    return -(-keys // per), per


if triton is not None:

    @triton.jit
    def _block(
        q,
        K,
        V,
        TABLE,
        b,
        kh,
        n0,
        end,
        m_i,
        l_i,
        acc,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_tb,
        scale,
        DK: tl.constexpr,
        DKP: tl.constexpr,
        DV: tl.constexpr,
        DVP: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One BLOCK_N-key step of the online softmax: keys n0..n0+BLOCK_N-1 (those < end)."""
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        blk = tl.load(TABLE + b * stride_tb + n // BS, mask=valid, other=0)
        slot = blk * BS + n % BS
        k = tl.load(
            K + slot[:, None] * stride_kt + kh * stride_kh + dk[None, :],
            mask=valid[:, None] & (dk[None, :] < DK),
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a step with no valid key: p = 0, alpha = 1
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slot[:, None] * stride_vt + kh * stride_vh + dv[None, :],
            mask=valid[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _row_program(
        Q,
        K,
        V,
        TABLE,
        LENS,
        ACC,
        ML,
        b,
        sp,
        stride_qb,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_tb,
        PFX_START,
        keys_per_split,
        num_splits,
        prefix_splits,
        scale,
        G: tl.constexpr,
        GP: tl.constexpr,
        DK: tl.constexpr,
        DKP: tl.constexpr,
        DV: tl.constexpr,
        DVP: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        DYNAMIC: tl.constexpr,
        KPS: tl.constexpr,
        HAS_PFX: tl.constexpr,
    ):
        """Row b's keys past its group's shared ones (all of them without a group), split sp of
        num_splits, for the G query heads of kv head program_id(1): a partial softmax into ACC / ML."""
        kh = tl.program_id(1)
        nh = tl.num_programs(1) * G
        length = tl.load(LENS + b)
        first = 0  # keys before it are attended by the row's group program (_group_program)
        if HAS_PFX:
            first = tl.load(PFX_START + b)
        if DYNAMIC:  # the row's own keys in num_splits parts of whole BLOCK_N tiles, >= 4 tiles each
            per = tl.cdiv(tl.cdiv(length - first, num_splits), BLOCK_N) * BLOCK_N
            per = tl.maximum(per, 4 * BLOCK_N)
        else:
            per = keys_per_split
        start = first + sp * per
        end = tl.minimum(start + per, length)
        g = tl.arange(0, GP)
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        qh = kh * G + g
        q = tl.load(
            Q + b * stride_qb + qh[:, None] * stride_qh + dk[None, :],
            mask=(g[:, None] < G) & (dk[None, :] < DK),
            other=0.0,
        )
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DVP], tl.float32)
        # DYNAMIC: stop at the row's own length (GPU); the CPU interpreter cannot take tensor loop bounds,
        # so there the loop runs over the whole split and the mask in _block drops the keys past the length
        if DYNAMIC:
            for n0 in range(start, end, BLOCK_N):
                m_i, l_i, acc = _block(
                    q, K, V, TABLE, b, kh, n0, end, m_i, l_i, acc,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_tb, scale,
                    DK, DKP, DV, DVP, BS, BLOCK_N, IEEE,
                )  # fmt: skip
        else:
            for i in range(0, KPS, BLOCK_N):  # KPS = keys_per_split, a constexpr only here
                m_i, l_i, acc = _block(
                    q, K, V, TABLE, b, kh, start + i, end, m_i, l_i, acc,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_tb, scale,
                    DK, DKP, DV, DVP, BS, BLOCK_N, IEEE,
                )  # fmt: skip
        # partial results: ACC [B, S + SP, nh, DVP] float32, ML [B, S + SP, nh, 2] float32 (running max,
        # sum); splits S.. are the group program's, empty for a row it does not serve
        total = num_splits + prefix_splits
        row = (b * total + sp) * nh + qh
        gmask = g < G
        tl.store(ACC + row[:, None] * DVP + dv[None, :], acc, mask=gmask[:, None])
        tl.store(ML + row * 2, m_i, mask=gmask)
        tl.store(ML + row * 2 + 1, l_i, mask=gmask)

    @triton.jit
    def _group_program(
        Q,
        K,
        V,
        TABLE,
        PFX_LEADERS,
        PFX_N,
        PFX_LEN,
        PFX_ROWS,
        ACC,
        ML,
        slot,
        sp,
        stride_qb,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_tb,
        keys_per_split,
        num_splits,
        prefix_splits,
        scale,
        G: tl.constexpr,
        GR: tl.constexpr,
        MP: tl.constexpr,
        DK: tl.constexpr,
        DKP: tl.constexpr,
        DV: tl.constexpr,
        DVP: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        DYNAMIC: tl.constexpr,
        KPS: tl.constexpr,
    ):
        """Group slot ``slot``, split sp of prefix_splits: the keys a group's rows share (the same blocks at
        the same positions, its leader row r's table) attended once for all of them: one [GR * G, Dk]
        query tile, each key block read once per group instead of once per row (cascade attention). A
        group slot whose leader is -1 (fewer groups than slots) reads and stores nothing."""
        leader = tl.load(PFX_LEADERS + slot)
        has_group = leader >= 0
        r = tl.maximum(leader, 0)
        kh = tl.program_id(1)
        nh = tl.num_programs(1) * G
        n_rows = tl.where(has_group, tl.load(PFX_N + r), 0)
        plen = tl.where(has_group, tl.load(PFX_LEN + r), 0)
        if DYNAMIC:  # the shared keys in prefix_splits parts of whole BLOCK_N tiles (a prompt is short)
            per = tl.cdiv(tl.cdiv(plen, prefix_splits), BLOCK_N) * BLOCK_N
            per = tl.maximum(per, BLOCK_N)
        else:
            per = keys_per_split
        start = sp * per
        end = tl.minimum(start + per, plen)
        m = tl.arange(0, MP)
        i, g = m // G, m % G
        valid = (i < n_rows) & (m < GR * G)
        rows = tl.load(PFX_ROWS + r * GR + i, mask=valid, other=0)
        qh = kh * G + g
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        q = tl.load(
            Q + rows[:, None] * stride_qb + qh[:, None] * stride_qh + dk[None, :],
            mask=valid[:, None] & (dk[None, :] < DK),
            other=0.0,
        )
        m_i = tl.full([MP], float("-inf"), tl.float32)
        l_i = tl.zeros([MP], tl.float32)
        acc = tl.zeros([MP, DVP], tl.float32)
        if DYNAMIC:
            for n0 in range(start, end, BLOCK_N):
                m_i, l_i, acc = _block(
                    q, K, V, TABLE, r, kh, n0, end, m_i, l_i, acc,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_tb, scale,
                    DK, DKP, DV, DVP, BS, BLOCK_N, IEEE,
                )  # fmt: skip
        else:
            for j in range(0, KPS, BLOCK_N):
                m_i, l_i, acc = _block(
                    q, K, V, TABLE, r, kh, start + j, end, m_i, l_i, acc,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_tb, scale,
                    DK, DKP, DV, DVP, BS, BLOCK_N, IEEE,
                )  # fmt: skip
        total = num_splits + prefix_splits
        out = (rows * total + num_splits + sp) * nh + qh
        tl.store(ACC + out[:, None] * DVP + dv[None, :], acc, mask=valid[:, None])
        tl.store(ML + out * 2, m_i, mask=valid)
        tl.store(ML + out * 2 + 1, l_i, mask=valid)

    # Runtime ints that change with the batch are not specialized on (Triton compiles a variant per value
    # class: == 1, multiple of 16): one compiled kernel serves every decode batch size.
    @triton.jit(
        do_not_specialize=[
            "keys_per_split",
            "num_splits",
            "prefix_keys_per_split",
            "prefix_splits",
            "num_groups",
        ]
    )
    def _paged_decode_kernel(
        Q,
        K,
        V,
        TABLE,
        LENS,
        ACC,
        ML,
        PFX_START,
        PFX_LEADERS,
        PFX_N,
        PFX_LEN,
        PFX_ROWS,
        stride_qb,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_tb,
        keys_per_split,
        num_splits,
        prefix_keys_per_split,
        prefix_splits,
        num_groups,
        scale,
        G: tl.constexpr,
        GP: tl.constexpr,
        GR: tl.constexpr,
        MP: tl.constexpr,
        DK: tl.constexpr,
        DKP: tl.constexpr,
        DV: tl.constexpr,
        DVP: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        DYNAMIC: tl.constexpr,
        KPS: tl.constexpr,
        PKPS: tl.constexpr,
        HAS_PFX: tl.constexpr,
    ):
        """Grid (NG * SP + B * S, nkv): with groups (HAS_PFX) the first NG * SP programs are the group
        slots' (``_group_program``, slot-major), the rest the rows' (``_row_program``, row-major); one
        launch, so the short group programs run beside the rows' instead of as a launch of their own."""
        pid = tl.program_id(0)
        if HAS_PFX:
            n_group = num_groups * prefix_splits
            if pid < n_group:
                _group_program(
                    Q, K, V, TABLE, PFX_LEADERS, PFX_N, PFX_LEN, PFX_ROWS, ACC, ML,
                    pid // prefix_splits, pid % prefix_splits,
                    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
                    prefix_keys_per_split, num_splits, prefix_splits, scale,
                    G, GR, MP, DK, DKP, DV, DVP, BS, BLOCK_N, IEEE, DYNAMIC, PKPS,
                )  # fmt: skip
            else:
                _row_program(
                    Q, K, V, TABLE, LENS, ACC, ML, (pid - n_group) // num_splits, (pid - n_group) % num_splits,
                    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
                    PFX_START, keys_per_split, num_splits, prefix_splits, scale,
                    G, GP, DK, DKP, DV, DVP, BS, BLOCK_N, IEEE, DYNAMIC, KPS, True,
                )  # fmt: skip
        else:
            _row_program(
                Q, K, V, TABLE, LENS, ACC, ML, pid // num_splits, pid % num_splits,
                stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
                PFX_START, keys_per_split, num_splits, prefix_splits, scale,
                G, GP, DK, DKP, DV, DVP, BS, BLOCK_N, IEEE, DYNAMIC, KPS, False,
            )  # fmt: skip

    @triton.jit(do_not_specialize=["T", "S"])
    def _merge_kernel(
        ACC,
        ML,
        OUT,
        PFX_START,
        T,
        S,
        stride_ob,
        stride_oh,
        TP: tl.constexpr,
        DV: tl.constexpr,
        DVP: tl.constexpr,
        HAS_PFX: tl.constexpr,
    ):
        """Program (row b, head h): the partial softmaxes of (b, h) (S splits, then T - S shared-prefix
        splits, read only for a row in a group: PFX_START[b] > 0; ACC [B, T, nh, DVP], ML [B, T, nh, 2]
        float32) merged by log-sum-exp (flash-decoding): out = sum_s w_s acc_s / sum_s w_s l_s with
        w_s = exp(m_s - max_s m_s); an empty split has m = -inf, l = 0; a row with no key gets 0."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        nh = tl.num_programs(1)
        s = tl.arange(0, TP)
        smask = s < S
        if HAS_PFX:
            smask = s < tl.where(tl.load(PFX_START + b) > 0, T, S)
        part = (b * T + s) * nh + h
        m = tl.load(ML + part * 2, mask=smask, other=float("-inf"))
        lsum = tl.load(ML + part * 2 + 1, mask=smask, other=0.0)
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m - top)
        den = tl.maximum(tl.sum(w * lsum, 0), 1e-30)
        dv = tl.arange(0, DVP)
        acc = tl.load(ACC + part[:, None] * DVP + dv[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, 0) / den
        tl.store(OUT + b * stride_ob + h * stride_oh + dv, out.to(OUT.dtype.element_ty), mask=dv < DV)

    @triton.jit
    def _write_kernel(
        KN,
        VN,
        K,
        V,
        SLOTS,
        stride_knb,
        stride_knh,
        stride_vnb,
        stride_vnh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        DK: tl.constexpr,
        DKP: tl.constexpr,
        DV: tl.constexpr,
        DVP: tl.constexpr,
    ):
        """Program (row b, kv head h): row b's new key and value of head h into its token slot."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        slot = tl.load(SLOTS + b).to(tl.int64)
        dk = tl.arange(0, DKP)
        k = tl.load(KN + b * stride_knb + h * stride_knh + dk, mask=dk < DK)
        tl.store(K + slot * stride_kt + h * stride_kh + dk, k.to(K.dtype.element_ty), mask=dk < DK)
        dv = tl.arange(0, DVP)
        v = tl.load(VN + b * stride_vnb + h * stride_vnh + dv, mask=dv < DV)
        tl.store(V + slot * stride_vt + h * stride_vh + dv, v.to(V.dtype.element_ty), mask=dv < DV)


def prefix_max_groups(rows: int) -> int:
    """Group slots of the shared-prefix pass for a decode batch of ``rows`` rows: ``rows // 4`` (at least
    1), the groups a batch holds when they have 4 rows or more (GRPO groups have 4-16 samples). The pass
    launches one program per slot, kv head and split, so slots beyond the batch's groups cost idle
    programs: one per row (as before) made the pass slower than the keys it read at B = 256. Groups past
    the slots are not named to the kernel (their rows read their prompt themselves: the same attention)."""
    return max(1, rows // 4)


def prefix_group_rows(heads_per_kv: int) -> int:
    """GR, the most rows one shared-prefix program serves: a query tile of about 32 rows (GR x G, G query
    heads per kv head), at most 16 rows (a GRPO group of 16 samples); 1 (no sharing) for G >= 32."""
    return max(1, min(16, 32 // max(heads_per_kv, 1)))


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """Rows of a decode batch that share leading cache blocks (a group's prompt; ``PagedCachePolicy`` finds
    them), attended once per group by ``_group_program``. Device tensors over the batch's B rows;
    a group is named at its leader row (its first member).

    Attributes:
        leaders: [NG] int64, the leader row of each group slot (``prefix_max_groups(B)`` slots), -1 for
            a slot with no group; the kernel launches over these.
        n: [B] int32, rows in the group led by this row (>= 2), 0 for a row that leads none.
        length: [B] int64, keys the group shares at its leader (a multiple of the block size, below every
            member's length), 0 elsewhere.
        rows: [B, GR] int64, the group's member rows at its leader (leader first; ``prefix_group_rows``).
        start: [B] int64, per row: keys 0..start-1 are attended by its group's program (its group's
            ``length``, 0 for a row in no group); the row's own program attends start..length-1.
    """

    leaders: torch.Tensor
    n: torch.Tensor
    length: torch.Tensor
    rows: torch.Tensor
    start: torch.Tensor


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_size: int,
    *,
    prefix: PrefixGroups | None = None,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode attention over a paged cache (shapes in the module docstring); returns [B, nh, Dv].

    Runs the Triton kernel where ``paged_decode_supported`` (or when Triton runs in its interpreter,
    ``TRITON_INTERPRET=1``, on CPU tensors), else ``paged_decode_reference``. Rows with length 0 give 0.

    ``prefix``: rows sharing leading blocks (``PrefixGroups``): with the kernel, each group's shared keys
    are read once for all its rows (cascade attention: the same softmax, merged by log-sum-exp as the
    splits are); the tensor-op path reads every row's keys whole, as without.

    ``block_n`` keys per step, ``num_warps``, ``num_stages``: the Triton launch; the defaults were the
    fastest of 27 configurations on the H200 over four cases (bench/results/paged_attention_sweep.json).

    Raises:
        ValueError: shapes that do not fit together (nh not a multiple of nkv, a table that is not [B, W]).
    """
    b, nh, dk = q.shape
    nkv, dv = k_cache.shape[1], v_cache.shape[2]
    if nh % nkv or table.shape[0] != b or lengths.shape != (b,) or k_cache.shape[2] != dk:
        raise ValueError(
            f"paged decode: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, table {tuple(table.shape)}, "
            f"lengths {tuple(lengths.shape)} do not fit together"
        )
    if not paged_decode_kernel_runs(k_cache):
        return paged_decode_reference(q, k_cache, v_cache, table, lengths, scale, block_size)
    g = nh // nkv
    keys = table.shape[1] * block_size
    splits, per = _num_splits(b, nkv, keys, block_n)
    prefix_splits, prefix_per = (
        _prefix_splits(prefix.leaders.shape[0], nkv, keys, block_n) if prefix is not None else (0, 0)
    )
    dvp = triton.next_power_of_2(dv)
    dkp = max(16, triton.next_power_of_2(dk))
    acc = torch.empty(b, splits + prefix_splits, nh, dvp, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, splits + prefix_splits, nh, 2, dtype=torch.float32, device=q.device)
    if q.stride(2) != 1:
        q = q.contiguous()
    # one launch: the group slots' programs, then the rows' (without groups, ``lengths`` stands in unread)
    groups, gr = (prefix.leaders.shape[0], prefix.rows.shape[1]) if prefix is not None else (0, 1)
    pfx = prefix if prefix is not None else PrefixGroups(lengths, lengths, lengths, lengths, lengths)
    _paged_decode_kernel[(groups * prefix_splits + b * splits, nkv)](
        q, k_cache, v_cache, table, lengths, acc, ml,
        pfx.start, pfx.leaders, pfx.n, pfx.length, pfx.rows,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0),
        per, splits, prefix_per, prefix_splits, groups, scale,
        G=g, GP=max(16, triton.next_power_of_2(g)), GR=gr, MP=max(16, triton.next_power_of_2(gr * g)),
        DK=dk, DKP=dkp, DV=dv, DVP=dvp, BS=block_size, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, DYNAMIC=q.is_cuda,
        KPS=0 if q.is_cuda else per, PKPS=0 if q.is_cuda else prefix_per,
        HAS_PFX=prefix is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    # merge the splits (flash-decoding) in one launch: ~12 tensor ops per layer before, each a kernel
    total = splits + prefix_splits
    out = torch.empty(b, nh, dv, dtype=q.dtype, device=q.device)
    _merge_kernel[(b, nh)](
        acc, ml, out, lengths if prefix is None else prefix.start, total, splits, out.stride(0), out.stride(1),
        TP=_merge_tile(total), DV=dv, DVP=dvp, HAS_PFX=prefix is not None,
    )  # fmt: skip
    return out


def _merge_tile(total: int) -> int:
    """TP, the merge kernel's tile of partial results (>= ``total`` splits): 4, else 32 (the most a table of
    up to 8k keys gives: 17 row splits and 8 prefix splits at B = 1). Two values, two compiled variants:
    a power of two per total compiled up to six while a run's batch sizes came and went."""
    return 4 if total <= 4 else max(32, triton.next_power_of_2(total))


def paged_decode_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """One decode step's keys and values into their token slots, both in one launch (two ``index_copy_``
    before): ``k_cache[slots[b], h] = k[b, h]``, ``v_cache[slots[b], h] = v[b, h]``.

    Args:
        k_cache: [N, nkv, Dk], v_cache: [N, nkv, Dv] one layer's cache (``paged_decode_kernel_runs``).
        slots: [B] int64 token slots. k: [B, nkv, Dk], v: [B, nkv, Dv] (rows may be strided, the last
            dim contiguous; cast to the cache's dtype).
    """
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    b, nkv, dk = k.shape
    dv = v.shape[-1]
    _write_kernel[(b, nkv)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        DK=dk, DKP=triton.next_power_of_2(dk), DV=dv, DVP=triton.next_power_of_2(dv),
    )  # fmt: skip


def paged_decode_kernel_runs(k_cache: torch.Tensor) -> bool:
    """Whether a decode over this cache runs the kernel: ``paged_decode_supported`` or the interpreter."""
    return paged_decode_supported(k_cache) or _interpreting(k_cache)


def _interpreting(t: torch.Tensor) -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``: tests run the kernel on CPU tensors)."""
    return triton is not None and not t.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"
