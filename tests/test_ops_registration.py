"""The custom ops and the public functions around them, without a GPU.

Shapes come from FakeTensorMode on fake CUDA tensors; values, gradients, opcheck and
torch.compile from the CPU stand-in extension (tests/conftest.py), which computes the reference
attention in the kernels' place.
"""

import inspect
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn
from flash_attn import _validate, build_matrix
from conftest import _heads_first, _probs, naive_attention


# ---- schemas and signatures -------------------------------------------------------------------

def test_schemas():
    assert str(torch.ops.flash_attn.fwd.default._schema) == (
        "flash_attn::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
        "int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
        "float dropout_p, bool deterministic, str backend, str tuning=\"\") "
        "-> (Tensor out, Tensor lse, Tensor rng_state)")
    assert str(torch.ops.flash_attn.bwd.default._schema) == (
        "flash_attn::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor rng_state, float softmax_scale, bool causal, int window_left, "
        "int window_right, float softcap, Tensor? alibi_slopes, float dropout_p, "
        "bool deterministic, str backend, str tuning=\"\") -> (Tensor dq, Tensor dk, Tensor dv)")
    assert str(torch.ops.flash_attn.dropout_mask.default._schema) == (
        "flash_attn::dropout_mask(Tensor rng_state, int batch, int nheads, int seqlen_q, "
        "int seqlen_k, float dropout_p) -> Tensor")


_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
           ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
           ("deterministic", False), ("return_attn_probs", False)]
EMPTY = inspect.Parameter.empty


@pytest.mark.parametrize("name,positional", [
    ("flash_attn_func", ["q", "k", "v"]),
    ("flash_attn_qkvpacked_func", ["qkv"]),
    ("flash_attn_kvpacked_func", ["q", "kv"]),
])
def test_signature_is_2x_plus_backend(name, positional):
    params = list(inspect.signature(getattr(flash_attn, name)).parameters.values())
    got = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert got == [(n, EMPTY) for n in positional] + _COMMON
    extra = [(p.name, p.kind, p.default) for p in params if p.kind != p.POSITIONAL_OR_KEYWORD]
    kw = inspect.Parameter.KEYWORD_ONLY
    # flash_attn_func: FP8's descales and out_dtype (../shared/INTERFACE.md), the private _tuning.
    fp8 = [(n, kw, None) for n in ("q_descale", "k_descale", "v_descale", "out_dtype")]
    private = fp8 + [("_tuning", kw, None)] if name == "flash_attn_func" else []
    assert extra == [("backend", kw, None)] + private


