"""Row movement of the EP dispatchers: gathers from two row sources, weighted gather-sums and their
backward, fused into single Triton kernels on CUDA, with tensor-op references elsewhere.

Shape legend: A rows of the first source, B rows of the second, M output rows, T tokens, k slots per
token, H channels per row. A row index ``i`` addresses ``cat([a, b])`` without forming it: rows
``i < A`` come from ``a``, rows ``i >= A`` from ``b[i - A]``; ``-1`` means "no row" (a zero).

Why two sources: a dispatcher's own rows never need the wire. The flat dispatcher gathers the rows a
rank keeps straight from its tokens (source ``a`` = x) and the rows other ranks sent from the
all-to-all's receive buffer (source ``b``) into the expert-sorted output in one pass, and its combine
sums each token's k expert outputs from the local outputs (``a`` = y) and the rows sent back (``b``)
in one pass, weighted and accumulated in float32, without concatenating the two.

The Triton kernels run one program per output row; the tensor-op paths (CPU, float64, no Triton)
compute the same function and are what the unit tests check; ``bench/gpu_checks.py`` checks the
kernels against them on a GPU.
"""

from __future__ import annotations

import math

import torch

try:  # Triton is optional: CPU installs use the tensor-op paths.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value: per-row scales map each row's absolute maximum to it."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _use_triton(*ts: torch.Tensor) -> bool:
    return (
        triton is not None
        and all(t.is_cuda for t in ts)
        and all(t.dtype != torch.float64 for t in ts if t.is_floating_point())
    )


