"""flash_attn.fp8.quantize's kernel (csrc/common/fp8_quantize.h) against the same computation in
PyTorch (fp8._quantize_torch, the CPU path), with the same random signs.

The descales must agree to float32 rounding. The e4m3 values may differ where the rotation,
butterflies in the kernel and a float32 GEMM in PyTorch, rounds differently by an ulp of
float32 and that tips an e4m3 rounding: those are at most one e4m3 step apart, and rare.
"""

import importlib

import pytest
import torch

import flash_attn
from flash_attn import fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = torch.device("cuda")
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _needs_the_kernel():
    if not hasattr(importlib.import_module("flash_attn._C"), "fp8_quantize"):
        pytest.skip("this build of flash_attn._C has no fp8_quantize")


def _assert_matches(ours, ref, descale_ours, descale_ref):
    torch.testing.assert_close(descale_ours, descale_ref, rtol=1e-6, atol=0)
    a, b = ours.float(), ref.float()
    assert torch.isfinite(a).all()
    differs = a != b
    # One e4m3 step: 2^-3 of the larger value's binade, or the subnormal step 2^-9.
    step = torch.maximum(torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs())
                                                            .clamp_min(2.0 ** -6)))) / 8,
                         torch.full_like(a, 2.0 ** -9))
    assert ((a - b).abs() <= step + 1e-12).all(), (a - b).abs().max()
    assert differs.float().mean().item() < 2e-3, differs.float().mean().item()


@pytest.mark.parametrize("hadamard", [True, False], ids=["rotated", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(2, 257, 8, 2, 128), (1, 33, 4, 4, 64), (3, 100, 6, 2, 96),
                                   (2, 129, 2, 1, 256), (1, 17, 3, 1, 48)],
                         ids=lambda c: "x".join(map(str, c)))
def test_quantize_kernel_matches_pytorch(shape, dtype, hadamard):
    b, s, h, hk, d = shape
    torch.manual_seed(0)
    # Heads of different ranges, so that a scale taken from the wrong (batch, KV head) shows.
    spread = torch.rand(b, 1, h, 1, device=DEVICE) * 4 + 0.1
    q = (torch.randn(b, s, h, d, device=DEVICE) * spread).to(dtype)
    k = (torch.randn(b, s + 5, hk, d, device=DEVICE) * spread[:, :, :hk]).to(dtype)
    v = (torch.randn(b, s + 5, hk, d, device=DEVICE) * 3).to(dtype)
    g1 = torch.Generator(device="cpu").manual_seed(11)
    g2 = torch.Generator(device="cpu").manual_seed(11)
    ours = fp8.quantize(q, k, v, hadamard=hadamard, generator=g1)
    ref = fp8._quantize_torch(q, k, v, hk, hadamard, g2)
    for i, name in enumerate(("q", "k", "v")):
        assert ours[i].dtype == E4M3 and ours[i].shape == (q, k, v)[i].shape
        _assert_matches(ours[i], ref[i], ours[3][f"{name}_descale"], ref[3][f"{name}_descale"])


def test_quantize_kernel_on_strided_and_unaligned_inputs():
    """A packed qkv's views (strided, no copy) and a view one element off alignment (copied)."""
    torch.manual_seed(1)
    b, s, h, d = 2, 70, 4, 64
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    flat = torch.randn(b * s * h * d + 1, device=DEVICE, dtype=torch.bfloat16)
    q_off = flat[1:].view(b, s, h, d)
    for q_in in (q, q_off):
        g1 = torch.Generator(device="cpu").manual_seed(5)
        g2 = torch.Generator(device="cpu").manual_seed(5)
        ours = fp8.quantize(q_in, k, v, generator=g1)
        ref = fp8._quantize_torch(q_in, k, v, h, True, g2)
        for i, name in enumerate(("q", "k", "v")):
            _assert_matches(ours[i], ref[i], ours[3][f"{name}_descale"],
                            ref[3][f"{name}_descale"])


def test_quantize_kernel_feeds_the_fp8_forward():
    """quantize's output runs through flash_attn_func and lands near the 16-bit attention."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 forward runs on sm90 only")
    have = [c for c in importlib.import_module("flash_attn._C").built_configs()
            if c[:3] == ("fa3", "fwd", "e4m3") and c[3] >= 128]
    if not have:
        pytest.skip("this build has no fa3 e4m3 forward for head dim 128")
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 500, 4, 128, device=DEVICE, dtype=torch.bfloat16)
               for _ in range(3))
    q8, k8, v8, descales = fp8.quantize(q, k, v)
    out = flash_attn.flash_attn_func(q8, k8, v8, causal=True, **descales)
    ref = flash_attn.flash_attn_func(q, k, v, causal=True)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 0.05, rel


def test_quantize_kernel_propagates_nan_and_takes_empty_sequences():
    q = torch.randn(1, 8, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    v = k.clone()
    v[0, 3, 1, 5] = float("nan")
    _, _, v8, d = fp8.quantize(q, k, v)
    assert torch.isnan(d["v_descale"][0, 1]) and not torch.isnan(d["v_descale"][0, 0])
    assert torch.isnan(v8[0, :, 1].float()).all() and torch.isfinite(v8[0, :, 0].float()).all()
    empty = torch.empty(1, 0, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    q8, k8, v8, d = fp8.quantize(q, empty, empty)
    assert k8.shape == empty.shape and (d["k_descale"] == torch.finfo(torch.float32).tiny).all()
    assert torch.isfinite(d["q_descale"]).all() and (d["q_descale"] > 0).all()
