"""flash_attn_with_kvcache without a GPU: validation, dispatch, the in-place op and the reference
semantics (append, rotary, cache_batch_idx, cache_leftpad, paged caches), with the CPU stand-in
extension (tests/conftest.py) computing reference.attention_kvcache_ref in the kernels' place.
``kvcache_ext`` plays a build whose fa2 and fa3 have the "kvcache" feature; without it the call
must say that no backend supports it.
"""

import dataclasses
import math

import pytest
import torch

import flash_attn
from flash_attn import _dispatch, _validate, build_matrix, reference
from conftest import give_features

B, H, HK, D = 3, 8, 2, 64
CAPACITY = 40


@pytest.fixture
def kvcache_ext(fake_ext, monkeypatch):
    give_features(monkeypatch, {"kvcache", "paged_kv"})
    return fake_ext


def gen(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def inputs(seqlen_q=1, seqlen_new=1, batch_cache=B):
    q = gen(B, seqlen_q, H, D, seed=1)
    k_cache, v_cache = gen(batch_cache, CAPACITY, HK, D, seed=2), gen(batch_cache, CAPACITY, HK,
                                                                     D, seed=3)
    k, v = gen(B, seqlen_new, HK, D, seed=4), gen(B, seqlen_new, HK, D, seed=5)
    return q, k_cache, v_cache, k, v


def rotary_tables(rotary_dim=32, positions=CAPACITY):
    angle = torch.rand(positions, rotary_dim // 2,
                       generator=torch.Generator().manual_seed(6)) * 2 * math.pi
    return torch.cos(angle).to(torch.bfloat16), torch.sin(angle).to(torch.bfloat16)


# ---- a build without KV-cache kernels ---------------------------------------------------------

def test_without_kvcache_kernels_the_call_says_so(fake_ext, monkeypatch):
    for name, fam in list(build_matrix.FAMILIES.items()):
        monkeypatch.setitem(build_matrix.FAMILIES, name, dataclasses.replace(
            fam, features=fam.features - {"kvcache"}))
    monkeypatch.setattr(_dispatch, "_DECISIONS", {})
    q, k_cache, v_cache, _, _ = inputs()
    with pytest.raises(NotImplementedError, match=r"No backend in this version supports "
                                                  r"attention over a KV cache"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    assert fake_ext.calls == []


# ---- which calls are "decode" calls (dispatch: fa2 first) --------------------------------------

@pytest.mark.parametrize("seqlen_q,decode", [(1, True), (16, True), (17, False)])
def test_decode_feature(kvcache_ext, seqlen_q, decode):
    # H / HK = 4 query heads per KV head: up to 64 rows (build_matrix.DECODE_MAX_ROWS) decode.
    q, k_cache, v_cache, _, _ = inputs(seqlen_q=seqlen_q)
    call = _validate.validate_kvcache_call(q, k_cache, v_cache, cache_seqlens=5)
    assert ("decode" in call.features) == decode and "kvcache" in call.features


# ---- the reference's semantics ----------------------------------------------------------------

def test_decode_step_is_attention_over_the_cache_prefix(kvcache_ext):
    q, k_cache, v_cache, k, v = inputs()
    lengths = torch.tensor([0, 17, 39], dtype=torch.int32)
    before = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                  causal=True, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (B, H, 1)
    for b, n in enumerate(lengths.tolist()):
        # The new token landed at position n, nothing else moved.
        assert torch.equal(k_cache[b, n], k[b, 0]) and torch.equal(v_cache[b, n], v[b, 0])
        untouched = [j for j in range(CAPACITY) if j != n]
        assert torch.equal(k_cache[b, untouched], before[0][b, untouched])
        want, want_lse = reference.attention_ref(q[b:b + 1], k_cache[None, b, :n + 1],
                                                 v_cache[None, b, :n + 1], causal=True,
                                                 return_lse=True)
        torch.testing.assert_close(out[b:b + 1], want.to(q.dtype), atol=0, rtol=0)
        torch.testing.assert_close(lse[b:b + 1], want_lse.float(), atol=0, rtol=0)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_positions(kvcache_ext, interleaved, causal):
    q, k_cache, v_cache, k, v = inputs(seqlen_q=3, seqlen_new=3)
    cos, sin = rotary_tables()
    lengths = torch.tensor([2, 10, 30], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin,
                                       cache_seqlens=lengths, causal=causal,
                                       rotary_interleaved=interleaved)
    for b, n in enumerate(lengths.tolist()):
        positions = torch.arange(n, n + 3)
        want = reference.apply_rotary(k[b], cos, sin, positions, interleaved)
        assert torch.equal(k_cache[b, n:n + 3], want)
        assert torch.equal(v_cache[b, n:n + 3], v[b])     # v is never rotated
        assert torch.equal(k_cache[b, n:n + 3, :, 32:], k[b, :, :, 32:])  # past rotary_dim


def test_apply_rotary_is_a_rotation():
    x = torch.randn(5, 2, 32, dtype=torch.float64)
    angle = torch.rand(5, 8, dtype=torch.float64) * 2 * math.pi
    for interleaved in (True, False):
        y = reference.apply_rotary(x, angle.cos(), angle.sin(), torch.arange(5), interleaved)
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
        # Position 0 with angle 0 is the identity.
        ident = reference.apply_rotary(x, torch.ones(1, 8, dtype=torch.float64),
                                       torch.zeros(1, 8, dtype=torch.float64),
                                       torch.zeros(5, dtype=torch.long), interleaved)
        assert torch.equal(ident, x)
    # A quarter turn maps each pair (a, b) to (-b, a): pairs (2i, 2i + 1) or (i, i + 8).
    quarter = reference.apply_rotary(x, torch.zeros(1, 8, dtype=torch.float64),
                                     torch.ones(1, 8, dtype=torch.float64),
                                     torch.zeros(5, dtype=torch.long), True)
    assert torch.equal(quarter[..., 0:16:2], -x[..., 1:16:2])
    assert torch.equal(quarter[..., 1:16:2], x[..., 0:16:2])
    quarter = reference.apply_rotary(x, torch.zeros(1, 8, dtype=torch.float64),
                                     torch.ones(1, 8, dtype=torch.float64),
                                     torch.zeros(5, dtype=torch.long), False)
    assert torch.equal(quarter[..., :8], -x[..., 8:16])
    assert torch.equal(quarter[..., 8:16], x[..., :8])
    assert torch.equal(quarter[..., 16:], x[..., 16:])


def test_batch_idx_and_leftpad(kvcache_ext):
    q, k_cache, v_cache, k, v = inputs(batch_cache=5)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    lengths = torch.tensor([7, 20, 3], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 3], dtype=torch.int32)
    spare = k_cache[[1, 3]].clone()
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                             cache_batch_idx=idx, cache_leftpad=leftpad,
                                             causal=True)
    assert torch.equal(k_cache[[1, 3]], spare)   # rows no sequence uses stay as they were
    for b in range(B):
        row, n, first = idx[b].item(), lengths[b].item(), leftpad[b].item()
        assert torch.equal(k_cache[row, n], k[b, 0])
        want = reference.attention_ref(q[b:b + 1], k_cache[None, row, first:n + 1],
                                       v_cache[None, row, first:n + 1], causal=True)
        torch.testing.assert_close(out[b:b + 1], want.to(q.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("page", [1, 7, 16])
def test_paged_cache_matches_contiguous(kvcache_ext, page):
    q, k_cache, v_cache, k, v = inputs(seqlen_q=2, seqlen_new=2)
    cos, sin = rotary_tables(positions=48)
    lengths = torch.tensor([0, 13, 30], dtype=torch.int32)
    pages = -(-CAPACITY // page)
    num_blocks = B * pages + 5
    block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))[
        :B * pages].view(B, pages).to(torch.int32)
    paged_k = torch.full((num_blocks, page, HK, D), math.nan, dtype=k_cache.dtype)
    paged_v = torch.full_like(paged_k, math.nan)
    for b in range(B):
        for j in range(CAPACITY):
            paged_k[block_table[b, j // page], j % page] = k_cache[b, j]
            paged_v[block_table[b, j // page], j % page] = v_cache[b, j]
    want = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin,
                                              cache_seqlens=lengths, causal=True)
    got = flash_attn.flash_attn_with_kvcache(q, paged_k, paged_v, k, v, cos, sin,
                                             cache_seqlens=lengths, block_table=block_table,
                                             causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for b, n in enumerate(lengths.tolist()):
        for j in range(n, n + 2):
            assert torch.equal(paged_k[block_table[b, j // page], j % page], k_cache[b, j])


def test_int_and_missing_cache_seqlens(kvcache_ext):
    q, k_cache, v_cache, _, _ = inputs()
    as_int = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=9)
    as_tensor = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                   cache_seqlens=torch.full((B,), 9,
                                                                            dtype=torch.int32))
    torch.testing.assert_close(as_int, as_tensor, atol=0, rtol=0)
    full = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache)
    whole = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=CAPACITY)
    torch.testing.assert_close(full, whole, atol=0, rtol=0)


def test_compile_fullgraph_writes_the_cache(kvcache_ext):
    q, k_cache, v_cache, k, v = inputs()
    lengths = torch.tensor([1, 2, 3], dtype=torch.int32)
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    want = flash_attn.flash_attn_with_kvcache(q, k_eager, v_eager, k, v, cache_seqlens=lengths)

    def step(q, k_cache, v_cache, k, v, lengths):
        return flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                  cache_seqlens=lengths)
    got = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k, v, lengths)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)


def test_opcheck_kvcache_op(kvcache_ext):
    q, k_cache, v_cache, k, v = inputs()
    cos, sin = rotary_tables()
    args = (q, k_cache, v_cache, k, v, cos, sin, torch.tensor([3, 4, 5], dtype=torch.int32), -1,
            None, None, None, 0.125, True, -1, -1, 0.0, True, None, 0, "fa2")
    torch.library.opcheck(torch.ops.flash_attn.kvcache_fwd.default, args)


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("over,error,pattern", [
    (dict(k=gen(B, 1, HK, D, seed=9)), ValueError,
     r"k and v \(the new keys and values to append\) must be given together"),
    (dict(k=gen(B, 1, HK + 1, D, seed=9), v=gen(B, 1, HK + 1, D, seed=9)), ValueError,
     r"k must have shape \(batch, seqlen_new, nheads_k, headdim\) = \(3, 1, 2, 64\), got "
     r"\(3, 1, 3, 64\)"),
    (dict(cache_seqlens=40, k=gen(B, 1, HK, D, seed=9), v=gen(B, 1, HK, D, seed=9)),
     ValueError, r"cache_seqlens is 40; with 1 new tokens it must be in \[0, 39\]"),
    (dict(cache_seqlens=torch.tensor([1, 2, 3])), TypeError,
     r"cache_seqlens must be torch.int32, got torch.int64"),
    (dict(cache_seqlens=2.0), TypeError, r"cache_seqlens must be an int, an int32 tensor"),
    (dict(rotary_cos=rotary_tables()[0]), ValueError,
     r"rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=rotary_tables(24)[0], rotary_sin=rotary_tables(24)[1]), ValueError,
     r"rotary_dim = 2 x their dim 1 = 24 dims; it must be a multiple of 16"),
    (dict(rotary_cos=rotary_tables(positions=39)[0], rotary_sin=rotary_tables(positions=39)[1]),
     ValueError, r"rotary_cos has 39 positions; it needs one per cache position \(40\)"),
    (dict(cache_leftpad=torch.zeros(B, dtype=torch.int32),
          block_table=torch.zeros(B, 1, dtype=torch.int32)), ValueError,
     r"cache_leftpad cannot be combined with block_table"),
    (dict(num_splits=-1), ValueError, r"num_splits must be an int >= 0"),
    (dict(cache_seqlens=None, k=gen(B, 1, HK, D, seed=9), v=gen(B, 1, HK, D, seed=9)),
     ValueError, r"cache_seqlens must be given with k and v"),
    (dict(cache_seqlens=None, rotary_cos=rotary_tables()[0], rotary_sin=rotary_tables()[1]),
     ValueError, r"q is rotated up to position 40 \(cache_seqlens 40\), past the 40 positions"),
    (dict(cache_seqlens=30, causal=True, q=gen(B, 12, H, D, seed=9),
          rotary_cos=rotary_tables()[0], rotary_sin=rotary_tables()[1]),
     ValueError, r"q is rotated up to position 41 \(cache_seqlens 30 \+ seqlen_q - 1\)"),
    (dict(k_cache=gen(B, HK, CAPACITY, D, seed=9).transpose(1, 2),
          v_cache=gen(B, HK, CAPACITY, D, seed=9).transpose(1, 2)), None, None),
    (dict(k_cache=gen(B, CAPACITY, HK, D + 1, seed=9)[..., 1:],
          v_cache=gen(B, CAPACITY, HK, D + 1, seed=9)[..., 1:]), ValueError,
     r"k_cache must start and step in 16-byte units"),
    (dict(k_cache=gen(B, CAPACITY, HK, D, seed=9).transpose(-1, -2).contiguous()
          .transpose(-1, -2)), ValueError,
     r"k_cache must be contiguous in its last dim \(the cache is updated in place"),
    (dict(v_cache=gen(B, CAPACITY - 1, HK, D, seed=9)), ValueError,
     r"v_cache must have the shape of k_cache"),
])
def test_bad_arguments_are_named(kvcache_ext, over, error, pattern):
    q, k_cache, v_cache, _, _ = inputs()
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=4)
    args.update(over)
    if error is None:   # a strided cache whose rows the kernels can read in place: accepted
        flash_attn.flash_attn_with_kvcache(**args)
        return
    with pytest.raises(error, match=pattern):
        flash_attn.flash_attn_with_kvcache(**args)
    assert kvcache_ext.calls == []


