"""The flash_attn 2.x public functions: same names, arguments, defaults and return values, plus
one keyword-only ``backend=None`` (see ``_dispatch``).

Each call: validate (``_validate``) -> choose the family (``_dispatch``) -> bring q/k/v into the
layout the kernels read, padding the head dim to a multiple of 8 -> ``flash_attn::fwd`` (or, in
plain eager calls, the same computation without the op's dispatch: ``_ops.attention``) -> slice
the padding off. Autograd runs through the pad / slice / unbind like any other op, so gradients
come back in the caller's shapes.

The variable-length and KV-cache functions validate and dispatch like the dense ones; a build
whose families lack their feature ("varlen", "kvcache" in build_matrix) raises
NotImplementedError saying so.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

# _ops registers torch.ops.flash_attn and holds the eager path to the same kernels.
from . import _dispatch, _ops, _validate, fp8, reference


def _positive_scale(q, softmax_scale):
    """(q, scale) with scale > 0. The kernels take the row max of raw q.k and exponentiate
    (q.k - max) * scale, which needs scale > 0. logits = (q * sign) . k * |scale| is the same
    attention, and autograd carries the sign back to dq; scale 0 (uniform attention) becomes
    q * 0 with scale 1. Rare, so the copy of q it costs does not matter."""
    if softmax_scale > 0:
        return q, softmax_scale
    return (q * (-1.0 if softmax_scale < 0 else 0.0),
            -softmax_scale if softmax_scale < 0 else 1.0)


def _kernel_inputs(q, k, v, head_dim):
    """q, k, v as the ops take them: the head dim padded with zeros to a multiple of 8 (the
    kernels move rows in 16-byte vectors; the caller narrows out back), and, as flash_attn
    2.x does, a non-contiguous last dim copied rather than refused. Done before the op, so the
    op saves the copy for backward instead of copying again there."""
    pad = -head_dim % 8
    if pad:
        q, k, v = (F.pad(t, [0, pad]) for t in (q, k, v))
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, backend, names, tuning=None, q_descale=None,
               k_descale=None, v_descale=None, out_dtype=None):
    if fp8.is_fp8(q, k, v) or q_descale is not None or k_descale is not None or \
            v_descale is not None:
        return fp8.attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, return_attn_probs, backend, names, tuning, q_descale,
                             k_descale, v_descale, out_dtype)
    if out_dtype is not None and out_dtype != q.dtype:
        raise ValueError(f"out_dtype={out_dtype}: a {q.dtype} call writes its output in "
                         f"{q.dtype}; out_dtype is for FP8 inputs")
    call = _validate.validate_call(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                                   causal=causal, window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes, names=names)
    need_bwd = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    family = _dispatch.select(call, q.device, backend, need_bwd, deterministic)
    # Both validated reals >= 0; * 1.0 turns an int into the float the op's schema takes.
    softcap, dropout_p = softcap * 1.0, dropout_p * 1.0
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    q_in, k_in = q, k
    q, softmax_scale = _positive_scale(q, call.softmax_scale)
    head_dim = call.shapes.head_dim
    q, k, v = _kernel_inputs(q, k, v, head_dim)
    window_left, window_right = call.window
    out, lse, rng_state = _ops.attention(
        q, k, v, softmax_scale, call.causal, window_left, window_right, softcap,
        alibi_slopes, dropout_p, bool(deterministic), family, _ops.tuning_text(tuning))
    if out.shape[-1] != head_dim:
        out = out.narrow(-1, 0, head_dim)
    if not return_attn_probs:
        return out
    # As flash_attn 2.x: the third return exists only with dropout (2.x asks its kernel for it
    # only when dropout_p > 0), so asking for the lse this way never materialises seqlen^2.
    probs = (_attn_probs(q_in, k_in, call, softcap, alibi_slopes, dropout_p, rng_state)
             if dropout_p > 0 else None)
    return out, lse, probs


def _attn_probs(q, k, call, softcap, alibi_slopes, dropout_p, rng_state):
    """S_dmask of flash_attn 2.x: (batch, nheads, seqlen_q, seqlen_k) in q's dtype, the attention
    probabilities (after softcap, ALiBi and the mask, before dropout), negated where dropout
    dropped them. Computed here in fp32 from the inputs, with the forward's own keep-mask from
    ``flash_attn::dropout_mask``: O(seqlen_q * seqlen_k) memory, for tests only."""
    s = call.shapes
    with torch.no_grad():
        qf = q.detach().float().transpose(1, 2)                                 # (b, h, sq, d)
        kf = k.detach().float().transpose(1, 2).repeat_interleave(s.nheads // s.nheads_k, 1)
        scores = qf @ kf.transpose(-1, -2) * call.softmax_scale                 # (b, h, sq, sk)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            # reference.alibi_bias's -slope * |i + sk - sq - j|, in fp32 (it computes in fp64).
            i = torch.arange(s.seqlen_q, device=q.device).unsqueeze(1)
            j = torch.arange(s.seqlen_k, device=q.device)
            distance = (i + (s.seqlen_k - s.seqlen_q) - j).abs().float()        # (sq, sk)
            scores = scores - alibi_slopes.reshape(-1, s.nheads, 1, 1) * distance
        visible = reference.attention_mask(s.seqlen_q, s.seqlen_k, call.causal, call.window,
                                           device=q.device)
        scores = torch.where(visible, scores, -math.inf)
        # A row that sees no key has probabilities 0 (its lse is +inf), not 0/0.
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        keep = torch.ops.flash_attn.dropout_mask(rng_state, s.batch, s.nheads, s.seqlen_q,
                                                 s.seqlen_k, dropout_p)
        return torch.where(keep, probs, -probs).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, backend: Optional[str] = None,
                    q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
                    _tuning: Optional[dict] = None):
    """Scaled dot-product attention, flash_attn 2.x semantics.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), fp16 or
    bf16 on one CUDA device; nheads % nheads_k == 0 (GQA / MQA: query head h reads K/V head
    h // (nheads // nheads_k)). The causal mask aligns to the bottom-right corner. softmax_scale
    defaults to 1 / sqrt(headdim). ``backend`` ('fa1' | 'fa2' | 'fa3' | 'auto' | None) forces a
    kernel family for this call; None defers to FLASH_ATTN_BACKEND, then the automatic choice
    (sm90: fa3, except with dropout). fa3's gradient runs fa3's backward at every head dim
    (window, softcap, ALiBi, deterministic=True too) with at least 1024 query rows per KV head
    (seqlen_q * nheads / nheads_k), and fa2's backward below that.

    window_size=(left, right): local attention, query i sees keys [i + seqlen_k - seqlen_q -
    left, i + seqlen_k - seqlen_q + right] (-1: unbounded). softcap > 0: scores become
    softcap * tanh(scores / softcap). alibi_slopes (nheads,) or (batch, nheads), fp32: adds
    -slope * |i + seqlen_k - seqlen_q - j|. dropout_p: applied as given (as flash_attn 2.x's
    functions do; pass 0.0 at evaluation), to the probabilities, not the lse; the random
    stream is the default CUDA generator's, so torch.manual_seed reproduces it.

    Returns out (batch, seqlen_q, nheads, headdim), or with return_attn_probs=True
    (out, softmax_lse, S_dmask): softmax_lse fp32 (batch, nheads, seqlen_q), natural log;
    S_dmask None when dropout_p == 0, else (batch, nheads, seqlen_q, seqlen_k) in q's dtype:
    the attention probabilities before dropout, negated where dropout dropped them. S_dmask is
    for testing only (as in 2.x): it materialises seqlen_q x seqlen_k, computed in PyTorch.

    FP8 (sm90, fa3, forward only): torch.float8_e4m3fn q, k, v with keyword-only positive
    float32 ``q_descale`` / ``k_descale`` / ``v_descale`` of shape (batch, nheads_k) (None: 1;
    the real Q is q.float() * q_descale); the output is bfloat16 (``out_dtype``: bfloat16 only
    so far). See ``flash_attn.fp8``.

    ``_tuning`` is private: overrides of the kernels' automatic choices (a dict such as
    ``{"fa3_narrow": 0}``; csrc/common/tuning.h lists them) for tests and A/B benchmarks. No
    promise is made about it across versions.
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, backend, ("q", "k", "v"),
                      _tuning, q_descale, k_descale, v_descale, out_dtype)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              backend: Optional[str] = None):
    """``flash_attn_func`` on qkv (batch, seqlen, 3, nheads, headdim)."""
    _validate.check_is_tensor("qkv", qkv)
    _validate.check_packed_shape("qkv", qkv.shape, 3, "(batch, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, backend,
                      ("qkv", "qkv", "qkv"))


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             backend: Optional[str] = None):
    """``flash_attn_func`` on q (batch, seqlen_q, nheads, headdim) and
    kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    _validate.check_is_tensor("q", q)
    _validate.check_is_tensor("kv", kv)
    _validate.check_packed_shape("kv", kv.shape, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, backend, ("q", "kv", "kv"))


def select_backend(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   dropout_p=0.0, backend: Optional[str] = None) -> str:
    """The family ``flash_attn_func`` would run the forward of these arguments with ('fa1' /
    'fa2' / 'fa3'), raising the error the call would raise. Counts a backward pass as needed
    when a tensor requires grad, as the call does; that backward runs the same family's
    kernels, except after fa3 where its backward does not take the call (fewer than 1024
    query rows per KV head): fa2's backward."""
    if fp8.is_fp8(q, k, v):  # FP8 inputs: fa3's e4m3 forward, or its error
        call = fp8.check_call(q, k, v, dropout_p=dropout_p, causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        return fp8.select(call, q.device, backend)
    call = _validate.validate_call(q, k, v, dropout_p=dropout_p, causal=causal,
                                   window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes)
    need_bwd = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _dispatch.select(call, q.device, backend, need_bwd)


# ---- variable-length batches ------------------------------------------------------------------

def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, block_table, seqused_q, seqused_k,
                      backend, names):
    fp8.refuse("flash_attn_varlen_func", q, k, v)
    call = _validate.validate_varlen_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
        seqused_k=seqused_k, block_table=block_table, dropout_p=dropout_p,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, names=names)
    need_bwd = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if need_bwd and block_table is not None:
        raise NotImplementedError(
            "block_table: attention over a paged K/V cache has no backward (as in flash_attn "
            "2.x); call it under torch.no_grad() or with q, k, v not requiring grad")
    family = _dispatch.select(call, q.device, backend, need_bwd, deterministic)
    softcap, dropout_p = softcap * 1.0, dropout_p * 1.0
    q_in, k_in = q, k
    q, softmax_scale = _positive_scale(q, call.softmax_scale)
    head_dim = call.shapes.head_dim
    q, k, v = _kernel_inputs(q, k, v, head_dim)
    window_left, window_right = call.window
    # The validated ints (a 0-d tensor or NumPy int given for max_seqlen becomes an int).
    max_seqlen_q, max_seqlen_k = call.shapes.seqlen_q, call.shapes.seqlen_k
    out, lse, rng_state = _ops.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
        block_table, softmax_scale, call.causal, window_left, window_right, softcap,
        alibi_slopes, dropout_p, bool(deterministic), family, "")
    if out.shape[-1] != head_dim:
        out = out.narrow(-1, 0, head_dim)
    if not return_attn_probs:
        return out
    probs = None
    if dropout_p > 0:
        probs = _varlen_attn_probs(q_in, k_in, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                   block_table, call, softcap, alibi_slopes, dropout_p,
                                   rng_state)
    return out, lse, probs


