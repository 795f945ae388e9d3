"""The torch.library custom ops ``flash_attn::fwd`` / ``flash_attn::bwd`` (and
``flash_attn::dropout_mask``, for ``return_attn_probs``) and the extension loader.

The ops are the only way the frontend reaches ``flash_attn._C``: registering them with a schema,
a fake (meta) implementation and an autograd formula is what lets torch.compile, FakeTensor
tracing and ``torch.library.opcheck`` see through a call without running a kernel. Inputs arrive
validated and padded to a head dim multiple of 8; the implementations copy any tensor the kernels
cannot read in place (``kernel_layout``), allocate the outputs and have the extension write them.

``flash_attn._C`` is imported on first use, not at package import, so ``import flash_attn`` works
on a machine without the compiled extension (CPU CI, docs builds).
"""

import importlib
import math
import sys

import torch

from . import build_matrix   # standard library only: cheap at import time
from ._validate import call_features, normalize_window

_EXTENSION = "flash_attn._C"

NO_EXTENSION = (
    "flash_attn was installed without its CUDA kernels: the extension module flash_attn._C is "
    "missing (an install with FLASH_ATTN_SKIP_CUDA_BUILD=1 contains the Python package only). "
    "Build them on a machine with a CUDA build of torch and the CUDA toolkit (nvcc), from the "
    "source tree: `pip install --no-build-isolation .` (FLASH_ATTN_CUDA_ARCHS, e.g. '80;90', "
    "picks the GPUs to build for)."
)


def extension():
    """The compiled extension; RuntimeError saying how to build it when it is missing."""
    loaded = sys.modules.get(_EXTENSION)  # every call needs it: skip the import machinery
    if loaded is not None:
        return loaded
    try:
        return importlib.import_module(_EXTENSION)
    except ModuleNotFoundError as e:
        if e.name != _EXTENSION:
            raise
        raise RuntimeError(NO_EXTENSION) from None
    except ImportError as e:
        # Present but unloadable: usually built against another torch / CUDA; the loader's
        # message (an undefined symbol, a missing libcudart) is the clue, so keep it.
        raise RuntimeError(f"flash_attn._C is installed but failed to load: {e}. It must be "
                           f"rebuilt against the torch installed now ({torch.__version__}): "
                           f"`pip install --no-build-isolation .`") from e


# The kernels move rows in 16-byte vectors: 8 fp16 / bf16 elements.
_ALIGN = 8


def kernel_layout(t: torch.Tensor, align: int = _ALIGN) -> torch.Tensor:
    """``t`` itself when the kernels can read it (last dim contiguous, every other stride and the
    storage offset multiples of ``align`` elements: 16 bytes of a 16-bit type), else a
    contiguous copy. Strided views such as qkv[:, :, 0] pass through without a copy. Called
    inside the op implementations: dynamo cannot trace storage_offset(), and there the check
    costs nothing under torch.compile."""
    if t.is_contiguous() and t.shape[-1] % align == 0 and t.storage_offset() % align == 0:
        return t  # every stride a multiple of the last dim (the common case, checked cheaply)
    if t.stride(-1) != 1:
        return t.contiguous()
    aligned = t.storage_offset() % align == 0 and all(
        stride % align == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


# ---- private tuning overrides -----------------------------------------------------------------

def tuning_text(tuning) -> str:
    """The private ``_tuning`` mapping ({"fa3_narrow": 0, ...}) as the ops' ``tuning`` string:
    overrides of the launchers' automatic choices for tests and A/B benchmarks, not user
    interface. The extension knows the names (csrc/common/tuning.h) and refuses others."""
    if not tuning:
        return ""
    for name, value in tuning.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"_tuning: want str -> int entries, got {name!r}: {value!r}")
    return ",".join(f"{name}={value}" for name, value in sorted(tuning.items()))


# ---- forward ----------------------------------------------------------------------------------

@torch.library.custom_op(
    "flash_attn::fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, "
           "int window_right, float softcap, Tensor? alibi_slopes, float dropout_p, "
           "bool deterministic, str backend, str tuning=\"\") "
           "-> (Tensor out, Tensor lse, Tensor rng_state)")
def fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
        dropout_p, deterministic, backend, tuning=""):
    return run_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                   alibi_slopes, dropout_p, deterministic, backend, tuning)


def run_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
            dropout_p, deterministic, backend, tuning=""):
    """flash_attn::fwd's computation, called by the op and by the eager path (``attention``).
    ``tuning``: the private overrides of the kernels' automatic choices (``tuning_text``)."""
    # deterministic is a forward argument only so that setup_context can hand it to bwd.
    # rng_state: int64 [seed, offset] of the Philox stream the kernel drew the dropout mask
    # from, written by the kernel; zeros when nothing was drawn. The backward and
    # dropout_mask regenerate the mask from it.
    if q.numel() == 0 or k.shape[1] == 0:
        batch, seqlen_q, nheads, _ = q.shape
        out = q.new_zeros(q.shape)
        lse = q.new_full((batch, nheads, seqlen_q), math.inf, dtype=torch.float32)
        # No key at all: every row is empty, which the convention maps to out 0, lse +inf.
        return out, lse, q.new_zeros((2,), dtype=torch.int64)
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    # The extension allocates out, lse and rng_state (None): 2-4 us of host time there against
    # ~9 us here. It writes rng_state on every launch ([seed, offset], or zeros).
    out, lse, rng_state = extension().fwd(q, k, v, None, None, None, alibi_slopes,
                                          softmax_scale, causal, window_left, window_right,
                                          softcap, dropout_p, backend, tuning)
    return out, lse, rng_state


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              dropout_p, deterministic, backend, tuning=""):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            q.new_empty((2,), dtype=torch.int64))


# ---- backward ---------------------------------------------------------------------------------

@torch.library.custom_op(
    "flash_attn::bwd", mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           "Tensor rng_state, float softmax_scale, bool causal, int window_left, "
           "int window_right, float softcap, Tensor? alibi_slopes, float dropout_p, "
           "bool deterministic, str backend, str tuning=\"\") "
           "-> (Tensor dq, Tensor dk, Tensor dv)")
def bwd(dout, q, k, v, out, lse, rng_state, softmax_scale, causal, window_left, window_right,
        softcap, alibi_slopes, dropout_p, deterministic, backend, tuning=""):
    return run_bwd(dout, q, k, v, out, lse, rng_state, softmax_scale, causal, window_left,
                   window_right, softcap, alibi_slopes, dropout_p, deterministic, backend, tuning)


def run_bwd(dout, q, k, v, out, lse, rng_state, softmax_scale, causal, window_left, window_right,
            softcap, alibi_slopes, dropout_p, deterministic, backend, tuning=""):
    """flash_attn::bwd's computation, called by the op and by the eager path. ``backend`` is
    the family whose backward kernels run (build_matrix.backward_family)."""
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if dq.numel() == 0 or dk.numel() == 0:
        # Nothing attends (no query or no key): every gradient is zero.
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout, q, k, v, out = (kernel_layout(t) for t in (dout, q, k, v, out))
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    extension().bwd(dout, q, k, v, out, lse, rng_state, dq, dk, dv, alibi_slopes, softmax_scale,
                    causal, window_left, window_right, softcap, dropout_p, deterministic,
                    backend, tuning)
    return dq, dk, dv


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, rng_state, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, dropout_p, deterministic, backend, tuning=""):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---- autograd ---------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    ctx.num_inputs = len(inputs)
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
     dropout_p, deterministic, backend, *rest) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi_slopes)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.window_left = window_left
    ctx.window_right = window_right
    ctx.softcap = softcap
    ctx.dropout_p = dropout_p
    ctx.deterministic = deterministic
    ctx.backend = backend   # the forward's family; _backward_with maps it to its backward's
    ctx.tuning = rest[0] if rest else ""
    # The kernels have no gradient through the log-sum-exp (as in flash_attn 2.x): say so, rather
    # than let a loss on lse silently get a zero gradient. rng_state is bookkeeping.
    ctx.mark_non_differentiable(lse, rng_state)


