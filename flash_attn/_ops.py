"""The torch.library custom ops ``flash_attn::fwd`` / ``flash_attn::bwd`` and the extension loader.

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

import torch

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


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernels can read it (last dim contiguous, every other stride and the
    storage offset 16-byte aligned), else a contiguous copy. Strided views such as qkv[:, :, 0]
    pass through without a copy. Called inside the op implementations: dynamo cannot trace
    storage_offset(), and there the check costs nothing under torch.compile."""
    if t.stride(-1) != 1:
        return t.contiguous()
    aligned = t.storage_offset() % _ALIGN == 0 and all(
        stride % _ALIGN == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


# ---- forward ----------------------------------------------------------------------------------

@torch.library.custom_op(
    "flash_attn::fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic, "
           "str backend) -> (Tensor out, Tensor lse)")
def fwd(q, k, v, softmax_scale, causal, deterministic, backend):
    # deterministic is a forward argument only so that setup_context can hand it to bwd.
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:
        # No key at all: every row is empty, which the convention maps to out 0, lse +inf.
        return out.zero_(), lse.fill_(math.inf)
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    extension().fwd(q, k, v, out, lse, softmax_scale, causal, backend)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic, backend):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


# ---- backward ---------------------------------------------------------------------------------

@torch.library.custom_op(
    "flash_attn::bwd", mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           "float softmax_scale, bool causal, bool deterministic, str backend) "
           "-> (Tensor dq, Tensor dk, Tensor dv)")
def bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, backend):
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if dq.numel() == 0 or dk.numel() == 0:
        # Nothing attends (no query or no key): every gradient is zero.
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout, q, k, v, out = (kernel_layout(t) for t in (dout, q, k, v, out))
    extension().bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic,
                    backend)
    return dq, dk, dv


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---- autograd ---------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    ctx.backend = backend
    # The kernels have no gradient through the log-sum-exp (as in flash_attn 2.x): say so, rather
    # than let a loss on lse silently get a zero gradient.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.flash_attn.bwd(
        dout, q, k, v, out, lse,
        ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.backend)
    return dq, dk, dv, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
