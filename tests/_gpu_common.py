"""The GPU tests' yardstick: the error-versus-error rule, the references it measures against, and
the poisoned allocator that makes an unwritten output visible.

For every case, on the same low-precision inputs:

- ``truth``: flash_attn.reference.attention_ref in float64 (gradients by autograd in float64);
- ``lowp``: the same reference with ``upcast=False``, i.e. what plain PyTorch computes at the
  input precision (gradients by autograd at that precision);
- ``ours``: the library's forward and backward.

The rule, per tensor, with errors as max |x - truth| over the whole tensor:

    out:        err(ours) <= 2 * err(lowp) + ulp
    dq, dk, dv: err(ours) <= 3 * err(lowp) + ulp
    where ulp = eps(dtype) * 2**floor(log2(max(max|truth|, 1/4)))
    lse: +inf exactly where the truth is +inf (rows that see no key), elsewhere
         |ours - truth| <= 2e-4 * (1 + |truth|) elementwise.

(test_fa1_gpu.py says why the 1/4 floor and the 2e-4.) On top of the rule, what no key reaches
must be exactly zero: out and dq of a row that sees no key, dk and dv of a key no row sees; a
kernel that skips such a tile must still write its zeros.

Dropout: the keep-mask is read off the forward's S_dmask (return_attn_probs=True) and handed to
the references, so the rule checks the kernels' own draws, forward and backward.

Every output and gradient is allocated by the library; before each call the CUDA caching
allocator is filled with NaN, so an element a kernel never writes shows up as NaN.

Importing this module touches no GPU and needs no flash_attn._C: files that use it collect, and
skip, on a machine without either.
"""

import importlib
import math
import os
from typing import NamedTuple, Optional

import pytest
import torch

from flash_attn.reference import attention_mask, attention_ref

DEVICE = torch.device("cuda")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
LSE_TOL = 2e-4
POISON_BYTES = 256 << 20
GIB = 1 << 30


def dtype_params(bf16_ok=True):
    """The two kernel dtypes as pytest params (ids fp16 / bf16)."""
    return [pytest.param(torch.float16, id="fp16"),
            pytest.param(torch.bfloat16, id="bf16",
                         marks=pytest.mark.skipif(not bf16_ok, reason="bf16 needs sm80+"))]


def skip_unless_built(family, dtype, head_dim, directions=("fwd", "bwd")):
    """Skip a case the build matrix was trimmed of (FLASH_ATTN_DTYPES / _HDIMS)."""
    padded = -(-head_dim // 8) * 8
    have = {(c[1], c[2]) for c in importlib.import_module("flash_attn._C").built_configs()
            if c[0] == family and c[3] >= padded}
    if not {(d, DTYPE_NAMES[dtype]) for d in directions} <= have:
        pytest.skip(f"this build has no {family} {DTYPE_NAMES[dtype]} kernel for head dim "
                    f"{head_dim}")


def require_free_memory(nbytes):
    """Skip unless the GPU has ``nbytes`` free (after handing the cache back)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(DEVICE)
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GIB:.1f} GiB of free GPU memory; {free / GIB:.1f} of "
                    f"{total / GIB:.1f} GiB are free")


def poison_allocator():
    """Fill the memory the caching allocator will hand out next with 0xFF bytes (NaN in fp16,
    bf16 and fp32): empty the cache, then allocate, fill and free blocks of the large pool and of
    the small pool (allocations <= 1 MiB, carved from 2 MiB segments). Without the caching
    allocator (the compute-sanitizer run) there is nothing to poison; its initcheck does this
    job there."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        return
    torch.cuda.empty_cache()
    blocks = [torch.full((POISON_BYTES,), 0xFF, dtype=torch.uint8, device=DEVICE)]
    blocks += [torch.full((1 << 20,), 0xFF, dtype=torch.uint8, device=DEVICE) for _ in range(32)]
    del blocks


def randn(*shape, dtype, scale=1.0):
    t = torch.randn(*shape, dtype=dtype, device=DEVICE)
    return t if scale == 1.0 else t.mul_(scale)


def qkv(b, sq, sk, h, hk, d, dtype):
    """Fresh random q (b, sq, h, d) and k, v (b, sk, hk, d) on the GPU."""
    return (randn(b, sq, h, d, dtype=dtype), randn(b, sk, hk, d, dtype=dtype),
            randn(b, sk, hk, d, dtype=dtype))


def alibi_slopes(shape, nheads):
    """ALiBi's geometric slopes 2^(-8 (i + 1) / nheads), each times a random factor in
    [0.5, 1.5) (so the rows of a (batch, nheads) tensor differ), fp32 on the GPU."""
    base = 2.0 ** (-8.0 * torch.arange(1, nheads + 1, device=DEVICE) / nheads)
    return (base * (0.5 + torch.rand(shape, device=DEVICE))).float()


def attn_args(spec, batch, nheads):
    """flash_attn_func keyword arguments from a parametrisation: ``alibi`` ('per-head' /
    'per-batch') becomes random slopes."""
    attn = dict(spec)
    kind = attn.pop("alibi", None)
    if kind is not None:
        attn["alibi_slopes"] = alibi_slopes({"per-head": (nheads,),
                                             "per-batch": (batch, nheads)}[kind], nheads)
    return attn


def leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]