def _backward_family(backend, q, k, seqlen_q, seqlen_k, causal, window_left, window_right,
                     softcap, alibi_slopes, dropout_p, deterministic, extra=frozenset()):
    """The family whose backward runs: the forward's own where its backward takes the call,
    else the one that computes its gradient on the same O and LSE (fa3's: fa2), as dispatch
    checked at the forward (build_matrix.backward_family, from the same features)."""
    # The op's causal / window as the frontend states them ((-1, 0) is causal, not local).
    causal, window = normalize_window(causal, (window_left, window_right), seqlen_k)
    features = call_features(causal, window, softcap, alibi_slopes is not None, dropout_p,
                             q.shape[-2], k.shape[-2], seqlen_q)
    return build_matrix.backward_family(backend, q.shape[-1], features | extra, deterministic)


def _backward_with(bwd_fn, ctx, dout):
    q, k, v, out, lse, rng_state, alibi_slopes = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd_fn(
        dout, q, k, v, out, lse, rng_state, ctx.softmax_scale, ctx.causal, ctx.window_left,
        ctx.window_right, ctx.softcap, alibi_slopes, ctx.dropout_p, ctx.deterministic,
        _backward_family(ctx.backend, q, k, q.shape[1], k.shape[1], ctx.causal,
                         ctx.window_left, ctx.window_right, ctx.softcap, alibi_slopes,
                         ctx.dropout_p, ctx.deterministic),
        ctx.tuning)
    # No gradient for the scalars, and none for alibi_slopes (as in flash_attn 2.x).
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


def _backward(ctx, dout, _dlse, _drng_state):
    return _backward_with(torch.ops.flash_attn.bwd, ctx, dout)


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- the eager path ---------------------------------------------------------------------------

class _Attention(torch.autograd.Function):
    """flash_attn::fwd with its autograd formula, for eager calls on plain tensors: the same
    computation (run_fwd / run_bwd) without the registered op's Python dispatch, which costs
    about 100 us of CPU per call (measured on an H100 host: 200 us per forward with grad, 20 us
    for SDPA), enough to leave the GPU idle between small kernels."""

    @staticmethod
    def forward(ctx, *inputs):
        output = run_fwd(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse, _drng_state):
        return _backward_with(run_bwd, ctx, dout)


def _needs_registered_op(tensors) -> bool:
    """Whether something must see through the call, so that the registered op runs rather
    than the direct path: torch.compile, fake or wrapped tensors, functorch transforms."""
    return (torch.compiler.is_compiling()
            or any(t is not None and type(t) is not torch.Tensor for t in tensors)
            or torch._C._are_functorch_transforms_active())


def attention(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              dropout_p, deterministic, backend, tuning=""):
    """(out, lse, rng_state) with autograd, as ``torch.ops.flash_attn.fwd``. The registered op
    runs whenever something must see through the call (torch.compile, fake or wrapped tensors,
    functorch transforms); plain eager calls take the direct path."""
    args = (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
            dropout_p, deterministic, backend, tuning)
    if _needs_registered_op((q, k, v)):
        return torch.ops.flash_attn.fwd(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(*args)
    return run_fwd(*args)


# ---- variable-length batches ------------------------------------------------------------------
# flash_attn::varlen_fwd / varlen_bwd: the ops above for q (total_q, h, d) and k / v
# (total_k, h_k, d) (or a paged cache with block_table), sequence b at cu_seqlens[b] of each;
# lse (h, total_q). Rows past a sequence's seqused_q are 0 in out and dq, +inf in lse.

_VARLEN_ARGS = ("Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, "
                "SymInt max_seqlen_q, SymInt max_seqlen_k, ")


@torch.library.custom_op(
    "flash_attn::varlen_fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, " + _VARLEN_ARGS + "Tensor? block_table, "
           "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
           "Tensor? alibi_slopes, float dropout_p, bool deterministic, str backend, "
           "str tuning=\"\") -> (Tensor out, Tensor lse, Tensor rng_state)")
def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
               max_seqlen_k, block_table, softmax_scale, causal, window_left, window_right,
               softcap, alibi_slopes, dropout_p, deterministic, backend, tuning=""):
    return run_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                          max_seqlen_q, max_seqlen_k, block_table, softmax_scale, causal,
                          window_left, window_right, softcap, alibi_slopes, dropout_p,
                          deterministic, backend, tuning)