def test_a_valid_call_is_remembered_by_metadata_only(kvcache_ext):
    # A call that passed is not re-checked when it comes again (a decode loop); anything the
    # checks read that differs is checked afresh: a bool where an int is wanted, a dtype, a
    # stride, a device type.
    q, k_cache, v_cache, k, v = inputs()
    lengths = torch.tensor([1, 2, 3], dtype=torch.int32)
    good = dict(k=k, v=v, cache_seqlens=lengths, num_splits=1, causal=True)
    first = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **good)
    again = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **good)
    assert torch.equal(first, again) and len(kvcache_ext.calls) == 2
    with pytest.raises(ValueError, match=r"num_splits must be an int >= 0"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **dict(good, num_splits=True))
    with pytest.raises(ValueError, match=r"must be torch.bfloat16 on cpu like q"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **dict(good, k=k.half()))
    strided = gen(B, CAPACITY, HK, D, seed=9).transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match=r"k_cache must be contiguous in its last dim"):
        flash_attn.flash_attn_with_kvcache(q, strided, v_cache, **good)
    with pytest.raises(ValueError, match=r"must be on a CUDA device"):
        flash_attn.flash_attn_with_kvcache(q.to("meta"), k_cache.to("meta"),
                                           v_cache.to("meta"), **good)
    assert len(kvcache_ext.calls) == 2


