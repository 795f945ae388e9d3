"""The FP8 frontend on CPU (fake_ext: the extension's fp8_fwd computed by the float64
reference): what reaches the kernels, and the errors of calls they cannot run."""

import pytest
import torch

import flash_attn
from flash_attn import build_matrix
from flash_attn.reference import attention_ref

E4M3 = torch.float8_e4m3fn


def _fp8(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(E4M3)


@pytest.fixture
def sm90(fake_ext):
    fake_ext.arch = 90
    return fake_ext


def test_fp8_call_reaches_fa3_with_descales(sm90):
    b, s, h, hk, d = 2, 33, 4, 2, 64
    q, k, v = _fp8(b, s, h, d), _fp8(b, 40, hk, d), _fp8(b, 40, hk, d)
    qd, kd = torch.rand(b, hk) + 0.5, torch.rand(b, hk) + 0.5
    vd = torch.tensor(0.25)  # broadcast to (batch, nheads_k)
    out = flash_attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                     v_descale=vd)
    name, family, shape, scale, causal, window, *descales = sm90.calls[-1]
    assert (name, family, shape, causal) == ("fp8_fwd", "fa3", (b, s, h, d), True)
    assert scale == pytest.approx(d ** -0.5)
    assert all(x.shape == (b, hk) and x.is_contiguous() for x in descales)
    assert out.dtype == torch.bfloat16 and out.shape == (b, s, h, d)
    per_head = lambda x, t: x.double() * t.double().expand(b, hk).repeat_interleave(
        h // hk if x.shape[2] == h else 1, dim=1)[:, None, :, None]
    truth = attention_ref(per_head(q, qd), per_head(k, kd), per_head(v, vd), causal=True)
    torch.testing.assert_close(out.double(), truth, atol=2e-2, rtol=2e-2)


def test_fp8_return_attn_probs_gives_lse(sm90):
    q = _fp8(1, 8, 2, 32)
    out, lse, probs = flash_attn.flash_attn_func(q, q, q, return_attn_probs=True)
    assert probs is None and lse.shape == (1, 2, 8) and lse.dtype == torch.float32


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(softcap=30.0), NotImplementedError, "softcap"),
    (dict(alibi_slopes=torch.ones(2)), NotImplementedError, "alibi"),
    (dict(dropout_p=0.1), NotImplementedError, "dropout"),
    (dict(softmax_scale=-1.0), NotImplementedError, "positive scale"),
    (dict(out_dtype=torch.float16), NotImplementedError, "bfloat16 only"),
    (dict(k_descale=torch.ones(3, 2)), ValueError, r"k_descale must be \(batch, nheads_k\)"),
    (dict(q_descale=torch.ones(1, 2, dtype=torch.float64)), TypeError, "float32"),
    (dict(backend="fa2"), NotImplementedError, "no FP8 kernels"),
])
def test_fp8_refusals(sm90, kwargs, error, match):
    q = _fp8(1, 16, 2, 32)
    with pytest.raises(error, match=match):
        flash_attn.flash_attn_func(q, q, q, **kwargs)
    assert not [c for c in sm90.calls if c[0] == "fp8_fwd"]


def test_fp8_input_checks(sm90):
    q = _fp8(1, 16, 2, 32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        flash_attn.flash_attn_func(q, q, q.to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        x = _fp8(1, 16, 2, 40)
        flash_attn.flash_attn_func(x, x, x)
    with pytest.raises(RuntimeError, match="requires grad"):
        flash_attn.flash_attn_func(q.clone().requires_grad_(), q, q)
    with pytest.raises(ValueError, match="out_dtype"):
        x = torch.randn(1, 16, 2, 32, dtype=torch.bfloat16)
        flash_attn.flash_attn_func(x, x, x, out_dtype=torch.float16)


def test_fp8_needs_sm90_and_e4m3_kernels(sm90):
    q = _fp8(1, 16, 2, 32)
    sm90.arch = 80
    with pytest.raises(RuntimeError, match="sm90"):
        flash_attn.flash_attn_func(q, q, q)
    sm90.arch = 90
    sm90.configs = [c for c in sm90.configs if c[2] != "e4m3"]
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_DTYPES"):
        flash_attn.flash_attn_func(q, q, q)


def test_fp8_kernels_in_the_build_matrix():
    assert build_matrix.FAMILIES["fa3"].fp8_hdims == (64, 128, 256)
    assert all(not f.fp8_hdims for name, f in build_matrix.FAMILIES.items() if name != "fa3")


@pytest.mark.parametrize("head_dim", [64, 80, 128, 192, 256])
def test_rotation_is_orthogonal(head_dim):
    r = flash_attn.fp8.rotation(head_dim, "cpu", torch.Generator().manual_seed(0))
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim), atol=1e-5, rtol=0)


