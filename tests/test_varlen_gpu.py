"""flash_attn_varlen_func on the GPU, for every family whose build_matrix entry has the "varlen"
feature, held to the error-versus-error rule of _gpu_common.py against
reference.attention_varlen_ref (float64, and plain PyTorch at the input precision) on ragged
batches, forward and backward.

Beyond the rule: rows past a sequence's seqused_q are exactly 0 (lse +inf, dq 0); NaN stored in
the rows a call must not read (past seqused_k, in a paged cache's unused slots, between the
sequences of a seqused batch) never reaches an output or a gradient; a batch of equal lengths
gives flash_attn_func's result bit for bit; paged and contiguous K/V agree bit for bit.

A family without the feature skips, saying so.
"""

import math
import zlib

import pytest
import torch

import flash_attn
from flash_attn import build_matrix, reference
from conftest import requires_gpu
from _gpu_common import (
    DEVICE, Result, assert_lse, assert_rule, dtype_params, keep_mask, leaves, poison_allocator,
    randn, skip_unless_built,
)

pytestmark = requires_gpu

DTYPES = dtype_params()
FAMILIES = [pytest.param(f, id=f) for f in ("fa2", "fa3")]
# Lengths around the 128-row tiles, an empty sequence and a long one.
RAGGED = ([0, 1, 127, 128, 129, 2049], [5, 0, 128, 129, 300, 2049])


@pytest.fixture(autouse=True)
def _fa3_backward_on_short_calls(every_call_long):
    """fa3's own backward on the short batches too (conftest.every_call_long)."""


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def skip_unless_varlen(family, dtype, d, directions=("fwd",)):
    for direction in directions:
        owner = (family if direction == "fwd" else
                 build_matrix.backward_family(family, d, {"varlen"}))
        if "varlen" not in build_matrix.FAMILIES[owner].features:
            pytest.skip(f"{owner} has no variable-length {direction} kernels in this version")
    if family not in flash_attn.available_backends():
        pytest.skip(f"this build does not run {family} on this GPU")
    for direction in directions:
        owner = (family if direction == "fwd" else
                 build_matrix.backward_family(family, d, {"varlen"}))
        skip_unless_built(owner, dtype, d, (direction,))


def cu(lengths):
    return torch.tensor([0] + list(lengths), device=DEVICE).cumsum(0).to(torch.int32)


def ragged(lengths_q, lengths_k, h, hk, d, dtype):
    return (randn(sum(lengths_q), h, d, dtype=dtype), randn(sum(lengths_k), hk, d, dtype=dtype),
            randn(sum(lengths_k), hk, d, dtype=dtype))


def varlen_result(inputs, cq, ck, max_q, max_k, dout, family, **attn):
    lv = leaves(inputs)
    poison_allocator()
    out, lse, probs = flash_attn.flash_attn_varlen_func(*lv, cq, ck, max_q, max_k,
                                                        return_attn_probs=True, backend=family,
                                                        **attn)
    poison_allocator()
    grads = torch.autograd.grad(out, lv, dout)
    return Result(out.detach(), lse, grads, probs)


def reference_result(inputs, cq, ck, dout, upcast, keep=None, **attn):
    lv = leaves(inputs, torch.float64 if upcast else None)
    out, lse = reference.attention_varlen_ref(*lv, cq, ck, dropout_mask=keep, upcast=upcast,
                                              return_lse=True, **attn)
    grads = torch.autograd.grad(out, lv, dout.to(out.dtype))
    return Result(out.detach(), lse, grads)


def check_varlen(family, lengths_q, lengths_k, h, hk, d, dtype, **attn):
    """Ours against both references; returns (ours, truth)."""
    inputs = ragged(lengths_q, lengths_k, h, hk, d, dtype)
    cq, ck = cu(lengths_q), cu(lengths_k)
    dout = randn(sum(lengths_q), h, d, dtype=dtype)
    ours = varlen_result(inputs, cq, ck, max(lengths_q), max(lengths_k), dout, family, **attn)
    keep = keep_mask(ours.probs) if attn.get("dropout_p", 0) > 0 else None
    truth = reference_result(inputs, cq, ck, dout, True, keep, **attn)
    lowp = reference_result(inputs, cq, ck, dout, False, keep, **attn)
    assert_rule("out", ours.out, lowp.out, truth.out, 2, dtype)
    assert_lse(ours.lse, truth.lse)
    for name, g, g_lowp, g_truth in zip("qkv", ours.grads, lowp.grads, truth.grads):
        assert_rule(f"d{name}", g, g_lowp, g_truth, 3, dtype)
    return ours, truth


