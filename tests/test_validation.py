"""Argument checks: the pure functions with plain values, then the tensor entry point on CPU."""

import math

import pytest
import torch

import flash_attn
from flash_attn import _validate as V

CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


# ---- pure checks ------------------------------------------------------------------------------

def test_device_must_be_cuda():
    V.check_device("q", CUDA0)
    with pytest.raises(ValueError, match=r"q must be on a CUDA device, got cpu"):
        V.check_device("q", CPU)


def test_devices_must_match():
    V.check_same_device(("q", "k", "v"), (CUDA0, CUDA0, CUDA0))
    with pytest.raises(ValueError, match=r"q and v must be on the same device, got cuda:0 and cuda:1"):
        V.check_same_device(("q", "k", "v"), (CUDA0, CUDA0, CUDA1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match=rf"q has dtype {dtype}; supported: torch.float16, torch.bfloat16"):
        V.dtype_name("q", dtype)


def test_dtype_names():
    assert V.dtype_name("q", torch.float16) == "fp16"
    assert V.dtype_name("q", torch.bfloat16) == "bf16"


def test_dtypes_must_match():
    with pytest.raises(TypeError, match=r"q and k must have the same dtype, got torch.float16 and torch.bfloat16"):
        V.check_same_dtype(("q", "k", "v"), (torch.float16, torch.bfloat16, torch.float16))


def test_ndim():
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, seqlen_q, nheads, headdim\), got shape \(2, 3, 64\)"):
        V.check_shapes((2, 3, 64), (2, 3, 4, 64), (2, 3, 4, 64))
    with pytest.raises(ValueError, match=r"v must be 4-D"):
        V.check_shapes((2, 3, 4, 64), (2, 3, 4, 64), (2, 3, 4, 64, 1))


def test_shapes_ok():
    s = V.check_shapes((2, 5, 6, 60), (2, 7, 3, 60), (2, 7, 3, 60))
    assert s == V.Shapes(batch=2, seqlen_q=5, seqlen_k=7, nheads=6, nheads_k=3, head_dim=60)


@pytest.mark.parametrize("q,k,v,pattern", [
    ((2, 5, 4, 64), (3, 7, 4, 64), (3, 7, 4, 64), r"k has batch size 3 but q has 2"),
    ((2, 5, 4, 64), (2, 7, 4, 64), (1, 7, 4, 64), r"v has batch size 1 but q has 2"),
    ((2, 5, 4, 64), (2, 7, 4, 64), (2, 8, 4, 64), r"v has seqlen 8 but k has 7"),
    ((2, 5, 4, 64), (2, 7, 4, 64), (2, 7, 2, 64), r"v has 2 heads but k has 4"),
    ((2, 5, 4, 64), (2, 7, 4, 32), (2, 7, 4, 32), r"k has head dim 32 but q has 64"),
    ((2, 5, 4, 64), (2, 7, 4, 64), (2, 7, 4, 128), r"v has head dim 128 but q has 64"),
    ((2, 5, 6, 64), (2, 7, 4, 64), (2, 7, 4, 64), r"q has 6 heads, which is not a multiple of the 4 heads"),
    ((2, 5, 4, 0), (2, 7, 4, 0), (2, 7, 4, 0), r"q has head dim 0; supported: 1 to 256"),
    ((2, 5, 4, 264), (2, 7, 4, 264), (2, 7, 4, 264), r"q has head dim 264; supported: 1 to 256"),
    ((0, 5, 4, 64), (0, 7, 4, 64), (0, 7, 4, 64), r"q has batch size 0; it must be at least 1"),
    ((2, 5, 0, 64), (2, 7, 0, 64), (2, 7, 0, 64), r"nheads \(q: 0\) and nheads_k \(k: 0\) must be at least 1"),
])
def test_shape_errors(q, k, v, pattern):
    with pytest.raises(ValueError, match=pattern):
        V.check_shapes(q, k, v)


