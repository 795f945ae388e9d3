"""Attention in plain PyTorch: the naive reference the tests trust, and the FlashAttention
tiled algorithms written out as executable documentation.

Layout everywhere: ``q`` is ``(batch, seqlen_q, nheads, headdim)``, ``k`` / ``v`` are
``(batch, seqlen_k, nheads_k, headdim)``, ``out`` is shaped like ``q`` and ``lse`` is
``(batch, nheads, seqlen_q)``, natural log. The conventions are flash_attn 2.x's (see
ARCHITECTURE.md):

- causal and local masks align to the bottom-right corner: query row ``i`` sits on key
  ``i + seqlen_k - seqlen_q`` (its *diagonal*);
- a query row that sees no key outputs 0 and has ``lse = +inf``;
- GQA / MQA: query head ``h`` reads K/V head ``h // (nheads // nheads_k)``.

This module imports nothing but torch, so it works without the CUDA extension and can be
copied out on its own.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "attention_mask",
    "alibi_bias",
    "attention_probs",
    "attention_ref",
    "attention_varlen_probs",
    "attention_varlen_ref",
    "attention_kvcache_ref",
    "apply_rotary",
    "flash_attn1_tiled",
    "flash_attn2_tiled",
    "flash_attn2_tiled_backward",
]


# ---- shared pieces ---------------------------------------------------------------------------

def _shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, seqlen, nheads, headdim); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        raise ValueError(f"k must be (batch, seqlen_k, nheads_k, {d}) and v (batch, seqlen_k, "
                         f"nheads_k, headdim_v); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"nheads ({h}) must be a multiple of nheads_k ({hk})")
    return b, sq, sk, h, hk, d


def _repeat_kv(x: Tensor, nheads: int) -> Tensor:
    """(b, s, hk, d) -> (b, s, nheads, d), query head h reading K/V head h // (nheads // hk).

    A kernel indexes the shared head instead of copying it; a copy keeps the algorithms below
    free of head bookkeeping.
    """
    return x.repeat_interleave(nheads // x.shape[2], dim=2)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation precision: float64 for float64 inputs, float32 for everything narrower."""
    return torch.promote_types(dtype, torch.float32)


