"""flash_attn.reference on the CPU: the naive reference against SDPA and hand-computed cases,
and the FA1 / FA2 tiled algorithms against the naive reference. All float64 unless a test is
about the low-precision path. Runs in CPU-only CI."""

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from flash_attn.reference import (
    alibi_bias,
    attention_mask,
    attention_ref,
    flash_attn1_tiled,
    flash_attn2_tiled,
    flash_attn2_tiled_backward,
)

f64 = torch.float64
TIGHT = dict(atol=1e-10, rtol=1e-10)  # float64 against float64: only summation order differs

SEQLENS = [(1, 1), (1, 239), (113, 203), (239, 1), (65, 129), (203, 113)]
HEADS = [(3, 3), (6, 2)]  # MHA and GQA ratio 3


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh data per test, reproducible from the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _qkv(b, sq, sk, h, hk, d, dtype=f64, dv=None):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, dv or d, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v, mask=None, is_causal=False, scale=None):
    h = q.shape[2]
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    v = v.repeat_interleave(h // v.shape[2], dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2)


# ---- the naive reference -----------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", HEADS)
def test_ref_matches_sdpa(sq, sk, causal, h, hk):
    q, k, v = _qkv(2, sq, sk, h, hk, 40)
    out, lse = attention_ref(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == f64 and lse.dtype == f64 and lse.shape == (2, h, sq)
    visible = attention_mask(sq, sk, causal)
    rows = visible.any(-1)  # SDPA's output on rows that see nothing is not specified
    expected = _sdpa(q, k, v, mask=visible)
    torch.testing.assert_close(out[:, rows], expected[:, rows], **TIGHT)
    if causal and sq == sk:  # SDPA's own causal mask (top-left) coincides with ours when square
        torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=True), **TIGHT)
    # lse straight from its definition
    kk = k.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(40)
    s = s.masked_fill(~visible, -math.inf)
    torch.testing.assert_close(lse[..., rows], torch.logsumexp(s, -1)[..., rows], **TIGHT)


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("sq,sk", [(5, 9), (113, 203), (9, 5)])
def test_causal_is_bottom_right_like_torch(sq, sk):
    bias = pytest.importorskip("torch.nn.attention.bias")
    q, k, v = _qkv(1, sq, sk, 2, 2, 16)
    out = attention_ref(q, k, v, causal=True)
    expected = _sdpa(q, k, v, mask=bias.causal_lower_right(sq, sk))
    rows = attention_mask(sq, sk, causal=True).any(-1)
    torch.testing.assert_close(out[:, rows], expected[:, rows], **TIGHT)


def test_single_key_by_hand():
    q, k, v = _qkv(2, 1, 1, 3, 3, 8)
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, return_lse=True)
    torch.testing.assert_close(out, v, **TIGHT)
    torch.testing.assert_close(lse, (0.3 * (q * k).sum(-1)).transpose(1, 2), **TIGHT)


@pytest.mark.parametrize("sq,sk", [(3, 5), (5, 3), (4, 4)])
def test_causal_alignment_by_hand(sq, sk):
    # q = 0 makes every visible score equal: out_i = mean of the visible v, lse_i = log(count).
    _, k, v = _qkv(1, sq, sk, 1, 1, 4)
    q = torch.zeros(1, sq, 1, 4, dtype=f64)
    out, lse = attention_ref(q, k, v, causal=True, return_lse=True)
    for i in range(sq):
        last = i + sk - sq  # the last key row i sees
        if last < 0:
            assert torch.all(out[0, i] == 0) and lse[0, 0, i] == math.inf
        else:
            torch.testing.assert_close(out[0, i, 0], v[0, : last + 1, 0].mean(0), **TIGHT)
            torch.testing.assert_close(lse[0, 0, i].item(), math.log(last + 1), **TIGHT)


@pytest.mark.parametrize("sq,sk,window,causal", [
    (8, 8, (2, 1), False), (4, 8, (1, 0), False), (8, 4, (0, 2), False),
    (6, 9, (2, 3), True), (6, 9, (-1, 2), False), (6, 9, (3, -1), False),
])
def test_window_by_hand(sq, sk, window, causal):
    _, k, v = _qkv(1, sq, sk, 1, 1, 4)
    q = torch.zeros(1, sq, 1, 4, dtype=f64)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window, return_lse=True)
    left, right = window
    if causal:
        right = 0
    for i in range(sq):
        diag = i + sk - sq
        lo = 0 if left < 0 else max(0, diag - left)
        hi = sk - 1 if right < 0 else min(sk - 1, diag + right)
        if hi < lo:
            assert torch.all(out[0, i] == 0) and lse[0, 0, i] == math.inf
        else:
            torch.testing.assert_close(out[0, i, 0], v[0, lo:hi + 1, 0].mean(0), **TIGHT)
            torch.testing.assert_close(lse[0, 0, i].item(), math.log(hi - lo + 1), **TIGHT)


