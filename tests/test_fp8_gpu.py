"""fa3's FP8 (e4m3) forward against the float64 truth, on sm90.

The inputs are fresh random tensors quantised the way a caller would: one scale per (batch, KV
head), amax / 448. The truth is attention over the dequantised inputs (q8 * q_descale, ...) in
float64. The yardstick (``lowp``) is plain PyTorch at the kernel's precision: the scores of the
e4m3 inputs by torch's FP8 GEMM (torch._scaled_mm with fast accumulation: the tensor cores' own
FP8 accumulation, whose ~14-bit adds cost the scores, and so the lse, about 1e-3 in logit units
on these inputs), P rounded to e4m3 as the kernel rounds it (2^8 times the softmax's numerator,
the row sums unrounded), P V in fp32, the output in bf16. The rule is test_fa*_gpu's, with the lse
measured against the yardstick's as the outputs are: err(ours) <= 2 err(lowp) + ulp(bf16) for
out; |lse - truth| <= 2 err(lowp's lse) + LSE_TOL (1 + |truth|); rows that see no key give out 0
and lse +inf. Outputs come from a poisoned allocator (_gpu_common).
"""

import functools
import importlib
import math

import pytest
import torch

import flash_attn
from flash_attn.reference import attention_mask, attention_ref

from _gpu_common import DEVICE, LSE_TOL, poison_allocator

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the FP8 forward runs on sm90 only")

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _skip_unless_built(head_dim):
    padded = -(-head_dim // 8) * 8
    have = [c for c in importlib.import_module("flash_attn._C").built_configs()
            if c[0] == "fa3" and c[1] == "fwd" and c[2] == "e4m3" and c[3] >= padded]
    if not have:
        pytest.skip(f"this build has no fa3 e4m3 forward for head dim {head_dim}")


def _quantize(x, heads_k):
    """x (b, s, h, d) -> (e4m3 x / scale, scale (b, heads_k)), scale = amax / 448 per KV head."""
    b, s, h, d = x.shape
    amax = x.reshape(b, s, heads_k, h // heads_k, d).abs().amax(dim=(1, 3, 4)).clamp_min(1e-6)
    scale = (amax / E4M3_MAX).float()
    per_head = scale.repeat_interleave(h // heads_k, dim=1)[:, None, :, None]
    return (x / per_head).to(E4M3), scale


def _dequant(x8, scale):
    b, s, h, d = x8.shape
    per_head = scale.repeat_interleave(h // scale.shape[1], dim=1)[:, None, :, None]
    return x8.double() * per_head.double()


def _fp8_scores(q8, k8):
    """(b, h, sq, sk) fp32 raw scores q8 . k8 by torch's FP8 GEMM with fast accumulation (rows
    padded with zeros to the GEMM's multiples of 16)."""
    b, sq, h, d = q8.shape
    sk, hk = k8.shape[1], k8.shape[2]
    pad = lambda x: torch.nn.functional.pad(x.view(torch.uint8), (0, 0, 0, -x.shape[0] % 16)
                                            ).view(E4M3)
    one = torch.ones((), device=q8.device)
    s = torch.empty(b, h, sq, sk, device=q8.device)
    for bi in range(b):
        for hi in range(h):
            a = pad(q8[bi, :, hi].contiguous())
            c = pad(k8[bi, :, hi // (h // hk)].contiguous())
            s[bi, hi] = torch._scaled_mm(a, c.t(), scale_a=one, scale_b=one,
                                         out_dtype=torch.float32, use_fast_accum=True)[:sq, :sk]
    return s


def _lowp(q8, k8, v8, descales, softmax_scale, causal, window):
    """Plain PyTorch at the kernel's precision (module docstring): (out bf16, lse float32)."""
    qd, kd, vd = descales
    b, sq, h, d = q8.shape
    sk, hk = k8.shape[1], k8.shape[2]
    g = h // hk
    v = v8.float().transpose(1, 2).repeat_interleave(g, dim=1)
    s = _fp8_scores(q8, k8)                                                 # raw scores, fp32
    scale = (softmax_scale * qd * kd).repeat_interleave(g, dim=1)[:, :, None, None]
    visible = attention_mask(sq, sk, causal, window, device=q8.device)
    s = torch.where(visible, s, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp2((s - m) * scale * math.log2(math.e) + 8.0)               # <= 256
    l = p.sum(dim=-1, keepdim=True)
    p8 = p.to(E4M3).float()
    o = (p8 @ v) / torch.where(l > 0, l, torch.ones_like(l))
    o = o * vd.repeat_interleave(g, dim=1)[:, :, None, None]
    lse = (m * scale + torch.log(l) - 8.0 * math.log(2.0)).squeeze(-1)
    lse = torch.where(l.squeeze(-1) > 0, lse, math.inf)
    return o.transpose(1, 2).to(torch.bfloat16), lse


def _ulp(truth):
    top = max(truth.abs().max().item(), 0.25)
    return torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(top))


CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    (2, 113, 257, 4, 2, 128),
    (1, 1024, 1024, 4, 4, 128),
    (2, 300, 100, 6, 2, 128),   # seqlen_q > seqlen_k: causal rows that see no key
    (1, 1, 1, 1, 1, 128),
    (3, 129, 383, 2, 1, 64),
    (1, 777, 1025, 4, 4, 64),
    (2, 257, 191, 2, 2, 256),
    (1, 640, 1100, 2, 1, 256),
    (2, 97, 211, 4, 2, 80),     # head dim 80 on the 128 kernel
    (1, 150, 300, 2, 1, 96),    # 96 on the 128 kernel
    (2, 77, 129, 2, 2, 32),     # 32 on the 64 kernel
    (1, 200, 333, 2, 2, 192),   # 192 on the 256 kernel
]


@pytest.mark.parametrize("window", [None, (64, 0), (100, 37)],
                         ids=["nowin", "win64-0", "win100-37"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", CASES, ids=lambda c: "x".join(map(str, c)))
def test_fp8_forward(shape, causal, window):
    b, sq, sk, h, hk, d = shape
    if window is not None and (causal or sq < 100):
        pytest.skip("windows: one mask at a time, on the longer shapes")
    _skip_unless_built(d)
    torch.manual_seed(hash((shape, causal, window)) % 2**31)
    q = torch.randn(b, sq, h, d, device=DEVICE) * 2.0
    k = torch.randn(b, sk, hk, d, device=DEVICE)
    v = torch.randn(b, sk, hk, d, device=DEVICE) * 3.0
    q8, qd = _quantize(q, hk)
    k8, kd = _quantize(k, hk)
    v8, vd = _quantize(v, hk)
    scale = d ** -0.5
    win = window or (-1, -1)
    poison_allocator()
    out, lse, _ = flash_attn.flash_attn_func(q8, k8, v8, causal=causal, window_size=win,
                                             return_attn_probs=True, q_descale=qd,
                                             k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, d)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    truth, truth_lse = attention_ref(_dequant(q8, qd), _dequant(k8, kd), _dequant(v8, vd),
                                     causal=causal, window_size=win, softmax_scale=scale,
                                     return_lse=True)
    lowp, lowp_lse = _lowp(q8, k8, v8, (qd, kd, vd), scale, causal, win)
    err = (out.double() - truth).abs().max().item()
    err_lowp = (lowp.double() - truth).abs().max().item()
    assert err <= 2 * err_lowp + _ulp(truth), (err, err_lowp)
    empty = torch.isinf(truth_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert torch.all(out.transpose(1, 2)[empty] == 0)
    diff = (lse.double() - truth_lse).abs()[~empty]
    if diff.numel():
        err_lse = (lowp_lse.double() - truth_lse).abs()[~empty].max().item()
        bound = 2 * err_lse + LSE_TOL * (1 + truth_lse.abs()[~empty])
        assert (diff <= bound).all(), (diff.max().item(), err_lse)


def test_fp8_without_descales_and_strided_inputs():
    """Descales left out (1), q a strided view (the frontend copies what TMA cannot read)."""
    _skip_unless_built(128)
    b, s, h, d = 2, 300, 4, 128
    qkv = (torch.randn(b, s, 3, h, d, device=DEVICE) * 0.5).to(E4M3)
    q8, k8, v8 = qkv.unbind(2)
    poison_allocator()
    out = flash_attn.flash_attn_func(q8, k8, v8, causal=True)
    ones = torch.ones(b, h, device=DEVICE)
    truth = attention_ref(_dequant(q8, ones), _dequant(k8, ones), _dequant(v8, ones),
                          causal=True, softmax_scale=d ** -0.5)
    lowp, _ = _lowp(q8, k8, v8, (ones, ones, ones), d ** -0.5, True, (-1, -1))
    err = (out.double() - truth).abs().max().item()
    err_lowp = (lowp.double() - truth).abs().max().item()
    assert err <= 2 * err_lowp + _ulp(truth), (err, err_lowp)


def test_fp8_errors_leave_the_gpu_usable():
    _skip_unless_built(128)
    q8 = torch.randn(1, 64, 2, 128, device=DEVICE).to(E4M3)
    with pytest.raises(RuntimeError, match="requires grad"):
        leaf = torch.randn(1, 64, 2, 128, device=DEVICE).to(E4M3).requires_grad_()
        flash_attn.flash_attn_func(leaf, q8, q8)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn.flash_attn_func(q8, q8, q8, softcap=30.0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        flash_attn.flash_attn_func(q8, q8, q8.to(torch.bfloat16))
    with pytest.raises(ValueError, match="k_descale"):
        flash_attn.flash_attn_func(q8, q8, q8, k_descale=torch.ones(3, 2, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 16"):
        x = torch.randn(1, 64, 2, 72, device=DEVICE).to(E4M3)
        flash_attn.flash_attn_func(x, x, x)
    out = flash_attn.flash_attn_func(q8, q8, q8)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


@functools.lru_cache(maxsize=None)
def _outlier_rmses(causal):
    """The FA3 paper's accuracy test: N(0, 1) inputs with 0.1% of the entries N(0, 10), through
    quantize (per-(batch, KV head) scales, Hadamard rotation of q and k) and the forward. RMSEs
    against the float64 attention of the 16-bit inputs, each the mean over three random
    rotations (the RMSE depends on the draw): ours; the floor, float64 attention of quantize's
    own e4m3 inputs (what no FP8 kernel fed them can beat); a per-tensor-scaled FP8 attention
    computed exactly from its e4m3 inputs (no rotation). Computed once per causal."""
    torch.manual_seed(7)
    b, s, h, d = 2, 2048, 8, 128

    def outliers():
        x = torch.randn(b, s, h, d, device=DEVICE)
        mask = torch.rand(b, s, h, d, device=DEVICE) < 1e-3
        return torch.where(mask, torch.randn_like(x) * 10, x).to(torch.bfloat16)

    def rmse(x, truth):
        return (x.double() - truth).pow(2).mean().sqrt().item()

    q, k, v = outliers(), outliers(), outliers()
    truth = attention_ref(q, k, v, causal=causal)
    ours, floor = [], []
    for seed in range(3):
        q8, k8, v8, descales = flash_attn.fp8.quantize(
            q, k, v, generator=torch.Generator(DEVICE).manual_seed(seed))
        poison_allocator()
        out = flash_attn.flash_attn_func(q8, k8, v8, causal=causal, **descales)
        ours.append(rmse(out, truth))
        exact = attention_ref(_dequant(q8, descales["q_descale"]),
                              _dequant(k8, descales["k_descale"]),
                              _dequant(v8, descales["v_descale"]), causal=causal)
        floor.append(rmse(exact, truth))

    def per_tensor(x):
        scale = x.float().abs().amax() / E4M3_MAX
        return (x.float() / scale).to(E4M3).double() * scale.double()

    tensor = rmse(attention_ref(per_tensor(q), per_tensor(k), per_tensor(v), causal=causal), truth)
    result = {"ours": sum(ours) / 3, "draws": ours, "floor": sum(floor) / 3, "tensor": tensor}
    print(f"causal={causal} rmse ours {result['ours']:.4e} (draws "
          f"{', '.join(f'{r:.4e}' for r in ours)}), floor {result['floor']:.4e}, per-tensor fp8 "
          f"{tensor:.4e}")
    return result


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_outlier_error_near_its_inputs_floor(causal):
    """The kernel's share of the outlier RMSE: within 10% of the floor set by quantize's e4m3
    inputs (an emulation of the kernel's arithmetic in PyTorch put it 1% above at full
    attention, 3% causal; docs/fa3_decisions.md), and below the per-tensor FP8 attention's."""
    _skip_unless_built(128)
    r = _outlier_rmses(causal)
    assert r["ours"] <= 1.1 * r["floor"] and r["ours"] <= r["tensor"], r


@pytest.mark.parametrize("causal", [
    False,
    pytest.param(True, marks=pytest.mark.xfail(
        strict=True, reason="issue 36's bar unmet: causal RMSE 9.104e-3 (rotations 9.05 / 9.11 "
                            "/ 9.15e-3) against 9.1e-3 on an H100 (fused quantize, session 65); "
                            "the e4m3 inputs' own floor is about 2.5% below ours (emulated: "
                            "docs/fa3_decisions.md), 9.04e-3 on a CPU draw of this test")),
], ids=["full", "causal"])
def test_fp8_quantize_on_outliers(causal):
    """The issue's bar: the outlier RMSE with quantize (mean over three rotations) within the
    FA3 paper's 9.1e-3."""
    _skip_unless_built(128)
    r = _outlier_rmses(causal)
    assert r["ours"] <= 9.1e-3, r
