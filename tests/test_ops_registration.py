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
from flash_attn import _validate
from conftest import naive_attention


# ---- schemas and signatures -------------------------------------------------------------------

def test_schemas():
    assert str(torch.ops.flash_attn.fwd.default._schema) == (
        "flash_attn::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
        "bool deterministic, str backend) -> (Tensor out, Tensor lse)")
    assert str(torch.ops.flash_attn.bwd.default._schema) == (
        "flash_attn::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float softmax_scale, bool causal, bool deterministic, str backend) "
        "-> (Tensor dq, Tensor dk, Tensor dv)")


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
    assert extra == [("backend", inspect.Parameter.KEYWORD_ONLY, None)]


@pytest.mark.parametrize("name,params", [
    ("flash_attn_varlen_func", ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                "max_seqlen_k"] + [n for n, _ in _COMMON] + ["block_table"]),
    ("flash_attn_varlen_qkvpacked_func", ["qkv", "cu_seqlens", "max_seqlen"] + [n for n, _ in _COMMON]),
    ("flash_attn_varlen_kvpacked_func", ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                         "max_seqlen_k"] + [n for n, _ in _COMMON]),
    ("flash_attn_with_kvcache", ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin",
                                 "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                                 "softmax_scale", "causal", "window_size", "softcap",
                                 "rotary_interleaved", "alibi_slopes", "num_splits",
                                 "return_softmax_lse"]),
])
def test_unimplemented_signatures_are_2x(name, params):
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
        out, lse = torch.ops.flash_attn.fwd(q, k, k, 0.125, True, False, "fa1")
        assert (out.shape, out.dtype, out.device.type) == ((2, 5, 6, 64), torch.bfloat16, "cuda")
        assert out.is_contiguous()
        assert (lse.shape, lse.dtype, lse.device.type) == ((2, 6, 5), torch.float32, "cuda")
        dq, dk, dv = torch.ops.flash_attn.bwd(out, q, k, k, out, lse, 0.125, True, True, "fa1")
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


def _reference(q, k, v, scale, causal):
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qf, kf, vf, scale, causal)
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
    assert fwd == ("fwd", "fa1", (2, 5, 6, 64), 0.25, True)
    assert bwd == ("bwd", "fa1", (2, 5, 6, 64), 0.25, True, True)


def test_window_minus_one_zero_runs_as_causal(fake_ext):
    q, k, v = _qkv(grad=False)
    out = flash_attn.flash_attn_func(q, k, v, window_size=(-1, 0))
    assert fake_ext.calls[-1][-1] is True
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q, k, v, causal=True))


def test_empty_sequences(fake_ext):
    q, k, v = _qkv(sk=0)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == math.inf).all())
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
    fake_ext.fwd = lambda q, *a: (seen.append(q.storage_offset()), original(q, *a))
    out = flash_attn.flash_attn_func(q, q, q)
    assert seen == [0]
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q.clone(), q.clone(), q.clone()))


# ---- opcheck and torch.compile ----------------------------------------------------------------

def test_opcheck_fwd_bwd(fake_ext):
    q, k, v = _qkv(d=64)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, (q, k, v, 0.125, True, False, "fa1"))
    with torch.no_grad():
        out, lse = torch.ops.flash_attn.fwd(q, k, v, 0.125, True, False, "fa1")
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.125, True, False, "fa1")
    torch.library.opcheck(torch.ops.flash_attn.bwd.default, args)


def _attn(q, k, v, scale):
    return flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)


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
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call"):
        compiled(q, k, v)
