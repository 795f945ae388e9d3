"""FA1 on the GPU, through the public API, held to FlashAttention's error-versus-error rule.

For every case, on the same low-precision inputs:

- ``truth``: flash_attn.reference.attention_ref in float64 (gradients by autograd in float64);
- ``lowp``: the same reference with ``upcast=False``, i.e. what plain PyTorch computes at the
  input precision (gradients by autograd at that precision);
- ``ours``: ``flash_attn_func(..., backend='fa1')`` forward and backward.

The rule, per tensor, with errors as max |x - truth| over the whole tensor:

    out:        err(ours) <= 2 * err(lowp) + ulp
    dq, dk, dv: err(ours) <= 3 * err(lowp) + ulp
    where ulp = eps(dtype) * 2**floor(log2(max(max|truth|, 1/4)))

(one unit in the last place of the largest element of the truth. The 1/4 floor keeps the slack
from vanishing where the truth is all zero: with a single visible key per row, the exact dq and
dk are 0, PyTorch's come out exactly 0 too, and a kernel's are a few fp32 roundings.)

    lse: +inf exactly where the truth is +inf (rows that see no key), elsewhere
         |ours - truth| <= 2e-4 * (1 + |truth|) elementwise.

The kernel keeps the scores in fp32, so its lse is far more accurate than PyTorch's at fp16;
2e-4 leaves room for fp32 summation over a few thousand keys and the exp2 / log2 approximations.

Every output and gradient is allocated by the library; before each call the CUDA caching
allocator is filled with NaN, so an element a kernel never writes shows up as NaN.
"""

import importlib
import importlib.util
import math
import zlib

import pytest
import torch


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("flash_attn._C") is None:
        return "flash_attn._C is not built (installed with FLASH_ATTN_SKIP_CUDA_BUILD?)"
    # An extension that is there but does not load is a failure, not a skip.
    importlib.import_module("flash_attn._C")
    import flash_attn
    if "fa1" not in flash_attn.available_backends():
        return (f"this build does not run fa1 on this GPU "
                f"(available: {flash_attn.available_backends()})")
    return None


_SKIP = _skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

import flash_attn  # noqa: E402
from flash_attn.reference import attention_ref  # noqa: E402
from _gpu_common import assert_lse, assert_rule, poison_allocator, ulp  # noqa: E402

DEVICE = torch.device("cuda")
BACKEND = "fa1"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

SEQLENS = [(1, 1), (1, 239), (113, 203), (128, 217), (239, 1), (256, 512), (799, 3),
           (1023, 1024), (1024, 1023), (2048, 2048)]
HEAD_DIMS = [32, 40, 59, 64, 72, 96, 128]  # 59: the frontend pads it to 64


def _bf16_ok():
    return DEVICE.type != "cuda" or torch.cuda.get_device_capability(DEVICE) >= (8, 0)


DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16",
                 marks=pytest.mark.skipif(not _bf16_ok(), reason="bf16 needs sm80+")),
]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data per test, reproducible from the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _skip_unless_built(dtype, head_dim):
    """Skip a case the build matrix was trimmed of (FLASH_ATTN_DTYPES / _HDIMS)."""
    padded = -(-head_dim // 8) * 8
    have = {(c[1], c[2]) for c in importlib.import_module("flash_attn._C").built_configs()
            if c[0] == BACKEND and c[3] >= padded}
    if not {("fwd", DTYPE_NAMES[dtype]), ("bwd", DTYPE_NAMES[dtype])} <= have:
        pytest.skip(f"this build has no {BACKEND} {DTYPE_NAMES[dtype]} kernel for head dim "
                    f"{head_dim}")


# The rule (assert_rule, assert_lse, ulp) and the allocator poisoning live in _gpu_common.py,
# shared with the FA2 tests.


# ---- running a case ---------------------------------------------------------------------------

def _leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]


