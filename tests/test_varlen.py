"""flash_attn_varlen_* without a GPU: validation, dispatch, the custom ops and autograd, with the
CPU stand-in extension (tests/conftest.py) computing reference.attention_varlen_ref in the
kernels' place. A build whose families lack the "varlen" feature must say so; the
``varlen_ext`` fixture plays a build whose fa2 and fa3 have it.
"""

import dataclasses
import math

import pytest
import torch

import flash_attn
from flash_attn import _dispatch, build_matrix, reference
from conftest import give_features

# Awkward lengths: empty, one row, around a 128-row tile, and a GQA group of 3.
LENGTHS_Q = [0, 1, 127, 129, 5]
LENGTHS_K = [3, 0, 128, 131, 17]
HEADS, HEADS_K = 6, 2


@pytest.fixture
def varlen_ext(fake_ext, monkeypatch):
    give_features(monkeypatch, {"varlen", "paged_kv"})
    return fake_ext


def cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def packed(lengths_q, lengths_k, d=40, heads=HEADS, heads_k=HEADS_K, dtype=torch.bfloat16,
           seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, d, generator=g).to(dtype)
    k = torch.randn(sum(lengths_k), heads_k, d, generator=g).to(dtype)
    v = torch.randn(sum(lengths_k), heads_k, d, generator=g).to(dtype)
    return q, k, v, cu(lengths_q), cu(lengths_k)


def per_sequence(fn, q, k, v, lengths_q, lengths_k):
    """fn(q_b, k_b, v_b) on each sequence as a dense batch of one: (outs, lses) concatenated."""
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(lengths_q, lengths_k):
        o, l = fn(q[None, q0:q0 + lq], k[None, k0:k0 + lk], v[None, k0:k0 + lk])
        outs.append(o[0])
        lses.append(l[0])
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses, dim=-1)


# ---- a build without varlen kernels -----------------------------------------------------------

def test_without_varlen_kernels_the_call_says_so(fake_ext, monkeypatch):
    for name, fam in list(build_matrix.FAMILIES.items()):
        monkeypatch.setitem(build_matrix.FAMILIES, name, dataclasses.replace(
            fam, features=fam.features - {"varlen"}))
    monkeypatch.setattr(_dispatch, "_DECISIONS", {})
    q, k, v, cq, ck = packed([3, 4], [5, 6])
    with pytest.raises(NotImplementedError, match=r"No backend in this version supports "
                                                  r"variable-length batches \(cu_seqlens\)"):
        flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 4, 6)
    assert fake_ext.calls == []


# ---- results ----------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (7, 2))])
def test_matches_each_sequence_alone(varlen_ext, causal, window):
    q, k, v, cq, ck = packed(LENGTHS_Q, LENGTHS_K, d=36)   # head dim padded to 40 and back
    out, lse, _ = flash_attn.flash_attn_varlen_func(
        q, k, v, cq, ck, max(LENGTHS_Q), max(LENGTHS_K), causal=causal, window_size=window,
        return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (HEADS, q.shape[0]) and lse.dtype == torch.float32

    def dense(qb, kb, vb):
        o, l = reference.attention_ref(qb, kb, vb, causal=causal, window_size=window,
                                       return_lse=True)
        return o.to(q.dtype), l
    want_out, want_lse = per_sequence(dense, q, k, v, LENGTHS_Q, LENGTHS_K)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse.float(), atol=0, rtol=0)
    call = varlen_ext.calls[-1]
    assert call[:7] == ("varlen_fwd", "fa2", (q.shape[0], HEADS, 40), len(LENGTHS_Q),
                        max(LENGTHS_Q), max(LENGTHS_K), False)


def test_gradients_match_each_sequence_alone(varlen_ext):
    q, k, v, cq, ck = packed(LENGTHS_Q, LENGTHS_K)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn.flash_attn_varlen_func(*leaves, cq, ck, max(LENGTHS_Q), max(LENGTHS_K),
                                            causal=True, softcap=3.0)
    grads = torch.autograd.grad(out, leaves, dout)
    assert [c[0] for c in varlen_ext.calls] == ["varlen_fwd", "varlen_bwd"]

    # The same sequences one at a time through flash_attn_func (an empty one: zero gradients).
    want = [torch.zeros_like(t) for t in (q, k, v)]
    for q0, lq, k0, lk in zip(cq.tolist(), LENGTHS_Q, ck.tolist(), LENGTHS_K):
        if lq == 0 or lk == 0:
            continue
        rows, keys = slice(q0, q0 + lq), slice(k0, k0 + lk)
        parts = [t[None, r].clone().requires_grad_() for t, r in ((q, rows), (k, keys), (v, keys))]
        o = flash_attn.flash_attn_func(*parts, causal=True, softcap=3.0)
        for w, r, g in zip(want, (rows, keys, keys),
                           torch.autograd.grad(o, parts, dout[None, rows])):
            w[r] = g[0]
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_fa3_gradient_runs_fa2s_backward(varlen_ext):
    varlen_ext.arch = 90
    q, k, v, cq, ck = packed([4, 9], [6, 2], dtype=torch.float16)
    q.requires_grad_()
    out = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 9, 6)
    out.sum().backward()
    assert [(c[0], c[1]) for c in varlen_ext.calls] == [("varlen_fwd", "fa3"),
                                                       ("varlen_bwd", "fa2")]