@pytest.mark.parametrize("name,positional,keyword_only", [
    ("flash_attn_varlen_func", ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                "max_seqlen_k"] + _COMMON + [("block_table", None)],
     ["seqused_q", "seqused_k", "backend"]),
    ("flash_attn_varlen_qkvpacked_func", ["qkv", "cu_seqlens", "max_seqlen"] + _COMMON,
     ["backend"]),
    ("flash_attn_varlen_kvpacked_func", ["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                         "max_seqlen_q", "max_seqlen_k"] + _COMMON, ["backend"]),
])
def test_varlen_signatures_are_2x_plus_fa3_keywords(name, positional, keyword_only):
    params = list(inspect.signature(getattr(flash_attn, name)).parameters.values())
    got = [p.name if p.default is EMPTY else (p.name, p.default)
           for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert got == positional
    assert [(p.name, p.default) for p in params if p.kind != p.POSITIONAL_OR_KEYWORD] == \
        [(n, None) for n in keyword_only]
    assert all(p.kind == p.KEYWORD_ONLY for p in params if p.kind != p.POSITIONAL_OR_KEYWORD)


@pytest.mark.parametrize("name,params", [
    ("flash_attn_with_kvcache", ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin",
                                 "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                                 "softmax_scale", "causal", "window_size", "softcap",
                                 "rotary_interleaved", "alibi_slopes", "num_splits",
                                 "return_softmax_lse", "backend", "_tuning"]),
])
def test_kvcache_signature_is_2x_plus_backend(name, params):
    assert list(inspect.signature(getattr(flash_attn, name)).parameters) == params


# ---- fake implementations ---------------------------------------------------------------------

def _fake_cuda(mode, *shape, dtype=torch.float16, strides=None):
    with mode:
        t = torch.empty(*shape, dtype=dtype, device="cuda")
        return t if strides is None else t.as_strided(shape, strides)


def test_fake_fwd_bwd_shapes():
    mode = FakeTensorMode()
    q = _fake_cuda(mode, 2, 5, 6, 64, dtype=torch.bfloat16)
    k = _fake_cuda(mode, 2, 7, 2, 64, dtype=torch.bfloat16)
    with mode:
        out, lse, rng_state = torch.ops.flash_attn.fwd(q, k, k, 0.125, False, 16, 0, 30.0, None,
                                                       0.1, False, "fa2")
        assert (out.shape, out.dtype, out.device.type) == ((2, 5, 6, 64), torch.bfloat16, "cuda")
        assert out.is_contiguous()
        assert (lse.shape, lse.dtype, lse.device.type) == ((2, 6, 5), torch.float32, "cuda")
        assert (rng_state.shape, rng_state.dtype, rng_state.device.type) == ((2,), torch.int64, "cuda")
        mask = torch.ops.flash_attn.dropout_mask(rng_state, 2, 6, 5, 7, 0.1)
        assert (mask.shape, mask.dtype, mask.device.type) == ((2, 6, 5, 7), torch.bool, "cuda")
        dq, dk, dv = torch.ops.flash_attn.bwd(out, q, k, k, out, lse, rng_state, 0.125, False,
                                              16, 0, 30.0, None, 0.1, True, "fa2")
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
        assert {dq.dtype, dk.dtype, dv.dtype} == {torch.bfloat16}
        assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()


@pytest.fixture
def fake_cuda(fake_ext, monkeypatch):
    """Fake CUDA tensors through the real device check, on an sm80 with the full matrix built."""
    monkeypatch.setattr(_validate, "KERNEL_DEVICE_TYPE", "cuda")
    return FakeTensorMode()


def test_public_function_under_fake_tensors(fake_cuda):
    q = _fake_cuda(fake_cuda, 2, 5, 6, 60)
    k = _fake_cuda(fake_cuda, 2, 7, 2, 60)
    with fake_cuda:
        out, lse, probs = flash_attn.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
        assert out.shape == (2, 5, 6, 60) and out.dtype == torch.float16
        assert lse.shape == (2, 6, 5) and lse.dtype == torch.float32
        assert probs is None
        alibi = torch.empty(2, 6, device="cuda")
        out, lse, probs = flash_attn.flash_attn_func(
            q, k, k, dropout_p=0.2, window_size=(3, 2), softcap=5.0, alibi_slopes=alibi,
            return_attn_probs=True)
        assert out.shape == (2, 5, 6, 60) and lse.shape == (2, 6, 5)
        assert (probs.shape, probs.dtype, probs.device.type) == ((2, 6, 5, 7), torch.float16, "cuda")
        qkv = _fake_cuda(fake_cuda, 2, 5, 3, 4, 96)
        assert flash_attn.flash_attn_qkvpacked_func(qkv).shape == (2, 5, 4, 96)
        kv = _fake_cuda(fake_cuda, 2, 9, 2, 2, 40)
        assert flash_attn.flash_attn_kvpacked_func(_fake_cuda(fake_cuda, 2, 5, 4, 40), kv).shape == (2, 5, 4, 40)


def test_fake_cuda_tensor_on_wrong_device_errors(fake_cuda):
    q = _fake_cuda(fake_cuda, 2, 5, 6, 64)
    with pytest.raises(ValueError, match=r"q and k must be on the same device, got cuda:0 and cpu"):
        with fake_cuda:
            flash_attn.flash_attn_func(q, torch.empty(2, 7, 2, 64, dtype=torch.float16), q)


# ---- values and gradients through the stand-in extension --------------------------------------

def _qkv(b=2, sq=5, sk=7, h=6, hk=2, d=60, dtype=torch.float16, grad=True):
    ts = [torch.randn(b, s, n, d).to(dtype).requires_grad_(grad)
          for s, n in ((sq, h), (sk, hk), (sk, hk))]
    return ts


def _reference(q, k, v, scale, causal, **features):
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qf, kf, vf, scale, causal, **features)
    return out, lse, (qf, kf, vf)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [60, 64])