def test_remembered_calls_are_bounded_and_unhashable_ones_checked(kvcache_ext, monkeypatch):
    # An int cache_seqlens makes every decode step a new entry: the memo is cleared when full
    # rather than growing. A list window_size cannot be a key: that call is checked each time.
    from flash_attn import _validate
    monkeypatch.setattr(_validate, "_VALID", {})
    monkeypatch.setattr(_validate, "_VALID_MAX", 4)
    q, k_cache, v_cache, _, _ = inputs()
    for n in range(10):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=n)
        assert 1 <= len(_validate._VALID) <= 4
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, window_size=[8, 0])
    with pytest.raises(ValueError, match=r"cache_seqlens is 41"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=41,
                                           window_size=[8, 0])


def test_cache_batch_must_match_without_batch_idx(kvcache_ext):
    q, k_cache, v_cache, _, _ = inputs(batch_cache=5)
    with pytest.raises(ValueError, match=r"k_cache has batch size 5 but q has 3; they must "
                                         r"match unless cache_batch_idx picks the cache rows"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1)


def test_empty_cache(kvcache_ext):
    # Capacity 0: a valid call whose rows all see no key (the extension returns before any
    # kernel; here the stand-in computes the reference's answer).
    q = gen(B, 20, H, D, seed=1)
    k_cache, v_cache = gen(B, 0, HK, D, seed=2), gen(B, 0, HK, D, seed=3)
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0,
                                                  return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