def test_seqused_rows_past_it_are_zero(varlen_ext):
    lengths_q, lengths_k = [6, 9, 4], [8, 5, 7]
    q, k, v, cq, ck = packed(lengths_q, lengths_k)
    used_q = torch.tensor([2, 9, 0], dtype=torch.int32)
    used_k = torch.tensor([8, 1, 3], dtype=torch.int32)
    out, lse, _ = flash_attn.flash_attn_varlen_func(
        q, k, v, cq, ck, 9, 8, causal=True, return_attn_probs=True, seqused_q=used_q,
        seqused_k=used_k)
    for b, (q0, lq, uq) in enumerate(zip(cq.tolist(), lengths_q, used_q.tolist())):
        k0, uk = ck[b].item(), used_k[b].item()
        want, want_lse = reference.attention_ref(q[None, q0:q0 + uq], k[None, k0:k0 + uk],
                                                 v[None, k0:k0 + uk], causal=True,
                                                 return_lse=True)
        torch.testing.assert_close(out[q0:q0 + uq], want[0].to(q.dtype), atol=0, rtol=0)
        torch.testing.assert_close(lse[:, q0:q0 + uq], want_lse[0].float(), atol=0, rtol=0)
        assert (out[q0 + uq:q0 + lq] == 0).all()
        assert torch.isposinf(lse[:, q0 + uq:q0 + lq]).all()


@pytest.mark.parametrize("page", [1, 3, 16])
def test_paged_kv_matches_contiguous(varlen_ext, page):
    lengths_q, lengths_k = [3, 1, 6], [10, 0, 33]
    q, k, v, cq, ck = packed(lengths_q, lengths_k)
    with torch.no_grad():
        want = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 6, 33, causal=True)
    # Each sequence's keys on pages in a shuffled order within a pool with spare pages.
    pages_per_seq = max(-(-n // page) for n in lengths_k)
    num_blocks = 2 * len(lengths_k) * pages_per_seq + 1
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    block_table = order[:len(lengths_k) * pages_per_seq].view(len(lengths_k), pages_per_seq)
    block_table = block_table.to(torch.int32)
    k_cache = torch.full((num_blocks, page, HEADS_K, 40), math.nan, dtype=k.dtype)
    v_cache = torch.full_like(k_cache, math.nan)
    for b, (k0, n) in enumerate(zip(ck.tolist(), lengths_k)):
        for j in range(n):
            k_cache[block_table[b, j // page], j % page] = k[k0 + j]
            v_cache[block_table[b, j // page], j % page] = v[k0 + j]
    out = flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 6, 33, causal=True,
                                            block_table=block_table)
    torch.testing.assert_close(out, want, atol=0, rtol=0)   # NaN in unused slots never leaks
    assert varlen_ext.calls[-1][6] is True


def test_paged_kv_has_no_backward(varlen_ext):
    q, k, v, cq, ck = packed([2], [4])
    k_cache, v_cache = k.view(2, 2, HEADS_K, 40), v.view(2, 2, HEADS_K, 40)
    block_table = torch.tensor([[1, 0]], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"block_table: attention over a paged K/V "
                                                  r"cache has no backward"):
        flash_attn.flash_attn_varlen_func(q.requires_grad_(), k_cache, v_cache, cq, ck, 2, 4,
                                          block_table=block_table)


def test_packed_variants_match(varlen_ext):
    lengths = [5, 0, 12]
    q, k, v, c, _ = packed(lengths, lengths, heads=4, heads_k=4)
    want = flash_attn.flash_attn_varlen_func(q, k, v, c, c, 12, 12, causal=True)
    qkv = torch.stack([q, k, v], dim=1)
    got = flash_attn.flash_attn_varlen_qkvpacked_func(qkv, c, 12, causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    got = flash_attn.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), c, c, 12, 12,
                                                     causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_dropout_probs_are_per_sequence(varlen_ext):
    lengths_q, lengths_k = [3, 5], [4, 2]
    q, k, v, cq, ck = packed(lengths_q, lengths_k)
    out, lse, probs = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 5, 4, dropout_p=0.3,
                                                        return_attn_probs=True)
    assert probs.shape == (2, HEADS, 5, 4)
    assert (probs[0, :, 3:] == 0).all() and (probs[1, :, :, 2:] == 0).all()
    # Dropped or not, |S_dmask| is the probability: rows sum to 1.
    torch.testing.assert_close(probs[1, :, :, :2].float().abs().sum(-1),
                               torch.ones(HEADS, 5), atol=1e-2, rtol=0)


def test_max_seqlen_as_a_0d_tensor(varlen_ext):
    # transformers' packed-sequence path passes position_ids.max() + 1, a tensor, as 2.x allows.
    q, k, v, cq, ck = packed([3, 4], [5, 6])
    want = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 4, 6)
    got = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, torch.tensor(4), torch.tensor(6))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert varlen_ext.calls[-1][4:6] == (4, 6) and type(varlen_ext.calls[-1][4]) is int


def test_empty_batch_and_no_keys(varlen_ext):
    q, k, v, cq, ck = packed([0, 0], [0, 3])
    out, lse, _ = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 0, 3,
                                                    return_attn_probs=True)
    assert out.shape == (0, HEADS, 40) and lse.shape == (HEADS, 0)
    q, k, v, cq, ck = packed([2, 3], [0, 0])
    out, lse, _ = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 3, 0,
                                                    return_attn_probs=True)
    assert (out == 0).all() and torch.isposinf(lse).all()