def _varlen_attn_probs(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                       call, softcap, alibi_slopes, dropout_p, rng_state):
    """``_attn_probs`` of each sequence, in a (batch, nheads, max_seqlen_q, max_seqlen_k) tensor
    (sequence b in its top-left corner, zeros elsewhere). Reads cu_seqlens on the host: for
    tests only, as S_dmask is."""
    s = call.shapes
    with torch.no_grad():
        keep = torch.ops.flash_attn.dropout_mask(rng_state, s.batch, s.nheads, s.seqlen_q,
                                                 s.seqlen_k, dropout_p)
        probs = reference.attention_varlen_probs(
            q.float(), k.float(), cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            block_table, s.seqlen_q, s.seqlen_k, call.softmax_scale, call.causal, call.window,
            softcap, alibi_slopes)
        return torch.where(keep, probs, -probs).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None, backend: Optional[str] = None):
    """``flash_attn_func`` over a packed batch of sequences of different lengths.

    q: (total_q, nheads, headdim), the batch's query rows one sequence after another; k, v:
    (total_k, nheads_k, headdim). cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,), the offset
    of each sequence's first row (0 first, total last); a sequence may be empty.
    max_seqlen_q / max_seqlen_k: the longest sequence's length (an int, or a 0-d integer
    tensor at the cost of a host sync). A larger bound costs only idle blocks, except that a
    window side >= max_seqlen_k counts as unbounded (2.x's rule); a smaller one is an error
    the call cannot detect without reading cu_seqlens on the host.
    seqused_q / seqused_k (keyword-only, as FA3's): int32 (batch,), only that many rows of
    each sequence take part; the query rows past it come out 0 (and their lse +inf).
    block_table: int32 (batch, max_blocks_per_seq) with k, v a paged cache (num_blocks,
    page_block_size, nheads_k, headdim), any page size; forward only. Causal and window align
    bottom-right within each sequence; ALiBi slopes are (nheads,) or (batch, nheads).

    Returns out (total_q, nheads, headdim), or with return_attn_probs=True (out, softmax_lse
    (nheads, total_q) float32, S_dmask): S_dmask is None without dropout, else (batch,
    nheads, max_seqlen_q, max_seqlen_k) as ``flash_attn_func``'s, each sequence in its
    top-left corner (for tests: it is computed in PyTorch).
    """
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, block_table,
                             seqused_q, seqused_k, backend, ("q", "k", "v"))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *,
                                     backend: Optional[str] = None):
    """``flash_attn_varlen_func`` on qkv (total, 3, nheads, headdim), one cu_seqlens for all."""
    _validate.check_is_tensor("qkv", qkv)
    _validate.check_ndim("qkv", qkv.shape, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, nheads, headdim), with 3 at dim 1, "
                         f"got shape {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return _varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                             dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, None, None, None,
                             backend, ("qkv", "qkv", "qkv"))


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *,
                                    backend: Optional[str] = None):
    """``flash_attn_varlen_func`` on q (total_q, nheads, headdim) and kv (total_k, 2, nheads_k,
    headdim)."""
    _validate.check_is_tensor("q", q)
    _validate.check_is_tensor("kv", kv)
    _validate.check_ndim("kv", kv.shape, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, nheads_k, headdim), with 2 at dim 1, "
                         f"got shape {tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, None, None, None,
                             backend, ("q", "kv", "kv"))