def run_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                   max_seqlen_k, block_table, softmax_scale, causal, window_left, window_right,
                   softcap, alibi_slopes, dropout_p, deterministic, backend, tuning=""):
    """flash_attn::varlen_fwd's computation (the op's and the eager path's)."""
    if q.shape[0] == 0 or k.numel() == 0:
        # No query row, or no key at all: every row is empty (out 0, lse +inf), nothing drawn.
        return (q.new_zeros(q.shape),
                q.new_full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float32),
                q.new_zeros((2,), dtype=torch.int64))
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    index = [None if t is None else t.contiguous()
             for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table)]
    return extension().varlen_fwd(q, k, v, *index[:4], max_seqlen_q, max_seqlen_k, index[4],
                                  None, None, None, alibi_slopes, softmax_scale, causal,
                                  window_left, window_right, softcap, dropout_p, backend, tuning)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, block_table, softmax_scale, causal, window_left, window_right,
                     softcap, alibi_slopes, dropout_p, deterministic, backend, tuning=""):
    total_q, nheads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((nheads, total_q), dtype=torch.float32),
            q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op(
    "flash_attn::varlen_bwd", mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           "Tensor rng_state, " + _VARLEN_ARGS + "float softmax_scale, bool causal, "
           "int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
           "float dropout_p, bool deterministic, str backend, str tuning=\"\") "
           "-> (Tensor dq, Tensor dk, Tensor dv)")
def varlen_bwd(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_q,
               seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
               window_right, softcap, alibi_slopes, dropout_p, deterministic, backend,
               tuning=""):
    return run_varlen_bwd(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k,
                          seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                          causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                          deterministic, backend, tuning)


def run_varlen_bwd(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_q,
                   seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                   window_right, softcap, alibi_slopes, dropout_p, deterministic, backend,
                   tuning=""):
    """flash_attn::varlen_bwd's computation; ``backend`` is the family of the backward."""
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout, q, k, v, out = (kernel_layout(t) for t in (dout, q, k, v, out))
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    index = [None if t is None else t.contiguous()
             for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)]
    extension().varlen_bwd(dout, q, k, v, out, lse, rng_state, *index, max_seqlen_q,
                           max_seqlen_k, dq, dk, dv, alibi_slopes, softmax_scale, causal,
                           window_left, window_right, softcap, dropout_p, deterministic,
                           backend, tuning)
    return dq, dk, dv


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, seqused_q,
                     seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                     window_right, softcap, alibi_slopes, dropout_p, deterministic, backend,
                     tuning=""):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    ctx.num_inputs = len(inputs)
    q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, block_table, *rest = inputs
    (softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
     deterministic, backend, *tuning) = rest
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_q, cu_k, used_q, used_k,
                          alibi_slopes)
    ctx.scalars = (max_q, max_k, softmax_scale, causal, window_left, window_right, softcap)
    ctx.dropout_p, ctx.deterministic, ctx.backend = dropout_p, deterministic, backend
    ctx.tuning = tuning[0] if tuning else ""
    ctx.paged = block_table is not None
    ctx.mark_non_differentiable(lse, rng_state)


def _varlen_backward_with(bwd_fn, ctx, dout):
    if ctx.paged:
        # Validation refuses a paged call that needs a gradient; this is the op's own guard.
        raise RuntimeError("flash_attn: a paged K/V cache (block_table) has no backward")
    q, k, v, out, lse, rng_state, cu_q, cu_k, used_q, used_k, alibi_slopes = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    max_q, max_k, softmax_scale, causal, window_left, window_right, softcap = ctx.scalars
    dq, dk, dv = bwd_fn(dout, q, k, v, out, lse, rng_state, cu_q, cu_k, used_q, used_k, max_q,
                        max_k, softmax_scale, causal, window_left, window_right, softcap,
                        alibi_slopes, ctx.dropout_p, ctx.deterministic,
                        _backward_family(ctx.backend, q, k, max_q, max_k, causal,
                                         window_left, window_right, softcap, alibi_slopes,
                                         ctx.dropout_p, ctx.deterministic,
                                         frozenset({"varlen"})),
                        ctx.tuning)
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