def test_packed_shape():
    V.check_packed_shape("qkv", (2, 5, 3, 4, 64), 3, "(batch, seqlen, 3, nheads, headdim)")
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\), with 3 at dim 2, got shape \(2, 5, 2, 4, 64\)"):
        V.check_packed_shape("qkv", (2, 5, 2, 4, 64), 3, "(batch, seqlen, 3, nheads, headdim)")
    with pytest.raises(ValueError, match=r"kv must be 5-D"):
        V.check_packed_shape("kv", (2, 5, 4, 64), 2, "(batch, seqlen_k, 2, nheads_k, headdim)")


@pytest.mark.parametrize("p", [0.0, 0.1, 0.999])
def test_dropout_ok(p):
    V.check_dropout(p)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan])
def test_dropout_range(p):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got"):
        V.check_dropout(p)


def test_dropout_type():
    with pytest.raises(TypeError, match=r"dropout_p must be a float in \[0, 1\), got str"):
        V.check_dropout("0.1")


def test_softmax_scale_default_uses_the_callers_head_dim():
    # 60 is padded to 64 for the kernels; the default scale must still be 1/sqrt(60).
    assert V.resolve_softmax_scale(None, 60) == pytest.approx(1 / math.sqrt(60))


def test_softmax_scale_values():
    assert V.resolve_softmax_scale(0.5, 64) == 0.5
    two = V.resolve_softmax_scale(2, 64)
    assert two == 2.0 and isinstance(two, float)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_softmax_scale_must_be_finite(scale):
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite number .* got"):
        V.resolve_softmax_scale(scale, 64)


@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_softmax_scale_zero_or_negative_is_accepted(scale):
    # flash_attn 2.x takes any float here.
    assert V.resolve_softmax_scale(scale, 64) == scale


@pytest.mark.parametrize("scale", ["0.1", True, torch.tensor(0.1)])
def test_softmax_scale_type(scale):
    with pytest.raises(TypeError, match=r"softmax_scale must be a float or None, got"):
        V.resolve_softmax_scale(scale, 64)


@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (128, 0), [5, 7]])
def test_window_ok(window):
    assert V.check_window(window) == tuple(window)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1,), (1, 2, 3), (1.5, 2), (True, 0), 4, None, "ab"])
def test_window_errors(window):
    with pytest.raises(ValueError, match=r"window_size must be a pair of ints >= -1 .* got"):
        V.check_window(window)


def test_softcap():
    V.check_softcap(0.0)
    V.check_softcap(30.0)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"softcap must be 0 \(off\) or a finite positive number, got"):
            V.check_softcap(bad)
    with pytest.raises(TypeError, match=r"softcap must be a float, got NoneType"):
        V.check_softcap(None)


def test_alibi():
    V.check_alibi((4,), torch.float32, CUDA0, 2, 4, CUDA0)
    V.check_alibi((2, 4), torch.float32, CUDA0, 2, 4, CUDA0)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\), got \(4, 2\)"):
        V.check_alibi((4, 2), torch.float32, CUDA0, 2, 4, CUDA0)
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        V.check_alibi((3,), torch.float32, CUDA0, 2, 4, CUDA0)
    with pytest.raises(TypeError, match=r"alibi_slopes must be torch.float32, got torch.float16"):
        V.check_alibi((4,), torch.float16, CUDA0, 2, 4, CUDA0)
    with pytest.raises(ValueError, match=r"alibi_slopes must be on the device of q \(cuda:0\), got cpu"):
        V.check_alibi((4,), torch.float32, CPU, 2, 4, CUDA0)


@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90, 100, 120])
def test_arch_ok(arch):
    V.check_arch(arch, "cuda:0")


@pytest.mark.parametrize("arch", [60, 61, 70, 72])
def test_arch_too_old(arch):
    with pytest.raises(RuntimeError, match=rf"cuda:0 is sm{arch} \(compute capability {arch // 10}\.{arch % 10}\); flash_attn needs compute capability 7\.5"):
        V.check_arch(arch, "cuda:0")