# ---- the KV cache ------------------------------------------------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            backend: Optional[str] = None, _tuning: Optional[dict] = None):
    """Attention of q over a KV cache, appending new keys and values to it in place
    (inference: no autograd), flash_attn 2.x semantics.

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_k, headdim), or with block_table (batch, max_blocks_per_seq) int32 a paged cache
    (num_blocks, page_block_size, nheads_k, headdim) with any page size >= 1. cache_seqlens:
    int or int32 (batch,), the tokens already in each sequence's cache (None: the cache is
    full). k, v (batch, seqlen_new, nheads_k, headdim), optional: written into the cache at
    positions cache_seqlens .. cache_seqlens + seqlen_new - 1, rotated first when rotary_cos /
    rotary_sin (seqlen_ro, rotary_dim / 2) are given; the attention then covers them. q is
    rotated at positions cache_seqlens + i when causal or local, else all at cache_seqlens;
    rotary_interleaved: pairs (2i, 2i + 1) (GPT-J) or (i, i + rotary_dim / 2) (GPT-NeoX).
    cache_batch_idx (batch,) int32: the cache row of each sequence. cache_leftpad (batch,)
    int32: the first cache position a sequence attends to. Causal / window / ALiBi align
    bottom-right within each sequence's keys. num_splits: split the keys over that many CTAs
    (0: automatic).

    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse (batch, nheads,
    seqlen_q) float32) with return_softmax_lse=True. ``_tuning``: as flash_attn_func's.
    """
    fp8.refuse("flash_attn_with_kvcache", q, k_cache, v_cache, k, v)
    call = _validate.validate_kvcache_call(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, alibi_slopes,
        num_splits)
    family = _dispatch.select(call, q.device, backend, False)
    q, softmax_scale = _positive_scale(q, call.softmax_scale)
    if call.shapes.head_dim % 8:
        # The kernels read rows in 16-byte vectors and the cache is written in place, so it
        # cannot be padded here as q, k, v are elsewhere.
        raise ValueError(f"flash_attn_with_kvcache needs a head dim that is a multiple of 8, "
                         f"got {call.shapes.head_dim}")
    tensor_seqlens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    cache_seqlen = -1 if cache_seqlens is None or tensor_seqlens is not None else cache_seqlens
    window_left, window_right = call.window
    out, lse = _ops.kvcache_attention(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, tensor_seqlens, cache_seqlen,
        cache_batch_idx, cache_leftpad, block_table, softmax_scale, call.causal, window_left,
        window_right, softcap * 1.0, bool(rotary_interleaved), alibi_slopes, num_splits,
        family, _ops.tuning_text(_tuning))
    return (out, lse) if return_softmax_lse else out