def test_forward_and_backward_match_the_reference(fake_ext, causal, d):
    q, k, v = _qkv(d=d)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref, ref_lse, inputs = _reference(q, k, v, d ** -0.5, causal)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert not lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.float())
    for got, want in zip((q, k, v), inputs):
        assert got.grad.shape == got.shape
        torch.testing.assert_close(got.grad.float(), want.grad, atol=5e-3, rtol=5e-3)
    # The kernels saw the padded head dim.
    assert fake_ext.calls[0][2][-1] == -(-d // 8) * 8


def test_packed_functions_match_flash_attn_func(fake_ext):
    q, k, v = _qkv(h=4, hk=4, sk=5, d=40, grad=False)
    qkv = torch.stack([q, k, v], 2).requires_grad_()
    out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q, k, v, causal=True))
    out.float().sum().backward()
    assert qkv.grad.shape == qkv.shape
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    flash_attn.flash_attn_func(q2, k2, v2, causal=True).float().sum().backward()
    torch.testing.assert_close(qkv.grad, torch.stack([q2.grad, k2.grad, v2.grad], 2))

    kv = torch.stack([k, v], 2)
    torch.testing.assert_close(flash_attn.flash_attn_kvpacked_func(q, kv, softmax_scale=0.3),
                               flash_attn.flash_attn_func(q, k, v, softmax_scale=0.3))


def test_arguments_reach_the_extension(fake_ext):
    q, k, v = _qkv(d=64)
    out = flash_attn.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True, deterministic=True)
    out.float().sum().backward()
    fwd, bwd = fake_ext.calls
    assert fwd == ("fwd", "fa2", (2, 5, 6, 64), 0.25, True, (-1, -1), 0.0, None, 0.0)
    assert bwd == ("bwd", "fa2", (2, 5, 6, 64), 0.25, True, (-1, -1), 0.0, None, 0.0, True)
    flash_attn.flash_attn_func(q, k, v, causal=True, backend="fa1")
    assert fake_ext.calls[-1][:2] == ("fwd", "fa1")


def test_features_reach_the_extension(fake_ext):
    q, k, v = _qkv(d=64)
    alibi = torch.rand(2, 6)[:, ::1].t().contiguous().t()      # (2, 6), not contiguous
    assert not alibi.is_contiguous()
    out = flash_attn.flash_attn_func(q, k, v, dropout_p=0.25, softmax_scale=0.5, causal=True,
                                     window_size=(3, 9), softcap=20, alibi_slopes=alibi)
    out.float().sum().backward()
    fwd, bwd = fake_ext.calls
    # causal with a left side is local, right = 0 (2.x's rule); softcap arrives as a float.
    assert fwd[:7] == ("fwd", "fa2", (2, 5, 6, 64), 0.5, False, (3, 0), 20.0)
    assert isinstance(fwd[6], float)
    assert fwd[7].is_contiguous() and torch.equal(fwd[7], alibi) and fwd[8] == 0.25
    assert bwd[:7] == ("bwd", "fa2", (2, 5, 6, 64), 0.5, False, (3, 0), 20.0)
    assert torch.equal(bwd[7], alibi) and bwd[8:] == (0.25, False)


def test_window_minus_one_zero_runs_as_causal(fake_ext):
    q, k, v = _qkv(grad=False)
    out = flash_attn.flash_attn_func(q, k, v, window_size=(-1, 0))
    assert fake_ext.calls[-1][4:6] == (True, (-1, -1))
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q, k, v, causal=True))