@pytest.mark.parametrize("hadamard", [True, False])
def test_quantize_keeps_the_scores(hadamard):
    b, s, h, hk, d = 2, 64, 4, 2, 128
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    q[0, 3, 1, 5] = 40.0  # an outlier, which the rotation spreads
    q8, k8, v8, ds = flash_attn.fp8.quantize(q, k, v, hadamard=hadamard,
                                             generator=torch.Generator().manual_seed(1))
    assert {x.dtype for x in (q8, k8, v8)} == {torch.float8_e4m3fn}
    assert set(ds) == {"q_descale", "k_descale", "v_descale"}
    assert all(x.shape == (b, hk) and x.dtype == torch.float32 for x in ds.values())
    deq = lambda x, sc: x.float() * sc.repeat_interleave(x.shape[2] // hk, 1)[:, None, :, None]
    scores = lambda a, c: torch.einsum("bshd,bthd->bhst", a, c.repeat_interleave(h // hk, 2))
    got = scores(deq(q8, ds["q_descale"]), deq(k8, ds["k_descale"]))
    want = scores(q, k)
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    torch.testing.assert_close(deq(v8, ds["v_descale"]), v, atol=0.1, rtol=0.07)


def test_fp8_kernel_of_a_trimmed_build(sm90):
    """A build with only the hdim 256 e4m3 kernel runs head dim 64 on it, as the extension's
    lookup (the smallest built kernel at least as large) does."""
    sm90.configs = [c for c in sm90.configs if c[2] != "e4m3" or c[3] == 256]
    q = _fp8(1, 16, 2, 64)
    assert flash_attn.flash_attn_func(q, q, q).dtype == torch.bfloat16


def test_fp8_select_backend_and_other_entry_points(sm90):
    q = _fp8(1, 16, 2, 64)
    assert flash_attn.select_backend(q, q, q, causal=True) == "fa3"
    with pytest.raises(NotImplementedError, match="no FP8 kernels"):
        flash_attn.select_backend(q, q, q, backend="fa1")
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func: FP8"):
        flash_attn.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 16, 16)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache: FP8"):
        flash_attn.flash_attn_with_kvcache(q, q, q)


def test_fp8_under_torch_compile_fullgraph(sm90):
    q, k, v = _fp8(1, 16, 2, 64), _fp8(1, 24, 1, 64), _fp8(1, 24, 1, 64)
    qd = torch.rand(1, 1) + 0.5
    fn = torch.compile(lambda q, k, v, d: flash_attn.flash_attn_func(
        q, k, v, causal=True, q_descale=d, k_descale=d, v_descale=d), fullgraph=True,
        backend="eager")
    out = fn(q, k, v, qd)
    want = flash_attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=qd,
                                      v_descale=qd)
    torch.testing.assert_close(out, want)
    assert any(c[0] == "fp8_fwd" for c in sm90.calls)


def test_fp8_quantize_op_under_fake_tensors():
    """The kernel's op (what torch.compile traces) gives e4m3 tensors in the inputs' shapes and
    the (3, batch, nheads_k) descales quantize splits."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 5, 4, 64, dtype=torch.bfloat16)
        k = torch.empty(2, 7, 2, 64, dtype=torch.bfloat16)
        q8, k8, v8, d = torch.ops.flash_attn.fp8_quantize(q, k, k, torch.empty(64))
    assert (q8.dtype, q8.shape, k8.shape, v8.shape) == (E4M3, q.shape, k.shape, k.shape)
    assert d.shape == (3, 2, 2) and d.dtype == torch.float32