def unpacked(q, k, v):
    return q, k, v


# ---- the rule ---------------------------------------------------------------------------------

def ulp(truth_max, dtype):
    _, exponent = math.frexp(max(truth_max, 0.25))
    return math.ldexp(torch.finfo(dtype).eps, exponent - 1)


def max_err(x, truth):
    return (x.double() - truth).abs().max().item() if truth.numel() else 0.0


class Rule:
    """The rule for one tensor, fed chunk by chunk (a case too big for a one-piece reference):
    both errors and max|truth| are maxima over the chunks, so one chunk is the plain rule."""

    def __init__(self, name, factor, dtype):
        self.name, self.factor, self.dtype = name, factor, dtype
        self.err = self.err_lowp = self.truth_max = 0.0

    def add(self, ours, lowp, truth):
        name = self.name
        assert ours.shape == truth.shape, (
            f"{name}: shape {tuple(ours.shape)} != {tuple(truth.shape)}")
        assert ours.dtype == self.dtype, f"{name}: dtype {ours.dtype} != {self.dtype}"
        assert not torch.isnan(ours).any(), f"{name}: NaN (an element the kernel did not write?)"
        self.err = max(self.err, max_err(ours, truth))
        self.err_lowp = max(self.err_lowp, max_err(lowp, truth))
        if truth.numel():
            self.truth_max = max(self.truth_max, truth.abs().max().item())
        return self

    def check(self):
        slack = ulp(self.truth_max, self.dtype)
        assert self.err <= self.factor * self.err_lowp + slack, (
            f"{self.name}: max error {self.err:.3e} > {self.factor} x PyTorch's "
            f"{self.err_lowp:.3e} + ulp {slack:.1e}")


def assert_rule(name, ours, lowp, truth, factor, dtype):
    Rule(name, factor, dtype).add(ours, lowp, truth).check()


def assert_lse(ours, truth):
    assert ours.shape == truth.shape and ours.dtype == torch.float32, (
        f"lse: {ours.dtype} {tuple(ours.shape)}, want float32 {tuple(truth.shape)}")
    assert not torch.isnan(ours).any(), "lse: NaN (an element the kernel did not write?)"
    empty = torch.isposinf(truth)
    assert torch.equal(torch.isposinf(ours), empty), (
        "lse: +inf must mark exactly the rows that see no key")
    diff = (ours.double() - truth)[~empty].abs()
    tol = LSE_TOL * (1 + truth[~empty].abs())
    if diff.numel():
        worst = (diff / tol).argmax()
        assert (diff <= tol).all(), (f"lse: error {diff[worst].item():.3e} > tolerance "
                                     f"{tol[worst].item():.3e}")