# ---- the fa2 features, end to end through the stand-in (window, softcap, ALiBi, dropout) -------

FEATURES = {
    "local": dict(window_size=(2, 1)),
    "causal_local": dict(causal=True, window_size=(3, -1)),
    "softcap": dict(softcap=2.0),
    "alibi_heads": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 1.0, 2.0, 0.0])),
    "alibi_batch": dict(alibi_slopes=torch.rand(2, 6)),
    "dropout": dict(dropout_p=0.3),
    "all": dict(causal=True, window_size=(4, 0), softcap=3.0, alibi_slopes=torch.rand(6),
                dropout_p=0.2),
}


def _as_reference_kwargs(kwargs, q, k, fake_ext):
    causal, (left, right) = kwargs.get("causal", False), kwargs.get("window_size", (-1, -1))
    ref = dict(window=(left, 0 if causal else right), softcap=kwargs.get("softcap", 0.0),
               alibi_slopes=kwargs.get("alibi_slopes"), dropout_p=kwargs.get("dropout_p", 0.0))
    if ref["dropout_p"] > 0:
        ref["keep"] = fake_ext.dropout_mask(fake_ext.rng_states[-1], q.shape[0], q.shape[2],
                                            q.shape[1], k.shape[1], ref["dropout_p"])
    return causal, ref


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_fa2_features_match_the_reference(fake_ext, name):
    kwargs = FEATURES[name]
    q, k, v = _qkv(sq=9, sk=11, d=60)
    out, lse, probs = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert fake_ext.calls[-1][:2] == ("fwd", "fa2")
    causal, ref_kwargs = _as_reference_kwargs(kwargs, q, k, fake_ext)
    ref, ref_lse, inputs = _reference(q, k, v, 60 ** -0.5, causal, **ref_kwargs)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.float())
    for got, want in zip((q, k, v), inputs):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=5e-3, rtol=5e-3)
    if "dropout_p" not in kwargs:
        assert probs is None
        return
    # S_dmask: the probabilities before dropout, negated where dropout dropped them.
    qf, kf, _, _ = _heads_first(q.detach(), k.detach(), v.detach())
    p_ref = _probs(qf, kf, 60 ** -0.5, causal, ref_kwargs["window"], ref_kwargs["softcap"],
                   ref_kwargs["alibi_slopes"])[0]
    assert probs.shape == (2, 6, 9, 11) and probs.dtype == q.dtype
    assert torch.equal(torch.signbit(probs), ~ref_kwargs["keep"])
    torch.testing.assert_close(probs.abs().float(), p_ref, atol=1e-3, rtol=1e-3)


def test_rng_state(fake_ext):
    q, k, v = _qkv(d=64, grad=False)
    _, _, rng_state = torch.ops.flash_attn.fwd(q, k, v, 0.125, False, -1, -1, 0.0, None, 0.0,
                                               False, "fa2")
    assert torch.equal(rng_state, torch.zeros(2, dtype=torch.int64))   # no dropout: zeros
    _, _, first = torch.ops.flash_attn.fwd(q, k, v, 0.125, False, -1, -1, 0.0, None, 0.5,
                                           False, "fa2")
    out2, _, second = torch.ops.flash_attn.fwd(q, k, v, 0.125, False, -1, -1, 0.0, None, 0.5,
                                               False, "fa2")
    assert first.tolist() == [fake_ext.SEED, 0] and second.tolist() == [fake_ext.SEED, 4]
    # No key: nothing drawn, nothing launched.
    _, _, empty = torch.ops.flash_attn.fwd(q, k[:, :0], v[:, :0], 0.125, False, -1, -1, 0.0,
                                           None, 0.5, False, "fa2")
    assert torch.equal(empty, torch.zeros(2, dtype=torch.int64))
    assert len(fake_ext.calls) == 3