def _varlen_backward(ctx, dout, _dlse, _drng_state):
    return _varlen_backward_with(torch.ops.flash_attn.varlen_bwd, ctx, dout)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class _VarlenAttention(torch.autograd.Function):
    """flash_attn::varlen_fwd with its autograd formula for plain eager calls (``_Attention``'s
    reason: the registered op's Python dispatch costs ~100 us of CPU per call)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = run_varlen_fwd(*inputs)
        _varlen_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse, _drng_state):
        return _varlen_backward_with(run_varlen_bwd, ctx, dout)


def varlen_attention(*args):
    """(out, lse, rng_state) with autograd, as ``torch.ops.flash_attn.varlen_fwd(*args)``; the
    registered op where something must see through the call, as ``attention``."""
    q, k, v = args[:3]
    if _needs_registered_op((q, k, v)):
        return torch.ops.flash_attn.varlen_fwd(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenAttention.apply(*args)
    return run_varlen_fwd(*args)


# ---- the KV cache ------------------------------------------------------------------------------
# flash_attn::kvcache_fwd: reference.attention_kvcache_ref's semantics, the new k / v written
# into k_cache / v_cache in place (declared as mutations, so torch.compile and CUDA graphs see
# them). cache_seqlens is a tensor, or None with cache_seqlen the int the caller gave (-1: the
# cache is full), which keeps a tensor allocation off a decode step's host path. No autograd.

@torch.library.custom_op(
    "flash_attn::kvcache_fwd", mutates_args=("k_cache", "v_cache"),
    schema="(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
           "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, SymInt cache_seqlen, "
           "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, "
           "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
           "bool rotary_interleaved, Tensor? alibi_slopes, int num_splits, str backend, "
           "str tuning=\"\") -> (Tensor out, Tensor lse)")
def kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left,
                window_right, softcap, rotary_interleaved, alibi_slopes, num_splits, backend,
                tuning=""):
    return run_kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                           cache_seqlen, cache_batch_idx, cache_leftpad, block_table,
                           softmax_scale, causal, window_left, window_right, softcap,
                           rotary_interleaved, alibi_slopes, num_splits, backend, tuning)


def run_kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_seqlen, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                    causal, window_left, window_right, softcap, rotary_interleaved,
                    alibi_slopes, num_splits, backend, tuning=""):
    """flash_attn::kvcache_fwd's computation (the op's and the eager path's). The caches are
    written in place, so they are never copied: the extension takes their strides as given,
    which must suit its 16-byte vector loads (checked here, where storage_offset() is usable)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if kernel_layout(t) is not t:
            raise ValueError(f"{name} must start and step in 16-byte units (strides and storage "
                             f"offset multiples of {_ALIGN} elements, last dim contiguous) to be "
                             f"updated in place; got strides {t.stride()}, storage offset "
                             f"{t.storage_offset()}")
    q = kernel_layout(q)
    k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, \
        alibi_slopes = (None if t is None else t.contiguous() for t in (
            k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes))
    return extension().kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                   cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad,
                                   block_table, alibi_slopes, softmax_scale, causal,
                                   window_left, window_right, softcap, rotary_interleaved,
                                   num_splits, backend, tuning)


@kvcache_fwd.register_fake
def _kvcache_fwd_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                      cache_seqlen, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                      causal, window_left, window_right, softcap, rotary_interleaved,
                      alibi_slopes, num_splits, backend, tuning=""):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def kvcache_attention(*args):
    """(out, lse) as ``torch.ops.flash_attn.kvcache_fwd(*args)``, which runs where something
    must see through the call (``attention``'s rule); plain eager calls skip its dispatch."""
    if _needs_registered_op(args[:8] + args[9:12] + args[18:19]):  # the Tensor? arguments
        return torch.ops.flash_attn.kvcache_fwd(*args)
    return run_kvcache_fwd(*args)


# ---- FP8 forward ------------------------------------------------------------------------------