def test_window_left_unbounded_right_zero_is_causal():
    q, k, v = _qkv(2, 37, 53, 2, 1, 16)
    torch.testing.assert_close(attention_ref(q, k, v, window_size=(-1, 0)),
                               attention_ref(q, k, v, causal=True), **TIGHT)
    torch.testing.assert_close(attention_ref(q, k, v, causal=True, window_size=(-1, 5)),
                               attention_ref(q, k, v, causal=True), **TIGHT)


def test_softcap_by_hand():
    # headdim 1, scale 1: s_j = c tanh(q k_j / c), out = sum_j softmax(s)_j v_j.
    c = 2.5
    q = torch.tensor([[[[1.7]]]], dtype=f64)
    k = torch.tensor([[[[2.0]], [[-0.5]], [[3.0]]]], dtype=f64)
    v = torch.tensor([[[[1.0]], [[-2.0]], [[4.0]]]], dtype=f64)
    s = [c * math.tanh(1.7 * kj / c) for kj in (2.0, -0.5, 3.0)]
    z = sum(math.exp(x) for x in s)
    expected = sum(math.exp(x) / z * vj for x, vj in zip(s, (1.0, -2.0, 4.0)))
    out, lse = attention_ref(q, k, v, softcap=c, softmax_scale=1.0, return_lse=True)
    assert out.item() == pytest.approx(expected, rel=1e-12)
    assert lse.item() == pytest.approx(math.log(z), rel=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_by_hand(causal):
    sq, sk, h = 3, 5, 2
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float32)
    _, k, v = _qkv(1, sq, sk, h, h, 4)
    q = torch.zeros(1, sq, h, 4, dtype=f64)  # scores are the bias alone
    out, lse = attention_ref(q, k, v, causal=causal, alibi_slopes=slopes, return_lse=True)
    for hh in range(h):
        for i in range(sq):
            diag = i + sk - sq
            keys = range(diag + 1) if causal else range(sk)
            w = [math.exp(-slopes[hh].item() * abs(diag - j)) for j in keys]
            # flash_attn's causal kernel adds slope * j instead; same probabilities
            if causal:
                w2 = [math.exp(slopes[hh].item() * j) for j in keys]
                assert [x / sum(w) for x in w] == pytest.approx([x / sum(w2) for x in w2])
            expected = sum(wj / sum(w) * v[0, j, hh] for wj, j in zip(w, keys))
            torch.testing.assert_close(out[0, i, hh], expected, **TIGHT)
            assert lse[0, hh, i].item() == pytest.approx(math.log(sum(w)), rel=1e-12)


def test_alibi_per_batch_slopes():
    q, k, v = _qkv(2, 7, 11, 2, 2, 8)
    slopes = torch.rand(2, 2)
    out = attention_ref(q, k, v, alibi_slopes=slopes)
    for bb in range(2):
        torch.testing.assert_close(out[bb:bb + 1],
                                   attention_ref(q[bb:bb + 1], k[bb:bb + 1], v[bb:bb + 1],
                                                 alibi_slopes=slopes[bb]), **TIGHT)
    assert alibi_bias(slopes, 7, 11).shape == (2, 2, 7, 11)


def test_gqa_head_mapping():
    # Query head hq reads K/V head hq // 3 (h=6, hk=2).
    q, k, v = _qkv(2, 17, 23, 6, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True, return_lse=True)
    for hq in range(6):
        kv = slice(hq // 3, hq // 3 + 1)
        o1, l1 = attention_ref(q[:, :, hq:hq + 1], k[:, :, kv], v[:, :, kv], causal=True,
                               return_lse=True)
        torch.testing.assert_close(out[:, :, hq:hq + 1], o1, **TIGHT)
        torch.testing.assert_close(lse[:, hq:hq + 1], l1, **TIGHT)


def test_dropout_with_mask():
    q, k, v = _qkv(2, 9, 13, 4, 2, 8)
    p = 0.25
    keep_all = torch.ones(2, 4, 9, 13, dtype=torch.bool)
    plain, lse0 = attention_ref(q, k, v, return_lse=True)
    out, lse = attention_ref(q, k, v, dropout_p=p, dropout_mask=keep_all, return_lse=True)
    torch.testing.assert_close(out, plain / (1 - p), **TIGHT)
    torch.testing.assert_close(lse, lse0, **TIGHT)  # lse ignores dropout

    mask = torch.rand(2, 4, 9, 13) > p
    out = attention_ref(q, k, v, dropout_p=p, dropout_mask=mask)
    kk, vv = (x.repeat_interleave(2, dim=2) for x in (k, v))
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(8), -1)
    expected = torch.einsum("bhqk,bkhd->bqhd", probs * mask / (1 - p), vv)
    torch.testing.assert_close(out, expected, **TIGHT)
    with pytest.raises(ValueError):
        attention_ref(q, k, v, dropout_p=p)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_path(dtype):
    q, k, v = _qkv(2, 33, 47, 4, 2, 16, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal=True, upcast=False, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    truth, lse64 = attention_ref(q, k, v, causal=True, return_lse=True)
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), truth, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), lse64, atol=tol * 8, rtol=tol)