def test_dropout_backward_uses_the_forwards_mask(fake_ext):
    q, k, v = _qkv(d=64)
    out1 = flash_attn.flash_attn_func(q, k, v, dropout_p=0.5)
    out2 = flash_attn.flash_attn_func(q, k, v, dropout_p=0.5)
    assert not torch.equal(out1, out2)          # fresh draws per call
    out1.float().sum().backward()               # the first call's mask, not the latest
    causal, ref_kwargs = _as_reference_kwargs(dict(dropout_p=0.5), q, k, fake_ext)
    ref_kwargs["keep"] = fake_ext.dropout_mask(fake_ext.rng_states[0], 2, 6, 5, 7, 0.5)
    ref, _, inputs = _reference(q, k, v, 64 ** -0.5, causal, **ref_kwargs)
    ref.float().sum().backward()
    for got, want in zip((q, k, v), inputs):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=5e-3, rtol=5e-3)


def test_alibi_slopes_get_no_gradient(fake_ext):
    q, k, v = _qkv(d=64)
    slopes = torch.rand(6, requires_grad=True)
    flash_attn.flash_attn_func(q, k, v, alibi_slopes=slopes).float().sum().backward()
    assert slopes.grad is None and q.grad is not None


def test_empty_sequences(fake_ext):
    q, k, v = _qkv(sk=0)
    out, lse, probs = flash_attn.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == math.inf).all())
    assert probs.shape == (2, 6, 5, 0)
    out.float().sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    q, k, v = _qkv(sq=0)
    out = flash_attn.flash_attn_func(q, k, v)
    assert out.shape == (2, 0, 6, 60)
    out.float().sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    assert fake_ext.calls == []


def test_misaligned_views_are_copied_for_the_kernels(fake_ext):
    # The kernels read 16-byte vectors: a view starting at an odd element must reach them copied.
    base = torch.randn(2 * 5 * 6 * 64 + 1).half()
    q = base[1:].view(2, 5, 6, 64)
    assert q.storage_offset() == 1
    seen = []
    original = fake_ext.fwd
    fake_ext.fwd = lambda q, *a: (seen.append(q.storage_offset()), original(q, *a))[1]
    out = flash_attn.flash_attn_func(q, q, q)
    assert seen == [0]
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q.clone(), q.clone(), q.clone()))


# ---- opcheck and torch.compile ----------------------------------------------------------------

@pytest.mark.parametrize("family,features", [
    ("fa1", (True, -1, -1, 0.0, None)),
    ("fa2", (False, 3, 1, 5.0, torch.rand(2, 6))),
    ("fa3", (True, 3, 0, 5.0, torch.rand(2, 6))),
])
def test_opcheck_fwd_bwd(fake_ext, family, features):
    fake_ext.arch = 90
    q, k, v = _qkv(d=64)
    fwd_args = (q, k, v, 0.125, *features, 0.0, False, family)
    # Checks the autograd formula too: an fa3 forward's gradient at head dim 64 (or with a
    # window) is flash_attn::bwd on "fa2".
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, fwd_args)
    # With dropout the forward draws anew each call, so opcheck (which compares calls) sees the
    # backward only, which is a pure function of rng_state.
    dropout_p = 0.25 if family == "fa2" else 0.0
    with torch.no_grad():
        out, lse, rng_state = torch.ops.flash_attn.fwd(q, k, v, 0.125, *features, dropout_p,
                                                       False, family)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, rng_state, 0.125,
            *features, dropout_p, False, build_matrix.backward_family(family, 64))
    torch.library.opcheck(torch.ops.flash_attn.bwd.default, args)
    torch.library.opcheck(torch.ops.flash_attn.dropout_mask.default,
                          (torch.tensor([7, 8]), 2, 6, 5, 7, 0.25))


def _attn(q, k, v, scale):
    return flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)


def _attn_features(q, k, v, slopes):
    return flash_attn.flash_attn_func(q, k, v, window_size=(3, 2), softcap=4.0,
                                      alibi_slopes=slopes)