def _reference(inputs, to_qkv, dout, causal, upcast):
    """(out, lse, grads of inputs) of attention_ref on ``to_qkv(*inputs)``."""
    leaves = _leaves(inputs, torch.float64 if upcast else None)
    out, lse = attention_ref(*to_qkv(*leaves), causal=causal, upcast=upcast, return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), lse, grads


def _ours(inputs, call, dout):
    """(out, lse, grads of inputs) of the library, with poisoned memory before each pass."""
    leaves = _leaves(inputs)
    poison_allocator()
    out, lse, probs = call(*leaves)
    assert probs is None
    poison_allocator()
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse, grads


def check(inputs, names, dtype, causal, call, to_qkv=lambda q, k, v: (q, k, v), dout=None):
    """Run ours and both references on ``inputs`` and apply the rule; returns ours."""
    q_shape = to_qkv(*inputs)[0].shape
    if dout is None:
        dout = torch.randn(q_shape, dtype=dtype, device=DEVICE)
    truth = _reference(inputs, to_qkv, dout, causal, upcast=True)
    lowp = _reference(inputs, to_qkv, dout, causal, upcast=False)
    ours = _ours(inputs, call, dout)
    assert_rule("out", ours[0], lowp[0], truth[0], 2, dtype)
    assert_lse(ours[1], truth[1])
    for name, g, g_lowp, g_truth in zip(names, ours[2], lowp[2], truth[2]):
        assert_rule(f"d{name}", g, g_lowp, g_truth, 3, dtype)
    return ours


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def _func(causal, backend=BACKEND, deterministic=False):
    def call(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic,
                                          return_attn_probs=True, backend=backend)
    return call


def run_case(b, sq, sk, h, hk, d, causal, dtype, backend=BACKEND, deterministic=False):
    _skip_unless_built(dtype, d)
    inputs = (_randn(b, sq, h, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype),
              _randn(b, sk, hk, d, dtype=dtype))
    return check(inputs, "qkv", dtype, causal, _func(causal, backend, deterministic))


# ---- the grid ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_seqlens(sq, sk, d, causal, dtype):
    run_case(2, sq, sk, 4, 4, d, causal, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1023, 1024)])
@pytest.mark.parametrize("d", [hd for hd in HEAD_DIMS if hd not in (64, 128)])
def test_head_dims(d, sq, sk, causal, dtype):
    run_case(2, sq, sk, 4, 4, d, causal, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (239, 1), (1023, 1024)])
@pytest.mark.parametrize("h,hk", [(6, 2), (7, 1)], ids=["gqa6-2", "mqa7-1"])
def test_gqa(h, hk, sq, sk, causal, dtype):
    # check() asserts dk / dv come back with nheads_k heads, not nheads.
    run_case(2, sq, sk, h, hk, 64, causal, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_automatic_training_where_fa2s_backward_does_not_fit(monkeypatch, causal):
    """sm86 / sm89 let a block opt into 99 KB of shared memory, less than any fa2 backward
    needs (build_matrix: fa2's bwd_smem), so there the automatic choice trains on fa1, visibly.
    This GPU allows more: the dispatcher is told 99 KB. (On sm90 a short query's fa3 gradient
    is fa2's backward, so that call goes to fa1 too.)"""
    from flash_attn import _dispatch
    monkeypatch.setattr(_dispatch, "device_smem", lambda device: 99 * 1024)
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(_dispatch, "_DECISIONS", {})  # the warning comes with a new decision
    dtype, d = torch.bfloat16, 128
    _skip_unless_built(dtype, d)
    # The warning names the first family passed over: fa2 (and on sm90 fa3), for their shared
    # memory, only where they are built (else for that).
    built = {(c.family, c.direction) for c in _dispatch.built_configs()
             if c.dtype == "bf16" and c.hdim >= d}
    wanted = {("fa2", "fwd"), ("fa2", "bwd")} | (
        {("fa3", "fwd")} if torch.cuda.get_device_capability() == (9, 0) else set())
    if not wanted <= built:
        pytest.skip(f"needs {sorted(wanted - built)} bf16 kernels for head dim {d} in the build")
    inputs = (_randn(2, 113, 6, d, dtype=dtype), _randn(2, 203, 2, d, dtype=dtype),
              _randn(2, 203, 2, d, dtype=dtype))
    with pytest.warns(flash_attn.BackendFallbackWarning):
        assert flash_attn.select_backend(inputs[0].detach().requires_grad_(), *inputs[1:],
                                         causal=causal) == "fa1"
    _dispatch._DECISIONS.clear()
    with pytest.warns(flash_attn.BackendFallbackWarning, match=r"running fa1 instead of fa[23], .* needs \d+ KB of shared memory per block, and this GPU allows 99 KB"):
        check(inputs, "qkv", dtype, causal, _func(causal, backend=None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1024, 1023)])