@pytest.mark.parametrize("causal,window,seqlen_k,expected", [
    (False, (-1, -1), 100, (False, (-1, -1))),
    (True, (-1, -1), 100, (True, (-1, -1))),
    (False, (-1, 0), 100, (True, (-1, -1))),       # 2.x: (-1, 0) is causal
    (True, (-1, 5), 100, (True, (-1, -1))),        # causal forces right = 0
    (True, (16, -1), 100, (False, (16, 0))),       # sliding-window causal is local
    (False, (16, 16), 100, (False, (16, 16))),
    (False, (100, 100), 100, (False, (-1, -1))),   # a side >= seqlen_k is unlimited
    (True, (100, -1), 100, (True, (-1, -1))),
    (False, (99, 200), 100, (False, (99, -1))),
])
def test_normalize_window(causal, window, seqlen_k, expected):
    assert V.normalize_window(causal, window, seqlen_k) == expected


def test_call_features():
    assert V.call_features(False, (-1, -1), 0.0, False, 0.0, 8, 8, 1024) == frozenset()
    assert V.call_features(True, (-1, -1), 0.0, False, 0.0, 8, 2, 256) == {"causal", "gqa"}
    assert V.call_features(False, (4, 4), 30.0, True, 0.1, 8, 8, 2048) == {"local", "softcap", "alibi", "dropout"}
    # short_q: fewer than SHORT_Q_ROWS query rows per KV head (seqlen_q x nheads / nheads_k).
    assert V.call_features(False, (-1, -1), 0.0, False, 0.0, 8, 8, 1023) == {"short_q"}
    assert V.call_features(False, (-1, -1), 0.0, False, 0.0, 8, 2, 255) == {"gqa", "short_q"}
    assert set(V.FEATURES) >= V.call_features(True, (4, 0), 1.0, True, 0.5, 8, 1, 1)


# ---- the tensor entry point, where it fails before needing a GPU ------------------------------

def _qkv(b=2, sq=5, sk=7, h=4, hk=2, d=64, dtype=torch.float16, device="cpu"):
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    k = torch.randn(b, sk, hk, d, device=device).to(dtype)
    v = torch.randn(b, sk, hk, d, device=device).to(dtype)
    return q, k, v


def test_cpu_tensors_rejected_by_public_functions():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must be on a CUDA device, got cpu"):
        flash_attn.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"qkv must be on a CUDA device, got cpu"):
        flash_attn.flash_attn_qkvpacked_func(torch.stack([q, q, q], 2))
    with pytest.raises(ValueError, match=r"q must be on a CUDA device, got cpu"):
        flash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2))


def test_not_a_tensor():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got list"):
        flash_attn.flash_attn_func(q, [1, 2], v)
    with pytest.raises(TypeError, match=r"qkv must be a torch.Tensor, got NoneType"):
        flash_attn.flash_attn_qkvpacked_func(None)


def test_packed_shapes_checked_first():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn.flash_attn_qkvpacked_func(torch.stack([q, q], 2))
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        flash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v, v], 2))


# ---- the tensor entry point with CPU standing in for the GPU (tests/conftest.py) --------------

def test_entry_point_returns_the_call(fake_ext):
    q, k, v = _qkv(d=60)
    call = V.validate_call(q, k, v, causal=True)
    assert call.shapes == V.Shapes(2, 5, 7, 4, 2, 60)
    assert call.dtype == "fp16" and call.causal and call.window == (-1, -1)
    assert call.softmax_scale == pytest.approx(60 ** -0.5)
    assert call.features == {"causal", "gqa", "short_q"}