class Result(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    grads: tuple
    probs: Optional[torch.Tensor] = None   # S_dmask, with dropout


def assert_result(ours, lowp, truth, names, dtype):
    assert_rule("out", ours.out, lowp.out, truth.out, 2, dtype)
    assert_lse(ours.lse, truth.lse)
    assert len(ours.grads) == len(truth.grads) == len(names)
    for name, g, g_lowp, g_truth in zip(names, ours.grads, lowp.grads, truth.grads):
        assert_rule(f"d{name}", g, g_lowp, g_truth, 3, dtype)


# ---- attention options, as the references take them -----------------------------------------

def window_2x(window, seqlen_k):
    """flash_attn 2.x treats a window side >= seqlen_k as unbounded (the frontend and kernels
    follow it); attention_ref takes a window literally, so it is handed this."""
    return tuple(-1 if w >= seqlen_k else w for w in window)


def keep_mask(s_dmask):
    """The dropout keep-mask in S_dmask: 2.x negates a dropped probability, so the sign bit marks
    a drop, also for a probability that is 0 (a dropped 0 comes back as -0.0)."""
    return ~torch.signbit(s_dmask)


def reference_attn(attn, shape_q, seqlen_k, probs=None):
    """attention_ref's keyword arguments for a call made with ``attn``: the window in 2.x's
    reading and, with dropout, the keep-mask of the forward's S_dmask."""
    ref = dict(attn)
    if "window_size" in ref:
        ref["window_size"] = window_2x(ref["window_size"], seqlen_k)
    if ref.get("dropout_p", 0.0) > 0:
        b, sq, h, _ = shape_q
        assert probs is not None, "dropout_p > 0 and return_attn_probs=True must give S_dmask"
        assert probs.shape == (b, h, sq, seqlen_k), (
            f"S_dmask: shape {tuple(probs.shape)}, want {(b, h, sq, seqlen_k)}")
        ref["dropout_mask"] = keep_mask(probs)
    return ref


def visibility(seqlen_q, seqlen_k, attn):
    """(seqlen_q, seqlen_k) bool: which key each row sees under ``attn`` (2.x's window)."""
    window = window_2x(attn.get("window_size", (-1, -1)), seqlen_k)
    return attention_mask(seqlen_q, seqlen_k, attn.get("causal", False), window, device=DEVICE)


def assert_unreached_zero(ours, seqlen_q, seqlen_k, attn):
    """out / dq of rows that see no key and dk / dv of keys no row sees are exactly 0."""
    visible = visibility(seqlen_q, seqlen_k, attn)
    rows, keys = ~visible.any(1), ~visible.any(0)
    for name, t, sel in (("out", ours.out, rows), ("dq", ours.grads[0], rows),
                         ("dk", ours.grads[1], keys), ("dv", ours.grads[2], keys)):
        if sel.any():
            bad = torch.count_nonzero(t[:, sel]).item()   # NaN counts as nonzero
            assert bad == 0, (f"{name}: {bad} nonzero elements where no key reaches "
                              f"({'rows' if sel is rows else 'keys'} "
                              f"{sel.nonzero().flatten()[:8].tolist()}...)")


# ---- running a case ---------------------------------------------------------------------------

def reference(inputs, to_qkv, dout, upcast, attn):
    """Result of attention_ref on ``to_qkv(*inputs)`` (grads of ``inputs``)."""
    lv = leaves(inputs, torch.float64 if upcast else None)
    out, lse = attention_ref(*to_qkv(*lv), upcast=upcast, return_lse=True, **attn)
    grads = torch.autograd.grad(out, lv, dout.to(out.dtype))
    return Result(out.detach(), lse, grads)


def run_ours(inputs, call, dout):
    """Result of the library (``call`` returns out, lse, S_dmask), memory poisoned before each
    pass."""
    lv = leaves(inputs)
    poison_allocator()
    out, lse, probs = call(*lv)
    poison_allocator()
    grads = torch.autograd.grad(out, lv, dout)
    return Result(out.detach(), lse, grads, probs)


def check(inputs, names, dtype, call, attn=None, to_qkv=unpacked, dout=None):
    """Run ours and both references on ``inputs`` and apply the rule; returns ours.

    ``attn``: the attention options of ``call`` (flash_attn_func's keyword names), given to the
    references too."""
    attn = dict(attn or {})
    q, k, _ = to_qkv(*inputs)
    if dout is None:
        dout = randn(*q.shape, dtype=dtype)
    ours = run_ours(inputs, call, dout)
    ref = reference_attn(attn, q.shape, k.shape[1], ours.probs)
    truth = reference(inputs, to_qkv, dout, True, ref)
    lowp = reference(inputs, to_qkv, dout, False, ref)
    assert_result(ours, lowp, truth, names, dtype)
    if to_qkv is unpacked:
        assert_unreached_zero(ours, q.shape[1], k.shape[1], attn)
    return ours


def assert_agree(name, x, y, truth, lowp, dtype):
    """Two implementations' results agree within 2 x PyTorch's error + ulp."""
    err_lowp = max_err(lowp, truth)
    slack = ulp(truth.abs().max().item() if truth.numel() else 0.0, dtype)
    diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
    assert diff <= 2 * err_lowp + slack, (
        f"{name}: the two differ by {diff:.3e}; PyTorch's error is {err_lowp:.3e}")