def test_backends_agree(sq, sk, causal, dtype):
    """Every backend this build runs here passes the rule on the same inputs, and any two agree
    with each other within 2 x PyTorch's error + ulp."""
    b, h, hk, d = 2, 6, 2, 64
    inputs = (_randn(b, sq, h, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype),
              _randn(b, sk, hk, d, dtype=dtype))
    dout = _randn(b, sq, h, d, dtype=dtype)
    results = {}
    for backend in flash_attn.available_backends():
        try:
            flash_attn.select_backend(*inputs, causal=causal, backend=backend)
        except (NotImplementedError, RuntimeError):
            continue  # this family cannot run this call here (not built for it, or a feature)
        results[backend] = check(inputs, "qkv", dtype, causal, _func(causal, backend), dout=dout)
    assert results, f"no backend of {flash_attn.available_backends()} runs this call"
    same = lambda q, k, v: (q, k, v)  # noqa: E731
    truth = _reference(inputs, same, dout, causal, upcast=True)
    lowp = _reference(inputs, same, dout, causal, upcast=False)
    names = list(results)
    for i, a in enumerate(names):
        for c in names[i + 1:]:
            pairs = zip(["out", "dq", "dk", "dv"], (results[a][0], *results[a][2]),
                        (results[c][0], *results[c][2]), (truth[0], *truth[2]),
                        (lowp[0], *lowp[2]))
            for what, x, y, t, e in pairs:
                err_lowp = (e.double() - t).abs().max().item()
                diff = (x.double() - y.double()).abs().max().item()
                assert diff <= 2 * err_lowp + ulp(t.abs().max().item(), dtype), (
                    f"{what}: {a} and {c} differ by {diff:.3e}; PyTorch's error is {err_lowp:.3e}")


# ---- determinism ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_backward_is_bitwise_repeatable(causal, dtype):
    b, sq, sk, h, hk, d = 2, 1023, 1024, 6, 2, 64
    _skip_unless_built(dtype, d)
    inputs = (_randn(b, sq, h, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype),
              _randn(b, sk, hk, d, dtype=dtype))
    dout = _randn(b, sq, h, d, dtype=dtype)
    call = _func(causal, deterministic=True)
    first = check(inputs, "qkv", dtype, causal, call, dout=dout)
    for run in range(7):
        out, lse, grads = _ours(inputs, call, dout)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"run {run}: forward"
        for name, g, g0 in zip("qkv", grads, first[2]):
            assert torch.equal(g, g0), f"run {run}: d{name} differs bitwise from run 0"