@pytest.mark.parametrize("upcast,dtype", [(True, f64), (False, torch.float32),
                                          (False, torch.bfloat16)])
def test_fully_masked_rows_zero_out_inf_lse_finite_grads(upcast, dtype):
    # causal (239, 1): only the last query row sees the single key.
    q, k, v = (x.requires_grad_() for x in _qkv(2, 239, 1, 3, 1, 16, dtype=dtype))
    out, lse = attention_ref(q, k, v, causal=True, upcast=upcast, return_lse=True)
    assert torch.all(out[:, :238] == 0) and torch.all(lse[..., :238] == math.inf)
    torch.testing.assert_close(out[:, 238].double(), v[:, 0].double().expand(2, 3, 16),
                               atol=0, rtol=0)
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :238] == 0)


# ---- the tiled algorithms against the naive reference --------------------------------------------

@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("d", [40, 72])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", HEADS)
def test_tiled_forward(sq, sk, d, causal, h, hk):
    q, k, v = _qkv(2, sq, sk, h, hk, d)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True)
    # Block sizes that divide none of the seqlens, and differ, so ragged and skipped tiles occur.
    for algo in (flash_attn1_tiled, flash_attn2_tiled):
        out, lse = algo(q, k, v, causal=causal, block_q=32, block_k=48)
        torch.testing.assert_close(out, ref, **TIGHT)
        torch.testing.assert_close(lse, ref_lse, **TIGHT)


@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("d", [40, 72])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", HEADS)
def test_tiled_backward(sq, sk, d, causal, h, hk):
    q, k, v = (x.requires_grad_() for x in _qkv(2, sq, sk, h, hk, d))
    ref = attention_ref(q, k, v, causal=causal)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    out, lse = flash_attn2_tiled(q.detach(), k.detach(), v.detach(), causal=causal)
    dq, dk, dv = flash_attn2_tiled_backward(q.detach(), k.detach(), v.detach(), out, lse, dout,
                                            causal=causal, block_q=48, block_k=32)
    assert dk.shape == k.shape and dv.shape == v.shape
    torch.testing.assert_close(dq, q.grad, **TIGHT)
    torch.testing.assert_close(dk, k.grad, **TIGHT)
    torch.testing.assert_close(dv, v.grad, **TIGHT)


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (7, 5), (16, 128), (256, 256)])
def test_tiled_block_sizes(block_q, block_k):
    q, k, v = (x.requires_grad_() for x in _qkv(1, 65, 43, 6, 2, 24))
    ref, ref_lse = attention_ref(q, k, v, causal=True, softmax_scale=0.4, return_lse=True)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    for algo in (flash_attn1_tiled, flash_attn2_tiled):
        out, lse = algo(q.detach(), k.detach(), v.detach(), causal=True, softmax_scale=0.4,
                        block_q=block_q, block_k=block_k)
        torch.testing.assert_close(out, ref.detach(), **TIGHT)
        torch.testing.assert_close(lse, ref_lse, **TIGHT)
    grads = flash_attn2_tiled_backward(q.detach(), k.detach(), v.detach(), out, lse, dout,
                                       causal=True, softmax_scale=0.4,
                                       block_q=block_q, block_k=block_k)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, **TIGHT)


@pytest.mark.parametrize("sq,sk", [(239, 1), (100, 30)])
def test_tiled_fully_masked_rows(sq, sk):
    q, k, v = _qkv(2, sq, sk, 6, 2, 16)
    empty = ~attention_mask(sq, sk, causal=True).any(-1)
    assert empty.sum() == sq - sk
    for algo in (flash_attn1_tiled, flash_attn2_tiled):
        out, lse = algo(q, k, v, causal=True, block_q=16, block_k=16)
        assert torch.all(out[:, empty] == 0) and torch.all(lse[..., empty] == math.inf)
        assert torch.isfinite(out).all()
    dout = torch.randn_like(out)
    dq, dk, dv = flash_attn2_tiled_backward(q, k, v, out, lse, dout, causal=True,
                                            block_q=16, block_k=16)
    assert torch.all(dq[:, empty] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_tiled_low_precision_dtypes():
    q, k, v = _qkv(1, 50, 70, 2, 1, 32, dtype=torch.float16)
    truth = attention_ref(q, k, v, causal=True)
    for algo in (flash_attn1_tiled, flash_attn2_tiled):
        out, lse = algo(q, k, v, causal=True, block_q=16, block_k=32)
        assert out.dtype == torch.float16 and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), truth, atol=2e-3, rtol=2e-3)