def attention_mask(seqlen_q: int, seqlen_k: int, causal: bool = False,
                   window_size: tuple[int, int] = (-1, -1), device=None) -> Tensor:
    """``(seqlen_q, seqlen_k)`` bool, True where query row ``i`` may see key ``j``.

    With ``diag = i + seqlen_k - seqlen_q`` and ``window_size = (left, right)`` (``-1`` is
    unbounded), key ``j`` is visible iff ``diag - left <= j <= diag + right``. ``causal`` is
    the window ``(left, 0)``, exactly as flash_attn 2.x treats it.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + seqlen_k - seqlen_q
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= j >= diag - left
    return visible


def alibi_bias(alibi_slopes: Tensor, seqlen_q: int, seqlen_k: int) -> Tensor:
    """ALiBi bias ``-slope * |i + seqlen_k - seqlen_q - j|``, shaped ``(b or 1, h, sq, sk)``.

    ``alibi_slopes`` is ``(nheads,)`` or ``(batch, nheads)``. flash_attn 2.x's kernel adds
    ``slope * j`` instead when causal; on the visible keys the two differ by a per-row
    constant, so the output is the same, but the lse of that kernel is shifted by it.
    """
    slopes = alibi_slopes.to(torch.float64)
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)
    i = torch.arange(seqlen_q, device=slopes.device, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(seqlen_k, device=slopes.device, dtype=torch.float64).unsqueeze(0)
    distance = (i + seqlen_k - seqlen_q - j).abs()
    return -slopes[:, :, None, None] * distance


# ---- the naive reference ---------------------------------------------------------------------

def attention_probs(q: Tensor, k: Tensor, causal: bool, window_size: tuple[int, int],
                    softcap: float, alibi_slopes: Tensor | None,
                    softmax_scale: float) -> tuple[Tensor, Tensor]:
    """(probabilities ``(b, h, sq, sk)`` in q's dtype, lse ``(b, h, sq)``) of
    :func:`attention_ref`, before dropout: rows that see no key are 0 with lse +inf."""
    sq, sk, h = q.shape[1], k.shape[1], q.shape[2]
    dtype = q.dtype
    acc = _acc_dtype(dtype)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * softmax_scale, _repeat_kv(k, h))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(q.device), sq, sk).to(dtype)
    visible = attention_mask(sq, sk, causal, window_size, device=q.device)
    has_key = visible.any(dim=-1, keepdim=True)  # (sq, 1)
    # A row that sees no key gets finite dummy scores, so neither softmax nor its backward makes
    # a NaN; its probabilities are zeroed below. (-inf everywhere would give 0/0.)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~has_key, 0.0)
    lse = torch.logsumexp(scores.to(acc), dim=-1).masked_fill(~has_key.squeeze(-1), math.inf)
    p = torch.softmax(scores.to(acc), dim=-1).masked_fill(~has_key, 0.0).to(dtype)
    return p, lse


def attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                  window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: Tensor | None = None, softmax_scale: float | None = None,
                  upcast: bool = True, dropout_p: float = 0.0,
                  dropout_mask: Tensor | None = None, return_lse: bool = False):
    """Naive attention with flash_attn 2.x semantics; the truth the tests compare against.

    ``upcast=True``: everything in float64, and the result is float64 (``lse`` too).
    ``upcast=False``: the computation plain PyTorch user code does at the input precision:
    ``q * scale`` and ``Q K^T`` in the input dtype, softmax in float32 then cast back, ``P V``
    in the input dtype; the output has the input dtype, ``lse`` is float32. Its error against
    the float64 result is the yardstick for a kernel's error.

    Order of operations, as in flash_attn: scale, softcap (``softcap * tanh(s / softcap)``),
    ALiBi bias (:func:`alibi_bias`), mask (:func:`attention_mask`), softmax, dropout.
    ``dropout_mask`` is ``(batch, nheads, seqlen_q, seqlen_k)`` bool, True = keep; kept
    probabilities are scaled by ``1 / (1 - dropout_p)``. ``lse`` ignores dropout.

    Returns ``out``, or ``(out, lse)`` with ``return_lse=True``.
    """
    b, sq, sk, h, hk, d = _shapes(q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if upcast:
        q, k, v = (x.to(torch.float64) for x in (q, k, v))
    v = _repeat_kv(v, h)
    p, lse = attention_probs(q, k, causal, window_size, softcap, alibi_slopes, softmax_scale)
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("attention_ref: dropout_p > 0 needs the dropout_mask to apply")
        p = p.masked_fill(~dropout_mask.to(q.device), 0.0) * (1.0 / (1.0 - dropout_p))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return (out, lse) if return_lse else out


def attention_varlen_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, seqused_q: Tensor | None = None,
                         seqused_k: Tensor | None = None, block_table: Tensor | None = None,
                         alibi_slopes: Tensor | None = None, dropout_mask: Tensor | None = None,
                         return_lse: bool = False, **kwargs):
    """:func:`attention_ref` of each sequence of a packed (variable-length) batch, with
    ``flash_attn_varlen_func``'s layouts: q ``(total_q, nheads, headdim)``, k / v
    ``(total_k, nheads_k, headdim)``; out like q, lse ``(nheads, total_q)``.

    Sequence ``b`` holds the q rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and the k / v rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``, of which only the first ``seqused_q[b]`` /
    ``seqused_k[b]`` take part when given. With ``block_table`` (batch, max_blocks), k / v are a
    paged cache ``(num_blocks, page_block_size, nheads_k, headdim)`` and key ``j`` of sequence
    ``b`` is row ``j % page_block_size`` of page ``block_table[b, j // page_block_size]``;
    cu_seqlens_k then only gives the lengths. Causal and window masks align bottom-right per
    sequence; the window is taken literally (the API first makes a side >= max_seqlen_k
    unbounded). Query rows that do not take part (past seqused_q) are 0 with lse +inf, like
    rows that see no key. ``alibi_slopes``: (nheads,) or (batch, nheads); ``dropout_mask``:
    (batch, nheads, max_seqlen_q, max_seqlen_k), sequence b's in its top-left corner. The other
    keyword arguments are :func:`attention_ref`'s.
    """
    upcast = kwargs.get("upcast", True)
    out = q.new_zeros(q.shape, dtype=torch.float64 if upcast else q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float64 if upcast else
                     torch.float32, device=q.device)
    for b, q0, len_q, k0, len_k in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if len_q == 0:
            continue
        kb, vb = (_sequence_rows(t, b, k0, len_k, block_table) for t in (k, v))
        mask = None if dropout_mask is None else dropout_mask[b:b + 1, :, :len_q, :len_k]
        o, l = attention_ref(q[None, q0:q0 + len_q], kb[None], vb[None],
                             alibi_slopes=_sequence_slopes(alibi_slopes, b), dropout_mask=mask,
                             return_lse=True, **kwargs)
        out[q0:q0 + len_q] = o[0].to(out.dtype)
        lse[:, q0:q0 + len_q] = l[0].to(lse.dtype)
    return (out, lse) if return_lse else out


def attention_varlen_probs(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           seqused_q: Tensor | None, seqused_k: Tensor | None,
                           block_table: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float, causal: bool, window_size: tuple[int, int],
                           softcap: float, alibi_slopes: Tensor | None) -> Tensor:
    """:func:`attention_probs` of each sequence of :func:`attention_varlen_ref`'s batch, in a
    ``(batch, nheads, max_seqlen_q, max_seqlen_k)`` tensor of q's dtype: sequence b in the
    top-left corner of ``[b]``, zeros elsewhere."""
    batch = cu_seqlens_q.shape[0] - 1
    probs = q.new_zeros((batch, q.shape[1], max_seqlen_q, max_seqlen_k))
    for b, q0, len_q, k0, len_k in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        p, _ = attention_probs(q[None, q0:q0 + len_q],
                               _sequence_rows(k, b, k0, len_k, block_table)[None], causal,
                               window_size, softcap, _sequence_slopes(alibi_slopes, b),
                               softmax_scale)
        probs[b, :, :len_q, :len_k] = p[0]
    return probs


def _sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q: Tensor | None,
               seqused_k: Tensor | None) -> list[tuple[int, int, int, int, int]]:
    """(b, first q row, q rows used, first k row, k rows used) of each sequence."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    return [(b, starts_q[b],
             starts_q[b + 1] - starts_q[b] if used_q is None else used_q[b],
             starts_k[b],
             starts_k[b + 1] - starts_k[b] if used_k is None else used_k[b])
            for b in range(len(starts_q) - 1)]