# ---- layouts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked(causal, dtype):
    b, s, h, d = 2, 257, 4, 64
    _skip_unless_built(dtype, d)

    def call(qkv):
        return flash_attn.flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True,
                                                    backend=BACKEND)
    check((_randn(b, s, 3, h, d, dtype=dtype),), ["qkv"], dtype, causal, call,
          to_qkv=lambda qkv: qkv.unbind(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvpacked(causal, dtype):
    b, sq, sk, h, hk, d = 2, 113, 203, 6, 2, 72
    _skip_unless_built(dtype, d)

    def call(q, kv):
        return flash_attn.flash_attn_kvpacked_func(q, kv, causal=causal, return_attn_probs=True,
                                                   backend=BACKEND)
    check((_randn(b, sq, h, d, dtype=dtype), _randn(b, sk, 2, hk, d, dtype=dtype)), ["q", "kv"],
          dtype, causal, call, to_qkv=lambda q, kv: (q, *kv.unbind(2)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs(causal, dtype):
    """q heads-first then transposed, k a slice of a wider last dim, v transposed: strides
    that are not those of a contiguous (b, s, h, d) tensor, last dim still contiguous."""
    b, sq, sk, h, hk, d = 2, 239, 130, 6, 3, 64
    _skip_unless_built(dtype, d)

    def views(q_bhsd, k_wide, v_bhsd):
        return q_bhsd.transpose(1, 2), k_wide[..., 8:8 + d], v_bhsd.transpose(1, 2)

    def call(q_bhsd, k_wide, v_bhsd):
        q, k, v = views(q_bhsd, k_wide, v_bhsd)
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
        return _func(causal)(q, k, v)

    inputs = (_randn(b, h, sq, d, dtype=dtype), _randn(b, sk, hk, d + 24, dtype=dtype),
              _randn(b, hk, sk, d, dtype=dtype))
    check(inputs, ["q", "k_wide", "v"], dtype, causal, call, to_qkv=views)


# ---- a training loop --------------------------------------------------------------------------

class _TinyAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads)
        out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True, backend=BACKEND)
        return self.proj(out.reshape(b, s, dim))


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_loop_smoke(dtype):
    """A few optimizer steps of a tiny causal attention layer under autocast: the loss stays
    finite and goes down."""
    _skip_unless_built(dtype, 32)
    b, s, heads, dim = 4, 200, 4, 128
    model = _TinyAttention(dim, heads).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randn(b, s, dim, device=DEVICE)
    # A target the layer can express: a fixed linear map of the running mean of the inputs.
    running_mean = x.cumsum(1) / torch.arange(1, s + 1, device=DEVICE).view(1, s, 1)
    target = running_mean @ torch.randn(dim, dim, device=DEVICE) / math.sqrt(dim)
    losses = []
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=DEVICE.type, dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        assert torch.isfinite(loss), f"loss {loss.item()} after {len(losses)} steps"
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"loss went {losses[0]:.4f} -> {losses[-1]:.4f}"


# ---- small cases for compute-sanitizer (.ci/gpu sanitize runs `-k sanitize`) ------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", [
    (1, 113, 203, 6, 2, 40, True),    # ragged tiles, GQA, padded head dim, bottom-right causal
    (2, 239, 17, 4, 4, 128, True),    # seqlen_q > seqlen_k: rows with no key
    (1, 65, 129, 2, 1, 96, False),    # MQA, ragged K/V tile
])
def test_sanitize_small(b, sq, sk, h, hk, d, causal, dtype):
    run_case(b, sq, sk, h, hk, d, causal, dtype)


# ---- the real extension under torch.library's checks and torch.compile ------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_opcheck_real_kernels(causal):
    _skip_unless_built(torch.float16, 64)
    q = _randn(2, 77, 4, 64, dtype=torch.float16)
    k, v = _randn(2, 93, 2, 64, dtype=torch.float16), _randn(2, 93, 2, 64, dtype=torch.float16)
    # FA1 has no window, softcap, ALiBi or dropout: (-1, -1), 0.0, None, 0.0.
    features = (-1, -1, 0.0, None, 0.0)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default,
                          (q, k, v, 0.125, causal, *features, False, BACKEND))
    out, lse, rng_state = torch.ops.flash_attn.fwd(q, k, v, 0.125, causal, *features, False,
                                                   BACKEND)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flash_attn.bwd.default,
                          (dout, q, k, v, out, lse, rng_state, 0.125, causal, *features, True,
                           BACKEND))