def test_compile_fullgraph_with_features(fake_ext):
    compiled = torch.compile(_attn_features, backend="aot_eager", fullgraph=True)
    q, k, v = _qkv(sq=9, sk=11)
    slopes = torch.rand(6)
    out = compiled(q, k, v, slopes)
    out.float().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    ref = _attn_features(q2, k2, v2, slopes)
    ref.float().sum().backward()
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(g, r)


def test_compile_dropout_with_attn_probs(fake_ext):
    def f(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)

    q, k, v = _qkv(grad=False)
    out, lse, probs = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    keep = fake_ext.dropout_mask(fake_ext.rng_states[-1], 2, 6, 5, 7, 0.4)
    assert torch.equal(torch.signbit(probs), ~keep)


def test_compile_fullgraph_matches_eager(fake_ext):
    compiled = torch.compile(_attn, backend="aot_eager", fullgraph=True)
    for b, sq, sk in ((2, 5, 7), (3, 9, 11)):
        q, k, v = _qkv(b=b, sq=sq, sk=sk)
        out = compiled(q, k, v, 0.3)
        out.float().sum().backward()
        grads = [t.grad for t in (q, k, v)]
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        ref = _attn(q2, k2, v2, 0.3)
        ref.float().sum().backward()
        torch.testing.assert_close(out, ref)
        for g, r in zip(grads, (q2.grad, k2.grad, v2.grad)):
            torch.testing.assert_close(g, r)


def test_compile_dynamic_head_dims(fake_ext):
    compiled = torch.compile(_attn, backend="aot_eager", fullgraph=True, dynamic=True)
    for d in (60, 64, 72):
        q, k, v = _qkv(d=d, grad=False)
        torch.testing.assert_close(compiled(q, k, v, 0.2), _attn(q, k, v, 0.2))
        assert fake_ext.calls[-1][2][-1] == -(-d // 8) * 8


def test_compiled_errors_are_the_eager_ones(fake_ext):
    # Without fullgraph, dynamo hands an error path back to eager Python, which raises it.
    compiled = torch.compile(lambda q, k, v: flash_attn.flash_attn_func(q, k, v, backend="fa3"),
                             backend="aot_eager")
    q, k, v = _qkv(grad=False)
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*: fa3 needs sm90\+, this GPU is sm80"):
        compiled(q, k, v)


# ---- fa3's gradient: fa3's backward where it takes the call, else fa2's ------------------------

def _fa3_forward(path, q, k, v, softcap):
    if path == "eager":
        return flash_attn.flash_attn_func(q, k, v, causal=True, softcap=softcap)
    if path == "op":
        return torch.ops.flash_attn.fwd(q, k, v, q.shape[-1] ** -0.5, True, -1, 0, softcap,
                                        None, 0.0, False, "fa3")[0]
    compiled = torch.compile(lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True,
                                                                        softcap=softcap),
                             backend="aot_eager", fullgraph=True)
    return compiled(q, k, v)


@pytest.mark.parametrize("path", ["eager", "op", "compiled"])
@pytest.mark.parametrize("d,softcap,sq,bwd", [(192, 5.0, 512, "fa3"), (128, 0.0, 512, "fa3"),
                                              (64, 5.0, 512, "fa3"), (128, 0.0, 5, "fa2"),
                                              (256, 5.0, 300, "fa2")])
def test_fa3_gradient_runs_its_backward_family(fake_ext, path, d, softcap, sq, bwd):
    """On sm90 the forward runs fa3 and its gradient reaches the extension as fa3's own
    backward with SHORT_Q_ROWS query rows per KV head (512 x 3 here), else as family "fa2",
    with the right values, eagerly, through the op and compiled."""
    fake_ext.arch = 90
    q, k, v = _qkv(sq=sq, d=d)
    out = _fa3_forward(path, q, k, v, softcap)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert [c[:2] for c in fake_ext.calls] == [("fwd", "fa3"), ("bwd", bwd)]
    ref, _, inputs = _reference(q, k, v, d ** -0.5, True, softcap=softcap)
    ref.backward(dout.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    for got, want in zip((q, k, v), inputs):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=5e-3, rtol=5e-3)