def _sequence_rows(t: Tensor, b: int, first: int, length: int,
                   block_table: Tensor | None) -> Tensor:
    """Rows ``first:first + length`` of packed ``t``, or with ``block_table`` the first
    ``length`` rows of sequence b in the paged ``t`` (num_blocks, page_block_size, ...)."""
    if block_table is None:
        return t[first:first + length]
    rows = torch.arange(length, device=t.device)
    pages = block_table[b].to(device=t.device, dtype=torch.long)[rows // t.shape[1]]
    return t[pages, rows % t.shape[1]]


def _sequence_slopes(alibi_slopes: Tensor | None, b: int) -> Tensor | None:
    """Sequence b's ALiBi slopes: (nheads,) as given, or row b of (batch, nheads)."""
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        return alibi_slopes[b]
    return alibi_slopes


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                 interleaved: bool) -> Tensor:
    """Rotary embedding of ``x`` (..., seqlen, nheads, headdim) at ``positions`` (..., seqlen)
    with the tables ``cos`` / ``sin`` (seqlen_ro, rotary_dim / 2), in x's dtype (computed in
    float64). The first rotary_dim dims rotate in pairs: (2i, 2i + 1) when ``interleaved``
    (GPT-J), (i, i + rotary_dim / 2) otherwise (GPT-NeoX); the rest pass through."""
    half = cos.shape[1]
    c = cos.double()[positions].unsqueeze(-2)      # (..., seqlen, 1, half)
    s = sin.double()[positions].unsqueeze(-2)
    xr = x[..., :2 * half].double()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)