# ---- validation -------------------------------------------------------------------------------

def _call(**over):
    q, k, v, cq, ck = packed([3, 4], [5, 6])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=4,
                max_seqlen_k=6)
    args.update(over)
    return flash_attn.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("over,error,pattern", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 7])), TypeError,
     r"cu_seqlens_q must be torch.int32, got torch.int64"),
    (dict(cu_seqlens_q=torch.tensor([[0, 3, 7]], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\), got \(1, 3\)"),
    (dict(cu_seqlens_q=torch.tensor([0], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must hold batch \+ 1 >= 2 offsets"),
    (dict(cu_seqlens_k=torch.tensor([0, 11], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k must have shape \(batch \+ 1,\) = \(3,\) like cu_seqlens_q, got \(2,\)"),
    (dict(seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError,
     r"seqused_k must have shape \(batch,\) = \(2,\), got \(3,\)"),
    (dict(max_seqlen_q=4.0), TypeError, r"max_seqlen_q must be an int"),
    (dict(max_seqlen_k=-1), ValueError, r"max_seqlen_k must be >= 0, got -1"),
    (dict(q=torch.zeros(7, 6, 40, dtype=torch.bfloat16)[None]), ValueError,
     r"q must be 3-D \(total_q, nheads, headdim\), got shape \(1, 7, 6, 40\)"),
    (dict(v=torch.zeros(10, 2, 40, dtype=torch.bfloat16)), ValueError,
     r"v must have the shape of k, \(11, 2, 40\), got \(10, 2, 40\)"),
    (dict(k=torch.zeros(11, 4, 40, dtype=torch.bfloat16),
          v=torch.zeros(11, 4, 40, dtype=torch.bfloat16)), ValueError,
     r"q has 6 heads, which is not a multiple of the 4 heads of k"),
    (dict(alibi_slopes=torch.zeros(3, 6)), ValueError,
     r"alibi_slopes must have shape \(nheads,\) = \(6,\) or \(batch, nheads\) = \(2, 6\)"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     r"k must be 4-D \(num_blocks, page_block_size, nheads_k, headdim\)"),
])
def test_bad_arguments_are_named(varlen_ext, over, error, pattern):
    with pytest.raises(error, match=pattern):
        _call(**over)
    assert varlen_ext.calls == []


def test_block_table_checks(varlen_ext):
    q, k, v, cq, ck = packed([3, 4], [5, 6])
    k_cache = torch.zeros(4, 3, HEADS_K, 40, dtype=k.dtype)
    with pytest.raises(ValueError, match=r"max_seqlen_k is 7, more than block_table's 2 pages "
                                         r"of 3 keys hold"):
        flash_attn.flash_attn_varlen_func(q, k_cache, k_cache, cq, ck, 4, 7,
                                          block_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table must have shape \(batch, "
                                         r"max_blocks_per_seq\) = \(2, ...\), got \(3, 2\)"):
        flash_attn.flash_attn_varlen_func(q, k_cache, k_cache, cq, ck, 4, 6,
                                          block_table=torch.zeros(3, 2, dtype=torch.int32))


# ---- the ops under opcheck and torch.compile --------------------------------------------------

def test_opcheck_varlen_ops(varlen_ext):
    q, k, v, cq, ck = packed([3, 0, 9], [4, 2, 9], d=32)
    used = torch.tensor([3, 0, 7], dtype=torch.int32)
    slopes = torch.rand(HEADS)
    fwd_args = (q, k, v, cq, ck, used, None, 9, 9, None, 0.3, True, -1, -1, 0.0, slopes, 0.0,
                False, "fa2")
    torch.library.opcheck(torch.ops.flash_attn.varlen_fwd.default, fwd_args)
    out, lse, rng_state = torch.ops.flash_attn.varlen_fwd(*fwd_args)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, rng_state, cq, ck, used, None, 9, 9,
                0.3, True, -1, -1, 0.0, slopes, 0.0, False, "fa2")
    torch.library.opcheck(torch.ops.flash_attn.varlen_bwd.default, bwd_args)


def test_compile_fullgraph_matches_eager(varlen_ext):
    q, k, v, cq, ck = packed([5, 11], [7, 3], d=32)

    def f(q, k, v):
        return flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 11, 7, causal=True)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v),
                               atol=0, rtol=0)