def test_compile_fullgraph_forward_backward():
    """torch.compile(fullgraph=True) traces forward and backward with no graph break, and runs
    the same kernels: with the deterministic backward, gradients equal eager's bit for bit (the
    loss only to rounding: inductor may sum in another order)."""
    _skip_unless_built(torch.bfloat16, 64)
    torch._dynamo.reset()

    def step(q, k, v):
        out = flash_attn.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                         backend=BACKEND)
        return out.float().square().sum()

    q, k, v = _leaves([_randn(2, 300, 4, 64, dtype=torch.bfloat16),
                       _randn(2, 300, 2, 64, dtype=torch.bfloat16),
                       _randn(2, 300, 2, 64, dtype=torch.bfloat16)])
    eager_loss = step(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for g, ge in zip(grads, eager_grads):
        assert torch.equal(g, ge)


# ---- bad input on the GPU: a Python exception before any launch, and the GPU stays usable -----

def _bad_calls():
    h = torch.float16
    q, k, v = (_randn(1, 64, 4, 64, dtype=h) for _ in range(3))
    return [
        ("dtype float32", lambda: flash_attn.flash_attn_func(q.float(), k.float(), v.float()),
         TypeError),
        ("mixed dtypes", lambda: flash_attn.flash_attn_func(q, k.bfloat16(), v), (TypeError, ValueError)),
        ("cpu k", lambda: flash_attn.flash_attn_func(q, k.cpu(), v), ValueError),
        ("3-d q", lambda: flash_attn.flash_attn_func(q[0], k, v), ValueError),
        ("heads 4 vs 3", lambda: flash_attn.flash_attn_func(q, k[:, :, :3], v[:, :, :3]), ValueError),
        ("k/v seqlen", lambda: flash_attn.flash_attn_func(q, k, v[:, :32]), ValueError),
        ("head dim 136 on fa1", lambda: flash_attn.flash_attn_func(
            _randn(1, 64, 4, 136, dtype=h), _randn(1, 64, 4, 136, dtype=h),
            _randn(1, 64, 4, 136, dtype=h), backend=BACKEND), NotImplementedError),
        ("dropout on fa1", lambda: flash_attn.flash_attn_func(q, k, v, dropout_p=0.1,
                                                               backend=BACKEND), NotImplementedError),
        ("window on fa1", lambda: flash_attn.flash_attn_func(q, k, v, window_size=(8, 8),
                                                              backend=BACKEND), NotImplementedError),
        ("lse on the CPU, straight into the extension", lambda: importlib.import_module(
            "flash_attn._C").fwd(q, k, v, torch.empty_like(q),
                                 torch.empty(1, 4, 64, dtype=torch.float32),
                                 torch.zeros(2, dtype=torch.int64, device=DEVICE), None, 0.125,
                                 False, -1, -1, 0.0, 0.0, BACKEND),
         RuntimeError),
        ("dropout straight into fa1's extension entry", lambda: importlib.import_module(
            "flash_attn._C").fwd(q, k, v, torch.empty_like(q),
                                 torch.empty(1, 4, 64, dtype=torch.float32, device=DEVICE),
                                 torch.zeros(2, dtype=torch.int64, device=DEVICE), None, 0.125,
                                 False, -1, -1, 0.0, 0.1, BACKEND),
         RuntimeError),
    ]


def test_bad_input_raises_and_gpu_stays_usable():
    for name, call, error in _bad_calls():
        with pytest.raises(error):
            call()
        torch.cuda.synchronize()  # would raise if anything had faulted on the device
    run_case(1, 100, 130, 4, 2, 64, True, torch.float16)


# ---- a long sequence: many K/V steps through the running O in global memory --------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence(causal):
    run_case(1, 8192, 8192, 2, 1, 128, causal, torch.bfloat16)