@torch.library.custom_op(
    "flash_attn::fp8_fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? q_descale, Tensor? k_descale, "
           "Tensor? v_descale, float softmax_scale, bool causal, int window_left, "
           "int window_right, str backend, str tuning=\"\") -> (Tensor out, Tensor lse)")
def fp8_fwd(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left,
            window_right, backend, tuning=""):
    return run_fp8_fwd(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
                       window_left, window_right, backend, tuning)


def run_fp8_fwd(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left,
                window_right, backend, tuning=""):
    """flash_attn::fp8_fwd's computation: e4m3 q / k / v (rows of 16-byte units), float32
    (batch, nheads_k) descales or None; out bf16, lse float32 (batch, nheads, seqlen_q)."""
    if q.numel() == 0 or k.shape[1] == 0:
        batch, seqlen_q, nheads, _ = q.shape
        out = q.new_zeros(q.shape, dtype=torch.bfloat16)
        lse = q.new_full((batch, nheads, seqlen_q), math.inf, dtype=torch.float32)
        return out, lse
    q, k, v = (kernel_layout(t, 16) for t in (q, k, v))
    return extension().fp8_fwd(q, k, v, q_descale, k_descale, v_descale, None, None,
                               softmax_scale, causal, window_left, window_right, backend, tuning)


@fp8_fwd.register_fake
def _fp8_fwd_fake(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left,
                  window_right, backend, tuning=""):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty(q.shape, dtype=torch.bfloat16),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))


def fp8_attention(*args):
    """(out, lse) as ``torch.ops.flash_attn.fp8_fwd(*args)`` where something must see through
    the call (``attention``'s rule); plain eager calls skip its dispatch."""
    if _needs_registered_op(args[:6]):
        return torch.ops.flash_attn.fp8_fwd(*args)
    return run_fp8_fwd(*args)


@torch.library.custom_op(
    "flash_attn::fp8_quantize", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? signs) -> "
           "(Tensor q8, Tensor k8, Tensor v8, Tensor descales)")
def fp8_quantize(q, k, v, signs):
    return run_fp8_quantize(q, k, v, signs)


def run_fp8_quantize(q, k, v, signs):
    """flash_attn::fp8_quantize's computation (csrc/common/fp8_quantize.h): e4m3 q8 / k8 / v8
    in q / k / v's shapes, contiguous; descales float32 (3, batch, nheads_k)."""
    q, k, v = (kernel_layout(t, 16 // t.element_size()) for t in (q, k, v))
    return extension().fp8_quantize(q, k, v, signs)


@fp8_quantize.register_fake
def _fp8_quantize_fake(q, k, v, signs):
    e4m3 = torch.float8_e4m3fn
    return (q.new_empty(q.shape, dtype=e4m3), k.new_empty(k.shape, dtype=e4m3),
            v.new_empty(v.shape, dtype=e4m3),
            q.new_empty((3, q.shape[0], k.shape[2]), dtype=torch.float32))


def fp8_quantize_call(q, k, v, signs):
    """``torch.ops.flash_attn.fp8_quantize`` where something must see through the call,
    else its computation directly."""
    if _needs_registered_op((q, k, v, signs)):
        return torch.ops.flash_attn.fp8_quantize(q, k, v, signs)
    return run_fp8_quantize(q, k, v, signs)


# ---- the dropout mask a forward used (for return_attn_probs) ---------------------------------

@torch.library.custom_op(
    "flash_attn::dropout_mask", mutates_args=(),
    schema="(Tensor rng_state, int batch, int nheads, int seqlen_q, int seqlen_k, "
           "float dropout_p) -> Tensor")
def dropout_mask(rng_state, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """(batch, nheads, seqlen_q, seqlen_k) bool, True where the forward that returned
    ``rng_state`` kept the probability: the kernels' Philox draws, recomputed on the GPU."""
    return extension().dropout_mask(rng_state, batch, nheads, seqlen_q, seqlen_k, dropout_p)


@dropout_mask.register_fake
def _dropout_mask_fake(rng_state, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    return rng_state.new_empty((batch, nheads, seqlen_q, seqlen_k), dtype=torch.bool)