def attention_kvcache_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                          v: Tensor | None = None, rotary_cos: Tensor | None = None,
                          rotary_sin: Tensor | None = None, cache_seqlens=None,
                          cache_batch_idx: Tensor | None = None,
                          cache_leftpad: Tensor | None = None,
                          block_table: Tensor | None = None, rotary_interleaved: bool = True,
                          causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                          alibi_slopes: Tensor | None = None, upcast: bool = True,
                          **kwargs):
    """``flash_attn_with_kvcache``'s semantics (flash_attn 2.x), without touching its inputs:
    returns ``(out, lse, k_cache_after, v_cache_after)``.

    Sequence b uses cache row ``cache_batch_idx[b]`` (default b), or with ``block_table`` a paged
    cache (num_blocks, page_block_size, nheads_k, headdim) whose position j is row
    ``j % page_block_size`` of page ``block_table[b, j // page_block_size]``. The new ``k`` /
    ``v`` (batch, seqlen_new, ...) are written at positions ``cache_seqlens[b] + j`` (k rotated
    there first); the sequence then attends to positions ``cache_leftpad[b]`` (default 0) up
    to ``cache_seqlens[b] + seqlen_new``, with causal / window / ALiBi aligned bottom-right
    within them. q is rotated at ``cache_seqlens[b] + i`` when causal or local, else at
    ``cache_seqlens[b]`` for every row. ``cache_seqlens``: int, int32 (batch,) or None (the
    cache is full). Other keyword arguments are :func:`attention_ref`'s; out and lse come from
    it (float64 with ``upcast``), the caches keep their dtype.
    """
    batch, seqlen_q = q.shape[:2]
    new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None:
        lengths = [capacity - new] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        lengths = cache_seqlens.tolist()
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(batch))
    starts = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    # 2.x's reading of the window: a side >= the cache's capacity is unbounded, and causal is
    # the window (-1, 0); then "local" decides how q is rotated.
    left, right = window_size[0], 0 if causal else window_size[1]
    left, right = (-1 if w >= capacity else w for w in (left, right))
    if left < 0 and right == 0:
        causal, left, right = True, -1, -1
    window_size = (left, right)
    local = window_size != (-1, -1)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()

    def slots(b, positions):
        """Where positions of sequence b live in the cache: an index into its first two dims."""
        if not paged:
            return rows[b], positions
        page = k_cache.shape[1]
        return block_table[b].long().to(positions.device)[positions // page], positions % page

    outs, lses = [], []
    for b in range(batch):
        s0 = lengths[b]
        if k is not None:
            positions = torch.arange(s0, s0 + new, device=q.device)
            kb = k[b]
            if rotary_cos is not None:
                kb = apply_rotary(kb, rotary_cos, rotary_sin, positions, rotary_interleaved)
            k_cache[slots(b, positions)] = kb.to(k_cache.dtype)
            v_cache[slots(b, positions)] = v[b].to(v_cache.dtype)
        qb = q[b]
        if rotary_cos is not None:
            offsets = torch.arange(seqlen_q, device=q.device) if causal or local else \
                torch.zeros(seqlen_q, dtype=torch.long, device=q.device)
            qb = apply_rotary(qb, rotary_cos, rotary_sin, s0 + offsets, rotary_interleaved)
        keys = torch.arange(starts[b], s0 + new, device=q.device)
        kb, vb = k_cache[slots(b, keys)], v_cache[slots(b, keys)]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 \
            else alibi_slopes
        o, l = attention_ref(qb[None], kb[None], vb[None], causal=causal,
                             window_size=window_size, alibi_slopes=slopes, upcast=upcast,
                             return_lse=True, **kwargs)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache


# ---- the tiled algorithms --------------------------------------------------------------------
# Tiles are batched over (batch, head): Q is viewed as (b, h, N, d), and every "block" below is
# a (b, h, rows, d) slice, so one line of PyTorch is one line of the paper for all heads at once.
# Only causal masking is modelled, the feature set of the kernels these document.

def _tile_visible(r0: int, r1: int, c0: int, c1: int, seqlen_q: int, seqlen_k: int,
                  device) -> Tensor:
    """Causal mask of the tile rows [r0, r1) x cols [c0, c1): key j visible iff j <= diag(i)."""
    i = torch.arange(r0, r1, device=device).unsqueeze(1)
    j = torch.arange(c0, c1, device=device).unsqueeze(0)
    return j <= i + seqlen_k - seqlen_q


def _finite_max(m: Tensor) -> Tensor:
    """The row max to subtract before exp: -inf (nothing seen yet) becomes 0, so that
    exp(-inf - m) is 0 instead of exp(-inf - -inf) = NaN. The kernels do the same check."""
    return torch.where(m == -math.inf, torch.zeros_like(m), m)


def _to_bhsd(x: Tensor, nheads: int, dtype: torch.dtype) -> Tensor:
    return _repeat_kv(x, nheads).transpose(1, 2).to(dtype)


def flash_attn1_tiled(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                      softmax_scale: float | None = None, block_q: int = 64,
                      block_k: int = 64) -> tuple[Tensor, Tensor]:
    """FlashAttention forward, Algorithm 1 of Dao et al. 2022 (arXiv:2205.14135).

    The outer loop walks K/V blocks, the inner loop Q blocks; the output ``O`` and the softmax
    statistics ``m`` (running row max) and ``l`` (running row sum) live in HBM and are read,
    rescaled and written back at every step, so ``O`` is normalised after every K/V block.

    ``Br = block_q`` and ``Bc = block_k``. The paper sizes them from the on-chip memory M:
    ``Bc = ceil(M / 4d)``, ``Br = min(Bc, d)``, so that Q_i, K_j, V_j and O_i fit at once.

    Returns ``(out, lse)``: ``out`` in q's dtype, ``lse`` (b, h, seqlen_q) in the accumulation
    precision (float64 for float64 inputs, else float32).
    """
    b, N, sk, h, hk, d = _shapes(q, k, v)
    tau = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    acc = _acc_dtype(q.dtype)
    Q = q.transpose(1, 2).to(acc)       # (b, h, N, d)
    K = _to_bhsd(k, h, acc)             # (b, h, sk, d)
    V = _to_bhsd(v, h, acc)             # (b, h, sk, dv)
    Br, Bc = block_q, block_k
    Tr, Tc = math.ceil(N / Br), math.ceil(sk / Bc)

    # Line 2: O = 0 (N x d), l = 0 (N), m = -inf (N), in HBM.
    O = Q.new_zeros(b, h, N, V.shape[-1])
    l = Q.new_zeros(b, h, N)
    m = Q.new_full((b, h, N), -math.inf)

    for j in range(Tc):                                   # Line 5
        c0, c1 = j * Bc, min((j + 1) * Bc, sk)
        # Line 6: load K_j, V_j from HBM to SRAM.
        K_j, V_j = K[:, :, c0:c1], V[:, :, c0:c1]
        for i in range(Tr):                               # Line 7
            r0, r1 = i * Br, min((i + 1) * Br, N)
            # Causal: a tile whose first key lies past the last row's diagonal is all masked and
            # changes nothing; the kernel skips it, and so does this loop.
            if causal and c0 > (r1 - 1) + sk - N:
                continue
            # Line 8: load Q_i, O_i, l_i, m_i from HBM to SRAM.
            Q_i, O_i, l_i, m_i = Q[:, :, r0:r1], O[:, :, r0:r1], l[:, :, r0:r1], m[:, :, r0:r1]

            # Line 9: S_ij = tau Q_i K_j^T  (Br x Bc), then the causal mask (Algorithm 2).
            S_ij = tau * Q_i @ K_j.transpose(-1, -2)
            if causal:
                S_ij = S_ij.masked_fill(~_tile_visible(r0, r1, c0, c1, N, sk, q.device),
                                        -math.inf)

            # Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
            m_tilde_ij = S_ij.amax(dim=-1)
            P_tilde_ij = torch.exp(S_ij - _finite_max(m_tilde_ij).unsqueeze(-1))
            l_tilde_ij = P_tilde_ij.sum(dim=-1)

            # Line 11: m_i^new = max(m_i, m~_ij),
            #          l_i^new = e^(m_i - m_i^new) l_i + e^(m~_ij - m_i^new) l~_ij.
            m_i_new = torch.maximum(m_i, m_tilde_ij)
            alpha = torch.exp(m_i - _finite_max(m_i_new))        # rescales the old state
            beta = torch.exp(m_tilde_ij - _finite_max(m_i_new))  # rescales this tile
            l_i_new = alpha * l_i + beta * l_tilde_ij

            # Line 12: O_i = diag(l_i^new)^-1 (diag(l_i) e^(m_i - m_i^new) O_i
            #                                  + e^(m~_ij - m_i^new) P~_ij V_j), written to HBM.
            # A row that has seen no key yet has l_i^new = 0 and stays 0.
            numerator = (alpha * l_i).unsqueeze(-1) * O_i + beta.unsqueeze(-1) * (P_tilde_ij @ V_j)
            denominator = torch.where(l_i_new > 0, l_i_new, torch.ones_like(l_i_new))
            O[:, :, r0:r1] = numerator / denominator.unsqueeze(-1)

            # Line 13: l_i = l_i^new, m_i = m_i^new, written to HBM.
            l[:, :, r0:r1] = l_i_new
            m[:, :, r0:r1] = m_i_new

    # The backward pass needs only L = m + log(l) (+inf where a row saw no key).
    lse = torch.where(l > 0, m + torch.log(l), torch.full_like(l, math.inf))
    return O.transpose(1, 2).to(q.dtype), lse


def flash_attn2_tiled(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                      softmax_scale: float | None = None, block_q: int = 64,
                      block_k: int = 64) -> tuple[Tensor, Tensor]:
    """FlashAttention-2 forward, Algorithm 1 of Dao 2023 (arXiv:2307.08691).

    The loops are swapped relative to FA1: the outer loop walks Q blocks (one thread block
    each, in parallel), the inner loop K/V blocks. ``O_i``, ``l_i`` and ``m_i`` stay on chip
    (here: local variables) for the whole inner loop. ``O_i`` is accumulated *unnormalised*:
    each step only rescales it by ``e^(m_old - m_new)``, and the single division by ``l_i``
    happens once, at the end, where the lse is also written.

    Returns ``(out, lse)`` like :func:`flash_attn1_tiled`.
    """
    b, N, sk, h, hk, d = _shapes(q, k, v)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    acc = _acc_dtype(q.dtype)
    Q = q.transpose(1, 2).to(acc)       # (b, h, N, d)
    K = _to_bhsd(k, h, acc)             # (b, h, sk, d)
    V = _to_bhsd(v, h, acc)             # (b, h, sk, dv)
    Br, Bc = block_q, block_k
    Tr, Tc = math.ceil(N / Br), math.ceil(sk / Bc)

    O = Q.new_empty(b, h, N, V.shape[-1])  # written once per row, in the epilogue
    L = Q.new_empty(b, h, N)

    for i in range(Tr):
        r0, r1 = i * Br, min((i + 1) * Br, N)
        Q_i = Q[:, :, r0:r1]
        # On chip: O_i = 0, l_i = 0, m_i = -inf.
        O_i = Q.new_zeros(b, h, r1 - r0, V.shape[-1])
        l_i = Q.new_zeros(b, h, r1 - r0)
        m_i = Q.new_full((b, h, r1 - r0), -math.inf)

        # Causal: stop at the K/V block holding the last row's diagonal; later blocks are all
        # masked. 0 blocks means no row of this tile sees a key.
        n_blocks = Tc
        if causal:
            n_blocks = max(0, min(Tc, math.ceil((r1 + sk - N) / Bc)))
        for j in range(n_blocks):
            c0, c1 = j * Bc, min((j + 1) * Bc, sk)
            K_j, V_j = K[:, :, c0:c1], V[:, :, c0:c1]
            # S_i^(j) = scale Q_i K_j^T, masked.
            S_ij = scale * Q_i @ K_j.transpose(-1, -2)
            if causal:
                S_ij = S_ij.masked_fill(~_tile_visible(r0, r1, c0, c1, N, sk, q.device),
                                        -math.inf)
            # m_i^(j) = max(m_i^(j-1), rowmax(S_i^(j))).
            m_new = torch.maximum(m_i, S_ij.amax(dim=-1))
            # P~_i^(j) = exp(S_i^(j) - m_i^(j)); alpha = e^(m_i^(j-1) - m_i^(j)).
            P_tilde_ij = torch.exp(S_ij - _finite_max(m_new).unsqueeze(-1))
            alpha = torch.exp(m_i - _finite_max(m_new))
            # l_i^(j) = alpha l_i^(j-1) + rowsum(P~_i^(j)).
            l_i = alpha * l_i + P_tilde_ij.sum(dim=-1)
            # O_i^(j) = diag(alpha) O_i^(j-1) + P~_i^(j) V_j   (no division: unnormalised).
            O_i = alpha.unsqueeze(-1) * O_i + P_tilde_ij @ V_j
            m_i = m_new

        # Epilogue: O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i); a row that saw no key
        # writes O_i = 0 and L_i = +inf.
        seen = l_i > 0
        O[:, :, r0:r1] = O_i / torch.where(seen, l_i, torch.ones_like(l_i)).unsqueeze(-1)
        L[:, :, r0:r1] = torch.where(seen, m_i + torch.log(l_i), torch.full_like(l_i, math.inf))

    return O.transpose(1, 2).to(q.dtype), L


def flash_attn2_tiled_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               dout: Tensor, causal: bool = False,
                               softmax_scale: float | None = None, block_q: int = 64,
                               block_k: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2 backward, Algorithm 2 of Dao 2023 (arXiv:2307.08691).

    Nothing of size N x N is stored: each tile of P is recomputed from Q, K and the saved
    ``lse`` (``P = exp(S - L)``, already normalised, no running max needed). A preprocessing
    pass computes ``D = rowsum(dO * O)``. The outer loop walks K/V blocks (one thread block
    each): ``dK_j`` and ``dV_j`` are accumulated on chip and written once; ``dQ`` is shared by
    all K/V blocks and accumulated in HBM (an fp32 buffer and atomic adds in the kernel).

    ``out`` and ``lse`` are the forward's outputs. Returns ``(dq, dk, dv)`` in the dtypes of
    ``q``, ``k``, ``v``; with GQA, ``dk`` / ``dv`` of a K/V head sum over the query heads
    that read it.
    """
    b, N, sk, h, hk, d = _shapes(q, k, v)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    acc = _acc_dtype(q.dtype)
    Q = q.transpose(1, 2).to(acc)        # (b, h, N, d)
    K = _to_bhsd(k, h, acc)              # (b, h, sk, d)
    V = _to_bhsd(v, h, acc)              # (b, h, sk, dv)
    O = out.transpose(1, 2).to(acc)      # (b, h, N, dv)
    dO = dout.transpose(1, 2).to(acc)    # (b, h, N, dv)
    L = lse.to(acc)                      # (b, h, N)
    Br, Bc = block_q, block_k
    Tr, Tc = math.ceil(N / Br), math.ceil(sk / Bc)

    # Preprocess: D = rowsum(dO o O), which equals rowsum(P o dP) row by row.
    D = (dO * O).sum(dim=-1)             # (b, h, N)
    dQ = torch.zeros_like(Q)             # HBM, accumulated by every K/V block
    dK = torch.zeros_like(K)             # per query head; reduced to K/V heads at the end
    dV = torch.zeros_like(V)

    for j in range(Tc):
        c0, c1 = j * Bc, min((j + 1) * Bc, sk)
        K_j, V_j = K[:, :, c0:c1], V[:, :, c0:c1]
        # On chip: dK_j = 0, dV_j = 0.
        dK_j = torch.zeros_like(K_j)
        dV_j = torch.zeros_like(V_j)

        # Causal: start at the Q block holding the first row whose diagonal reaches key c0;
        # earlier rows see none of this block.
        first_block = 0
        if causal:
            first_block = min(Tr, max(0, c0 - (sk - N)) // Br)
        for i in range(first_block, Tr):
            r0, r1 = i * Br, min((i + 1) * Br, N)
            Q_i, dO_i = Q[:, :, r0:r1], dO[:, :, r0:r1]
            L_i, D_i = L[:, :, r0:r1], D[:, :, r0:r1]
            # S_i^(j) = scale Q_i K_j^T, masked.
            S_ij = scale * Q_i @ K_j.transpose(-1, -2)
            if causal:
                S_ij = S_ij.masked_fill(~_tile_visible(r0, r1, c0, c1, N, sk, q.device),
                                        -math.inf)
            # P_i^(j) = exp(S_i^(j) - L_i). Masked entries and rows with L_i = +inf give 0.
            P_ij = torch.exp(S_ij - L_i.unsqueeze(-1))
            # dV_j += P_i^(j)^T dO_i.
            dV_j += P_ij.transpose(-1, -2) @ dO_i
            # dP_i^(j) = dO_i V_j^T.
            dP_ij = dO_i @ V_j.transpose(-1, -2)
            # dS_i^(j) = P_i^(j) o (dP_i^(j) - D_i).
            dS_ij = P_ij * (dP_ij - D_i.unsqueeze(-1))
            # dQ_i += scale dS_i^(j) K_j   (read-modify-write of HBM).
            dQ[:, :, r0:r1] += scale * dS_ij @ K_j
            # dK_j += scale dS_i^(j)^T Q_i.
            dK_j += scale * dS_ij.transpose(-1, -2) @ Q_i

        # Write dK_j, dV_j to HBM.
        dK[:, :, c0:c1] = dK_j
        dV[:, :, c0:c1] = dV_j

    # GQA: query heads [g * kv, g * kv + g) read K/V head kv, so their gradients add up there.
    g = h // hk
    dk = dK.reshape(b, hk, g, sk, d).sum(dim=2).transpose(1, 2)
    dv = dV.reshape(b, hk, g, sk, V.shape[-1]).sum(dim=2).transpose(1, 2)
    return dQ.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