# ---- the rule on ragged batches ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("family", FAMILIES)
def test_ragged(family, d, causal, dtype):
    skip_unless_varlen(family, dtype, d, ("fwd", "bwd"))
    check_varlen(family, *RAGGED, 6, 2, d, dtype, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [40, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_every_head_dim(family, d, causal):
    """The forward alone at every kernel head dim (and two padded ones): the kernels that hold O
    differently (fa3's staged store at 256) meet the packed layout here."""
    dtype = torch.bfloat16
    skip_unless_varlen(family, dtype, d)
    lengths_q, lengths_k = [1, 130, 0, 257], [300, 7, 5, 257]
    inputs = ragged(lengths_q, lengths_k, 4, 2, d, dtype)
    cq, ck = cu(lengths_q), cu(lengths_k)
    poison_allocator()
    with torch.no_grad():
        out, lse, _ = flash_attn.flash_attn_varlen_func(*inputs, cq, ck, max(lengths_q),
                                                   max(lengths_k), causal=causal,
                                                   return_attn_probs=True, backend=family)
    truth, truth_lse = reference.attention_varlen_ref(
        *(t.double() for t in inputs), cq, ck, causal=causal, upcast=True, return_lse=True)
    lowp = reference.attention_varlen_ref(*inputs, cq, ck, causal=causal, upcast=False)
    assert_rule("out", out, lowp, truth, 2, dtype)
    assert_lse(lse, truth_lse)


@pytest.mark.parametrize("attn", [
    pytest.param(dict(window_size=(33, 7)), id="window"),
    pytest.param(dict(softcap=5.0, causal=True), id="softcap"),
    pytest.param(dict(causal=True, alibi="per-batch"), id="alibi"),
    pytest.param(dict(dropout_p=0.17, causal=True), id="dropout"),
])
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("family", FAMILIES)
def test_features(family, d, attn):
    dtype = torch.bfloat16
    skip_unless_varlen(family, dtype, d, ("fwd", "bwd"))
    if "dropout_p" in attn and "dropout" not in build_matrix.FAMILIES[family].features:
        pytest.skip(f"{family} has no dropout")
    attn = dict(attn)
    if attn.pop("alibi", None):
        base = 2.0 ** (-8.0 * torch.arange(1, 8, device=DEVICE) / 7)
        attn["alibi_slopes"] = (base * (0.5 + torch.rand(len(RAGGED[0]), 7,
                                                          device=DEVICE))).float()
    check_varlen(family, *RAGGED, 7, 7, d, dtype, **attn)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_backward(family, causal):
    """deterministic=True on a ragged batch: the rule, and five runs equal bit for bit (fa2
    orders its dQ adds by turns that skip the key tiles past a shorter sequence; fa3 adds in
    fixed point, with K / V bounds and dQ scales per sequence)."""
    dtype, d = torch.bfloat16, 128
    skip_unless_varlen(family, dtype, d, ("fwd", "bwd"))
    lengths_q, lengths_k = RAGGED
    inputs = ragged(lengths_q, lengths_k, 6, 2, d, dtype)
    cq, ck = cu(lengths_q), cu(lengths_k)
    dout = randn(sum(lengths_q), 6, d, dtype=dtype)
    runs = [varlen_result(inputs, cq, ck, max(lengths_q), max(lengths_k), dout, family,
                          causal=causal, deterministic=True) for _ in range(5)]
    truth = reference_result(inputs, cq, ck, dout, True, causal=causal)
    lowp = reference_result(inputs, cq, ck, dout, False, causal=causal)
    for name, g, g_lowp, g_truth in zip("qkv", runs[0].grads, lowp.grads, truth.grads):
        assert_rule(f"d{name}", g, g_lowp, g_truth, 3, dtype)
    for run in runs[1:]:
        for name, g, g0 in zip("qkv", run.grads, runs[0].grads):
            assert torch.equal(g, g0), f"d{name} differs bitwise between deterministic runs"


@pytest.mark.parametrize("family", FAMILIES)
def test_seqused_and_nan_past_it(family):
    dtype, d = torch.float16, 128
    skip_unless_varlen(family, dtype, d, ("fwd", "bwd"))
    lengths_q, lengths_k = [64, 300, 7, 129], [200, 50, 0, 129]
    used_q = torch.tensor([64, 131, 0, 100], dtype=torch.int32, device=DEVICE)
    used_k = torch.tensor([77, 50, 0, 1], dtype=torch.int32, device=DEVICE)
    inputs = ragged(lengths_q, lengths_k, 4, 4, d, dtype)
    # What a call must not read holds NaN: the unused rows of q, k and v.
    for t, lengths, used in ((inputs[0], lengths_q, used_q), (inputs[1], lengths_k, used_k),
                             (inputs[2], lengths_k, used_k)):
        for start, n, u in zip(cu(lengths).tolist(), lengths, used.tolist()):
            t[start + u:start + n] = math.nan
    cq, ck = cu(lengths_q), cu(lengths_k)
    dout = randn(sum(lengths_q), 4, d, dtype=dtype)
    ours = varlen_result(inputs, cq, ck, 300, 200, dout, family, causal=True,
                         seqused_q=used_q, seqused_k=used_k)
    truth = reference_result([t.nan_to_num(0.0) for t in inputs], cq, ck, dout, True,
                             causal=True, seqused_q=used_q, seqused_k=used_k)
    lowp = reference_result([t.nan_to_num(0.0) for t in inputs], cq, ck, dout, False,
                            causal=True, seqused_q=used_q, seqused_k=used_k)
    assert_rule("out", ours.out, lowp.out, truth.out, 2, dtype)
    assert_lse(ours.lse, truth.lse)
    for name, g, g_lowp, g_truth in zip("qkv", ours.grads, lowp.grads, truth.grads):
        assert_rule(f"d{name}", g, g_lowp, g_truth, 3, dtype)
    for start, n, u in zip(cq.tolist(), lengths_q, used_q.tolist()):
        assert (ours.out[start + u:start + n] == 0).all()
        assert (ours.grads[0][start + u:start + n] == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_equal_lengths_match_the_dense_call(family):
    dtype, d, b, s = torch.bfloat16, 128, 3, 513
    skip_unless_varlen(family, dtype, d)
    q, k, v = (randn(b, s, 8, d, dtype=dtype) for _ in range(3))
    c = cu([s] * b)
    with torch.no_grad():
        dense = flash_attn.flash_attn_func(q, k, v, causal=True, backend=family)
        packed = flash_attn.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), c, c,
                                                   s, s, causal=True, backend=family)
    assert torch.equal(packed, dense.flatten(0, 1))


@pytest.mark.parametrize("page", [1, 8, 16, 48, 64, 256])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_matches_contiguous(family, page):
    dtype, d = torch.bfloat16, 128
    skip_unless_varlen(family, dtype, d)
    if "paged_kv" not in build_matrix.FAMILIES[family].features:
        pytest.skip(f"{family} has no paged K/V kernels in this version")
    lengths_q, lengths_k = [1, 17, 300], [1000, 17, 300]
    q, k, v = ragged(lengths_q, lengths_k, 8, 2, d, dtype)
    cq, ck = cu(lengths_q), cu(lengths_k)
    pages = [-(-n // page) for n in lengths_k]
    num_blocks = 2 * sum(pages) + 3
    order = torch.randperm(num_blocks, device=DEVICE)
    block_table = torch.zeros(len(pages), max(pages), dtype=torch.int32, device=DEVICE)
    k_cache = torch.full((num_blocks, page, 2, d), math.nan, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, math.nan)
    used = 0
    for b, (start, n) in enumerate(zip(ck.tolist(), lengths_k)):
        block_table[b, :pages[b]] = order[used:used + pages[b]]
        used += pages[b]
        rows = torch.arange(n, device=DEVICE)
        slots = block_table[b, rows // page].long()
        k_cache[slots, rows % page] = k[start:start + n]
        v_cache[slots, rows % page] = v[start:start + n]
    paged = dict(causal=True, block_table=block_table, backend=family)
    if family == "fa3" and page % 8:  # fa3's boxes need pages of a multiple of 8 rows
        with pytest.raises(NotImplementedError, match="page_block_size is not a multiple of 8"):
            flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 300, 1000, **paged)
        return
    with torch.no_grad():
        want = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, 300, 1000, causal=True,
                                                 backend=family)
        got = flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 300, 1000, **paged)
    assert torch.equal(got, want)