if triton is not None:

    @triton.jit
    def _token_slots(pos_ptr, t, NA, K: tl.constexpr, KP: tl.constexpr):
        # Token t's K slots (padded to KP): j, the slot mask, the row p of each slot in cat(a, b) (-1 for
        # none and for the padding) and whether that row is in a or in b.
        j = tl.arange(0, KP)
        jm = j < K
        p = tl.load(pos_ptr + t * K + j, mask=jm, other=-1).to(tl.int64)
        return j, jm, p, (p >= 0) & (p < NA), p >= NA

    @triton.jit
    def _slot_rows_f32(a_ptr, b_ptr, p, in_a, in_b, offs, hm, NA, H: tl.constexpr):
        # The [KP, BLOCK_H] tile cat(a, b)[p, offs] in float32: 0 for slots with no row and columns >= H.
        ya = tl.load(a_ptr + p[:, None] * H + offs[None, :], mask=in_a[:, None] & hm[None, :], other=0.0)
        yb = tl.load(
            b_ptr + (p - NA)[:, None] * H + offs[None, :], mask=in_b[:, None] & hm[None, :], other=0.0
        )
        return tl.where(in_a[:, None], ya, yb).to(tl.float32)

    @triton.jit
    def _chunk_buckets(ids_ptr, local_ptr, c, S, E, NB: tl.constexpr, BLOCK: tl.constexpr):
        # Slots s of chunk c (BLOCK slots), the in-range mask sm, their ids, the valid-id mask ok, the
        # buckets b = arange(NB) and hit[s, b]: slot s in bucket b (local_index[id] for ids in [0, E),
        # E, the last bucket, for -1 and out-of-range ids).
        s = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        sm = s < S
        ids = tl.load(ids_ptr + s, mask=sm, other=-1)
        ok = (ids >= 0) & (ids < E)
        bucket = tl.where(ok, tl.load(local_ptr + tl.where(ok, ids, 0), mask=sm & ok, other=E), E)
        b = tl.arange(0, NB)
        hit = (bucket[:, None] == b[None, :]) & sm[:, None]
        return s, sm, ids, ok, b, hit

    @triton.jit
    def _gather_rows2_kernel(
        a_ptr,
        b_ptr,
        src_ptr,
        scale_ptr,
        out_ptr,
        NA,
        H: tl.constexpr,
        BLOCK: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        # out[m] = (cat(a, b)[src[m]]) * scale[src[m]] (scale only when SCALED), one program per row.
        m = tl.program_id(0).to(tl.int64)
        s = tl.load(src_ptr + m).to(tl.int64)
        in_a = s < NA
        if SCALED:
            sc = tl.load(scale_ptr + s)
        for h0 in range(0, H, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            hm = offs < H
            va = tl.load(a_ptr + s * H + offs, mask=hm & in_a, other=0.0)
            vb = tl.load(b_ptr + (s - NA) * H + offs, mask=hm & (s >= NA), other=0.0)
            v = tl.where(in_a, va, vb)
            if SCALED:
                v = v.to(tl.float32) * sc
            tl.store(out_ptr + m * H + offs, v.to(out_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def _gather_sum2_kernel(
        a_ptr,
        b_ptr,
        pos_ptr,
        w_ptr,
        out_ptr,
        NA,
        H: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # out[t] = sum_j w[t, j] * cat(a, b)[pos[t, j]] in float32; pos = -1 contributes nothing.
        t = tl.program_id(0).to(tl.int64)
        j, jm, p, in_a, in_b = _token_slots(pos_ptr, t, NA, K, KP)
        if HAS_W:
            w = tl.load(w_ptr + t * K + j, mask=jm, other=0.0).to(tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            hm = offs < H
            y = _slot_rows_f32(a_ptr, b_ptr, p, in_a, in_b, offs, hm, NA, H)
            if HAS_W:
                y = y * w[:, None]
            tl.store(out_ptr + t * H + offs, tl.sum(y, axis=0), mask=hm)

    @triton.jit
    def _gather_sum2_bwd_kernel(
        g_ptr,
        a_ptr,
        b_ptr,
        pos_ptr,
        w_ptr,
        ga_ptr,
        gb_ptr,
        gw_ptr,
        NA,
        H: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # For each slot (t, j) with a row: grad row w[t, j] g[t] to that row of ga or gb, and
        # gw[t, j] = <g[t], row>; gw = 0 for empty slots.
        t = tl.program_id(0).to(tl.int64)
        j, jm, p, in_a, in_b = _token_slots(pos_ptr, t, NA, K, KP)
        w = tl.load(w_ptr + t * K + j, mask=jm, other=0.0).to(tl.float32)
        dots = tl.zeros([KP], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            hm = offs < H
            ma, mb = in_a[:, None] & hm[None, :], in_b[:, None] & hm[None, :]
            g = tl.load(g_ptr + t * H + offs, mask=hm, other=0.0).to(tl.float32)
            y = _slot_rows_f32(a_ptr, b_ptr, p, in_a, in_b, offs, hm, NA, H)
            dots += tl.sum(y * g[None, :], axis=1)
            gy = w[:, None] * g[None, :]
            tl.store(ga_ptr + p[:, None] * H + offs[None, :], gy.to(ga_ptr.dtype.element_ty), mask=ma)
            tl.store(gb_ptr + (p - NA)[:, None] * H + offs[None, :], gy.to(gb_ptr.dtype.element_ty), mask=mb)
        tl.store(gw_ptr + t * K + j, dots, mask=jm)

    @triton.jit
    def _slot_hist_kernel(
        ids_ptr, local_ptr, hist_ptr, cmin_ptr, cmax_ptr, S, C, E, NB: tl.constexpr, BLOCK: tl.constexpr
    ):
        # hist[b, c] = slots of chunk c (BLOCK slots) in bucket b: b = local_index[id] for ids in [0, E),
        # b = E (the last bucket) for -1 and out-of-range ids; cmin/cmax[c] = the chunk's id range.
        c = tl.program_id(0)
        s, sm, ids, ok, b, hit = _chunk_buckets(ids_ptr, local_ptr, c, S, E, NB, BLOCK)
        tl.store(hist_ptr + b * C + c, tl.sum(hit.to(tl.int32), axis=0), mask=b <= E)
        tl.store(cmin_ptr + c, tl.min(tl.where(sm, ids, 2**62), axis=0))
        tl.store(cmax_ptr + c, tl.max(tl.where(sm, ids, -(2**62)), axis=0))

    @triton.jit
    def _slot_place_kernel(
        ids_ptr, local_ptr, w_ptr, cum_ptr, hist_ptr, cmin_ptr, cmax_ptr,
        order_ptr, row_ptr, pos_ptr, rw_ptr, counts_ptr, info_ptr,
        S, C, E, K: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr,
    ):  # fmt: skip
        # Stable counting sort of the slots by bucket: row of slot s = (slots of lower buckets) + (slots
        # of its bucket in earlier chunks) + (its rank among its chunk's slots of that bucket). Writes
        # order[row] = s, row_ptr[row] = s // K (its token), rw[row] = w[s], pos[s] = row (-1 for the
        # last bucket); program 0 also writes counts[b] (b < E) and info = (min id, max id, valid slots).
        c = tl.program_id(0)
        s, sm, ids, ok, b, hit = _chunk_buckets(ids_ptr, local_ptr, c, S, E, NB, BLOCK)
        bm = b <= E
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
        base = tl.load(cum_ptr + b * C + c, mask=bm, other=0) - tl.load(
            hist_ptr + b * C + c, mask=bm, other=0
        )
        row = tl.sum(tl.where(hit, base[None, :] + rank, 0), axis=1).to(tl.int64)
        tl.store(order_ptr + row, s, mask=sm)
        tl.store(row_ptr + row, s // K, mask=sm)
        tl.store(rw_ptr + row, tl.load(w_ptr + s, mask=sm, other=0.0).to(tl.float32), mask=sm)
        tl.store(pos_ptr + s, tl.where(ok, row, -1), mask=sm)
        if c == 0:
            ends = tl.load(cum_ptr + b * C + C - 1, mask=bm, other=0)
            prev = tl.load(cum_ptr + b * C - 1, mask=bm & (b > 0), other=0)
            tl.store(counts_ptr + b, ends - prev, mask=b < E)
            lo = tl.full([CBLOCK], 2**62, tl.int64)
            hi = tl.full([CBLOCK], -(2**62), tl.int64)
            for c0 in range(0, C, CBLOCK):
                cc = c0 + tl.arange(0, CBLOCK)
                lo = tl.minimum(lo, tl.load(cmin_ptr + cc, mask=cc < C, other=2**62))
                hi = tl.maximum(hi, tl.load(cmax_ptr + cc, mask=cc < C, other=-(2**62)))
            tl.store(info_ptr, tl.min(lo, axis=0))
            tl.store(info_ptr + 1, tl.max(hi, axis=0))
            tl.store(info_ptr + 2, tl.load(cum_ptr + E * C - 1))

    @triton.jit
    def _quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, H, FMAX: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row: scale = max|x| / FMAX (1 for an all-zero row), q = x / scale in e4m3.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, amax / FMAX, 1.0)
        q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
        tl.store(q_ptr + row * H + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def _meta(h: int, k: int) -> dict:
    kp = triton.next_power_of_2(max(k, 1))
    return dict(K=k, KP=kp, BLOCK_H=min(triton.next_power_of_2(h), max(64, 4096 // kp)))


def _flat(rows: torch.Tensor) -> torch.Tensor:
    return rows.reshape(rows.shape[0], math.prod(rows.shape[1:])).contiguous()


def gather_rows2(
    a: torch.Tensor,
    b: torch.Tensor,
    src: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out[m] = cat([a, b])[src[m]], times ``scale[src[m]]`` when given (dequantization).

    Args:
        a: [A, ...] rows. b: [B, ...] rows of a's dtype and per-row shape. src: [M] int64 in [0, A + B).
        scale: optional [A + B] float32 per-source-row factor (FP8 payloads: the row's scale).
        out_dtype: dtype of the output (default a's).
    Returns:
        [M, ...] rows of ``out_dtype``; no autograd.
    """
    out_dtype = out_dtype or a.dtype
    shape = a.shape[1:]
    if _use_triton(a, b, src) and src.numel():
        af, bf = _flat(a), _flat(b)
        h = af.shape[1] if a.shape[0] else bf.shape[1]
        out = torch.empty(src.shape[0], h, dtype=out_dtype, device=a.device)
        block = min(triton.next_power_of_2(max(h, 1)), 4096)
        _gather_rows2_kernel[(src.shape[0],)](
            af, bf, src, scale if scale is not None else src, out, a.shape[0], H=h, BLOCK=block,
            SCALED=scale is not None,
        )  # fmt: skip
        return out.view(src.shape[0], *shape)
    rows = torch.cat([a, b]).index_select(0, src)
    if scale is None:
        return rows.to(out_dtype)
    view = scale.index_select(0, src).view(-1, *([1] * len(shape)))
    return (rows.float() * view).to(out_dtype)


def gather_sum2(
    a: torch.Tensor, b: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * cat([a, b])[pos[t, j]] (w = 1 without ``weights``), pos = -1 adds nothing.

    Args:
        a: [A, H], b: [B, H] rows of one dtype. pos: [T, k] int64 in [-1, A + B).
        weights: optional [T, k] float weights.
    Returns:
        [T, H] float32 (float64 for float64 rows); sums in slot order j = 0, 1, ... on the tensor-op path,
        a fixed tree order in the kernel (both deterministic). No autograd.
    """
    acc = accumulation_dtype(a.dtype)
    t, k = pos.shape
    h = a.shape[1] if a.dim() == 2 else b.shape[1]
    if _use_triton(a, b, pos) and t:
        out = torch.empty(t, h, dtype=acc, device=a.device)
        w = weights.float().contiguous() if weights is not None else pos
        _gather_sum2_kernel[(t,)](
            a.contiguous(), b.contiguous(), pos.contiguous(), w, out, a.shape[0], h,
            HAS_W=weights is not None, **_meta(h, k),
        )  # fmt: skip
        return out
    padded = torch.cat([a.to(acc), b.to(acc), a.new_zeros(1, h, dtype=acc)])
    idx = torch.where(pos >= 0, pos, padded.shape[0] - 1)
    out = padded.new_zeros(t, h)
    for j in range(k):
        row = padded.index_select(0, idx[:, j])
        out += row if weights is None else weights[:, j, None].to(acc) * row
    return out


def gather_sum2_backward(
    g: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``gather_sum2`` with weights, for a ``pos`` that names every row of a and b exactly once.

    Args:
        g: [T, H] gradient of the output. a, b, pos, weights: as in ``gather_sum2``.
    Returns:
        (grad_a [A, H], grad_b [B, H]) in a's dtype, grad_a[pos[t, j]] = w[t, j] g[t] (likewise for b);
        grad_w [T, k] in weights' dtype, <g[t], cat(a, b)[pos[t, j]]>, 0 for empty slots.
    """
    t, k = pos.shape
    h = g.shape[1]
    na, nb = a.shape[0], b.shape[0]
    if _use_triton(g, a, b, pos) and t:
        ga = torch.empty(na, h, dtype=a.dtype, device=a.device)
        gb = torch.empty(nb, h, dtype=a.dtype, device=a.device)
        gw = torch.empty(t, k, dtype=torch.float32, device=a.device)
        _gather_sum2_bwd_kernel[(t,)](
            g.contiguous(), a.contiguous(), b.contiguous(), pos.contiguous(), weights.float().contiguous(),
            ga, gb, gw, na, h, **_meta(h, k),
        )  # fmt: skip
        return ga, gb, gw.to(weights.dtype)
    acc = accumulation_dtype(a.dtype)
    rows = torch.cat([a.to(acc), b.to(acc), a.new_zeros(1, h, dtype=acc)])
    idx = torch.where(pos >= 0, pos, na + nb)
    g_acc = g.to(acc)
    gw = (rows[idx] * g_acc[:, None, :]).sum(-1).to(weights.dtype)
    grad = torch.zeros(na + nb + 1, h, dtype=a.dtype, device=a.device)
    grad[idx.reshape(-1)] = (weights.to(acc)[:, :, None] * g_acc[:, None, :]).reshape(-1, h).to(a.dtype)
    return grad[:na], grad[na : na + nb], gw


def single_rank_layout(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, local_index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, ...]:
    """The routing plan of an EP group of one rank, without a host sync: a stable counting sort of the
    S = T k slots by local expert, with -1 and out-of-range ids (not checked here) sorted last.

    Args:
        topk_idx: [T, k] int64 expert ids (valid: [0, E); -1 = empty slot; anything else is treated as
            empty here and reported through ``info``).
        topk_weights: [T, k] float router weights.
        local_index: [E] int64 local position of each expert (a permutation of [0, E) at world size 1).
        num_experts: E.
    Returns:
        order [S] int64 (row r holds slot order[r]; valid slots first, by local expert, then slot),
        row_token [S] int64 (= order // k), slot_row [T, k] int64 (row of each slot, -1 for an empty or
        invalid one), row_weight [S] float32 (= w[order]), counts [E] int64 (valid copies per local
        expert, local order) and info [3] int64 (min id, max id, number of valid slots M), all on the ids'
        device; the first M rows are the plan's copies. On CUDA two Triton launches and one cumulative
        sum; elsewhere ``torch.sort`` and tensor ops (the kernels' reference).
    """
    t, k = topk_idx.shape
    flat, dev = topk_idx.reshape(-1), topk_idx.device
    w = topk_weights.reshape(-1)
    s = flat.numel()
    if not (_use_triton(flat, w) and s):
        ok = (flat >= 0) & (flat < num_experts)
        key = torch.where(ok, local_index[flat.clamp(0, num_experts - 1)], num_experts)
        order = torch.sort(key, stable=True).indices
        rows = torch.arange(s, device=dev)
        slot_row = torch.empty_like(order).scatter_(0, order, rows)
        slot_row = torch.where(ok, slot_row, -1)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(
            0, key, torch.ones_like(key)
        )[:num_experts]
        lo, hi = (flat.min(), flat.max()) if s else (flat.new_tensor(-1), flat.new_tensor(-1))
        info = torch.stack([lo, hi, ok.sum()])
        row_weight = w.to(accumulation_dtype(w.dtype))[order]
        return order, order // max(k, 1), slot_row.view(t, k), row_weight, counts, info
    nb = triton.next_power_of_2(num_experts + 1)
    block = max(16, min(256, 8192 // nb))
    chunks = triton.cdiv(s, block)
    hist = torch.empty((num_experts + 1) * chunks, dtype=torch.int32, device=dev)
    # One allocation for the int64 outputs and scratch (host time per call: one empty and one split
    # instead of seven empties); the large arrays first, so they keep the buffer's alignment.
    buf = torch.empty(3 * s + num_experts + 3 + 2 * chunks, dtype=torch.int64, device=dev)
    order, row_token, slot_row, counts, info, cmin, cmax = buf.split(
        (s, s, s, num_experts, 3, chunks, chunks)
    )
    _slot_hist_kernel[(chunks,)](
        flat, local_index, hist, cmin, cmax, s, chunks, num_experts, NB=nb, BLOCK=block
    )
    cum = hist.cumsum(0)  # int64, bucket-major then chunk
    row_weight = torch.empty(s, dtype=torch.float32, device=dev)
    _slot_place_kernel[(chunks,)](
        flat, local_index, w.contiguous(), cum, hist, cmin, cmax, order, row_token, slot_row, row_weight,
        counts, info, s, chunks, num_experts, K=k, NB=nb, BLOCK=block,
        CBLOCK=min(1024, triton.next_power_of_2(chunks)),
    )  # fmt: skip
    return order, row_token, slot_row.view(t, k), row_weight, counts, info


def gather_slots2(a: torch.Tensor, b: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out[t, j] = cat([a, b])[pos[t, j]], 0 where pos = -1; a [A], b [B], pos [T, k] -> [T, k]."""
    vals = torch.cat([a, b, a.new_zeros(1)])
    return vals[torch.where(pos >= 0, pos, vals.shape[0] - 1)]


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 quantization: x [T, H] -> (q [T, H] float8_e4m3fn, scale [T] float32), x ~ q * scale.

    scale = max|x_row| / 448 (the largest e4m3 value; 1 for an all-zero row), as DeepEP's FP8 dispatch
    and DeepSeek-V3's fine-grained quantization (arXiv:2412.19437, sec. 3.3.2) do per group of values.
    On CUDA one Triton kernel (one pass over x); elsewhere tensor ops, its reference.
    """
    if _use_triton(x) and x.dim() == 2 and x.shape[0] and x.shape[1] <= 16384:  # one kernel, one pass
        x = x.contiguous()
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        _quantize_fp8_kernel[(x.shape[0],)](
            x, q, scale, x.shape[1], FMAX=FP8_MAX, BLOCK=triton.next_power_of_2(x.shape[1])
        )
        return q, scale
    amax = x.abs().amax(-1).float() if x.shape[0] else x.new_zeros(0, dtype=torch.float32)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def positions_of_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the True entries of a 1-D bool mask, in order, when their number ``count`` is known:
    ``torch.nonzero`` without its device sync. Returns [count] int64."""
    rank = mask.long().cumsum(0) - 1
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, torch.where(mask, rank, count), torch.arange(mask.numel(), device=mask.device))
    return out[:count]