def test_entry_point_errors(fake_ext):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q has dtype torch.float32"):
        V.validate_call(q.float(), k.float(), v.float())
    with pytest.raises(TypeError, match=r"q and v must have the same dtype"):
        V.validate_call(q, k, v.bfloat16())
    with pytest.raises(ValueError, match=r"q and k must be on the same device, got cpu and meta"):
        V.validate_call(q, k.to("meta"), v)
    with pytest.raises(ValueError, match=r"v has seqlen 6 but k has 7"):
        V.validate_call(q, k, v[:, :6])
    with pytest.raises(ValueError, match=r"window_size"):
        V.validate_call(q, k, v, window_size=(-3, 0))
    with pytest.raises(TypeError, match=r"alibi_slopes must be torch.float32"):
        V.validate_call(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float16))


def test_noncontiguous_last_dim_is_not_an_error(fake_ext):
    q, k, v = _qkv(d=64)
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)     # same values, stride(-1) != 1
    assert qt.stride(-1) != 1
    out = flash_attn.flash_attn_func(qt, k, v)
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q, k, v))


def test_gpu_too_old(fake_ext):
    fake_ext.arch = 70
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"is sm70 \(compute capability 7\.0\); flash_attn needs compute capability 7\.5"):
        flash_attn.flash_attn_func(q, k, v)


FA2_FEATURES = [
    (dict(window_size=(2, 2)), r"fa1 does not support local attention \(window_size != \(-1, -1\)\)"),
    (dict(causal=True, window_size=(3, -1)), r"fa1 does not support local attention \(window_size != \(-1, -1\)\)"),
    (dict(softcap=30.0), r"fa1 does not support softcap > 0"),
    (dict(alibi_slopes=torch.ones(4)), r"fa1 does not support alibi_slopes"),
    (dict(dropout_p=0.1), r"fa1 does not support dropout_p > 0"),
]


@pytest.mark.parametrize("kwargs,pattern", FA2_FEATURES)
def test_fa1_refuses_the_fa2_features(fake_ext, kwargs, pattern):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=pattern + r"\. backend='fa2' would run it"):
        flash_attn.flash_attn_func(q, k, v, backend="fa1", **kwargs)
    # Automatic on sm80: fa2 runs it.
    flash_attn.flash_attn_func(q, k, v, **kwargs)
    assert fake_ext.calls[-1][:2] == ("fwd", "fa2")


@pytest.mark.parametrize("kwargs,pattern", FA2_FEATURES)
def test_fa2_features_on_sm75_are_not_implemented(fake_ext, kwargs, pattern):
    fake_ext.arch = 75
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=pattern) as err:
        flash_attn.flash_attn_func(q, k, v, **kwargs)
    assert "fa2: fa2 needs sm80+, this GPU is sm75" in str(err.value)
    having = "fa2 (sm80+)" if "dropout_p" in kwargs else "fa3 (sm90), fa2 (sm80+)"
    assert f"families with every feature of this call: {having}." in str(err.value)
    assert fake_ext.calls == []


def test_window_wider_than_the_keys_is_not_local(fake_ext):
    q, k, v = _qkv(sk=7)
    out = flash_attn.flash_attn_func(q, k, v, window_size=(7, 7))
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q, k, v))


def test_bf16_on_sm75_is_not_implemented(fake_ext):
    fake_ext.arch = 75
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"fa1 runs bf16 on sm80\+ only, this GPU is sm75"):
        flash_attn.flash_attn_func(q, k, v)


def test_head_dim_beyond_the_family(fake_ext):
    q, k, v = _qkv(h=2, d=200)
    with pytest.raises(NotImplementedError, match=r"fa1 supports head dims up to 128, got 200\. backend='fa2' would run it"):
        flash_attn.flash_attn_func(q, k, v, backend="fa1")
    flash_attn.flash_attn_func(q, k, v)
    assert fake_ext.calls[-1][:3] == ("fwd", "fa2", (2, 5, 2, 200))
    fake_ext.arch = 75
    with pytest.raises(NotImplementedError, match=r"fa1 supports head dims up to 128, got 200"):
        flash_attn.flash_attn_func(q, k, v)
    q, k, v = _qkv(h=2, d=300)
    with pytest.raises(ValueError, match=r"q has head dim 300; supported: 1 to 256"):
        flash_attn.flash_attn_func(q, k, v)
