"""The flash_attn 2.x public functions: same names, arguments, defaults and return values, plus
one keyword-only ``backend=None`` (see ``_dispatch``).

Each call: validate (``_validate``) -> choose the family (``_dispatch``) -> bring q/k/v into the
layout the kernels read, padding the head dim to a multiple of 8 -> ``flash_attn::fwd`` -> slice
the padding off. Autograd runs through the pad / slice / unbind like any other op, so gradients
come back in the caller's shapes.

The varlen and KV-cache entry points exist because libraries (HF transformers) import them by
name; they raise NotImplementedError until this build has kernels for them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _dispatch, _ops, _validate  # noqa: F401  (_ops registers torch.ops.flash_attn)


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, backend, names):
    call = _validate.validate_call(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                                   causal=causal, window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes, names=names)
    need_bwd = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    family = _dispatch.select(call, q.device, backend, need_bwd)

    head_dim = call.shapes.head_dim
    pad = -head_dim % 8
    if pad:
        q, k, v = (F.pad(t, [0, pad]) for t in (q, k, v))
    # As flash_attn 2.x: a non-contiguous last dim is copied, not an error. Done here, before
    # the op, so the op saves the copy for backward instead of copying again there.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.flash_attn.fwd(q, k, v, call.softmax_scale, call.causal,
                                        bool(deterministic), family)
    if pad:
        out = out.narrow(-1, 0, head_dim)
    # The third 2.x return is the dropout mask / probabilities, which exist only with dropout.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, backend: Optional[str] = None):
    """Scaled dot-product attention, flash_attn 2.x semantics.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), fp16 or
    bf16 on one CUDA device; nheads % nheads_k == 0 (GQA / MQA: query head h reads K/V head
    h // (nheads // nheads_k)). The causal mask aligns to the bottom-right corner. softmax_scale
    defaults to 1 / sqrt(headdim). ``backend`` ('fa1' | 'fa2' | 'fa3' | 'auto' | None) forces a
    kernel family for this call; None defers to FLASH_ATTN_BACKEND, then the automatic choice.

    Returns out (batch, seqlen_q, nheads, headdim), or with return_attn_probs=True
    (out, softmax_lse, None): softmax_lse fp32 (batch, nheads, seqlen_q), natural log.
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, backend, ("q", "k", "v"))


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
    """The family ``flash_attn_func`` would run for these arguments ('fa1' / 'fa2' / 'fa3'),
    raising the error the call would raise. Counts a backward pass as needed when a tensor
    requires grad, as the call does."""
    call = _validate.validate_call(q, k, v, dropout_p=dropout_p, causal=causal,
                                   window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes)
    need_bwd = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _dispatch.select(call, q.device, backend, need_bwd)


# ---- 2.x entry points without kernels yet -----------------------------------------------------

def _not_implemented(name: str):
    raise NotImplementedError(
        f"{name} is not implemented yet in this build of flash_attn (an independent "
        f"implementation of the flash_attn 2.x API); implemented: flash_attn_func, "
        f"flash_attn_qkvpacked_func, flash_attn_kvpacked_func. For variable-length batches, pad "
        f"them to one length and call flash_attn_func.")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    _not_implemented("flash_attn_varlen_func")


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    _not_implemented("flash_attn_varlen_qkvpacked_func")


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    _not_implemented("flash_attn_varlen_kvpacked_func")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    _not_implemented("flash_attn_with_kvcache")
