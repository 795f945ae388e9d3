"""FP8 attention on Hopper: ``flash_attn_func`` with ``torch.float8_e4m3fn`` q, k, v runs fa3's
e4m3 forward (sm90), with per-(batch, KV head) descales and a bf16 output; ``quantize`` makes
such inputs from 16-bit ones.

The real Q is ``q.float() * q_descale[b, h_k]`` (likewise K and V): ``q_descale``, ``k_descale``,
``v_descale`` are positive float32 ``(batch, nheads_k)`` tensors (anything that broadcasts to
that shape; None: 1). Forward only: an FP8 input that requires grad raises. So far the kernels
take dense calls with causal / local masks and GQA, head dims that are multiples of 16 up to
256; softcap, ALiBi, dropout and FP8 inputs to the variable-length and KV-cache entry points
raise NotImplementedError.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _dispatch, _ops, _validate, build_matrix

FP8_DTYPE = torch.float8_e4m3fn
# The kernels move rows in 16-byte vectors (TMA): 16 e4m3 elements.
FP8_ALIGN = 16


def is_fp8(*tensors) -> bool:
    """Whether any of ``tensors`` is an FP8 tensor (the call takes the FP8 path)."""
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn,
                                                          torch.float8_e5m2)
               for t in tensors)


def _check_descale(name: str, d, batch: int, nheads_k: int, device: torch.device):
    if d is None:
        return
    _validate.check_is_tensor(name, d)
    if d.dtype != torch.float32:
        raise TypeError(f"{name} must be torch.float32, got {d.dtype}")
    if d.device != device:
        raise ValueError(f"{name} is on {d.device} but q is on {device}")
    try:
        fits = torch.broadcast_shapes(tuple(d.shape), (batch, nheads_k)) == (batch, nheads_k)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} must be (batch, nheads_k) = ({batch}, {nheads_k}) or broadcast "
                         f"to it, got shape {tuple(d.shape)}")


def check_call(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, alibi_slopes=None, q_descale=None,
               k_descale=None, v_descale=None, out_dtype=None, names=("q", "k", "v")):
    """Every check of an FP8 call (flash_attn_func's arguments); the validated Call."""
    for name, t in zip(names, (q, k, v)):
        _validate.check_is_tensor(name, t)
    _validate.check_device(names[0], q.device)
    _validate.check_same_device(names, [t.device for t in (q, k, v)])
    for name, t in zip(names, (q, k, v)):
        if t.dtype != FP8_DTYPE:
            given = ", ".join(f"{n}: {x.dtype}" for n, x in zip(names, (q, k, v)))
            raise TypeError(f"{name} has dtype {t.dtype}; an FP8 call takes torch.float8_e4m3fn "
                            f"q, k and v ({given})")
    shapes = _validate.check_shapes(q.shape, k.shape, v.shape, names)
    if shapes.head_dim % FP8_ALIGN != 0:
        raise ValueError(f"{names[0]} has head dim {shapes.head_dim}; FP8 needs a multiple of "
                         f"{FP8_ALIGN} (16-byte rows) up to {_validate.MAX_HEAD_DIM}")
    if out_dtype not in (None, torch.bfloat16):
        raise NotImplementedError(f"out_dtype={out_dtype}: the FP8 forward writes "
                                  f"torch.bfloat16 only so far")
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale)):
        _check_descale(name, d, shapes.batch, shapes.nheads_k, q.device)
    call = _validate.call_options(shapes, "e4m3", q.device, dropout_p=dropout_p,
                                  softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes)
    if not call.softmax_scale > 0:
        raise NotImplementedError(f"softmax_scale={call.softmax_scale}: the FP8 forward takes a "
                                  f"positive scale (and positive descales) only")
    unsupported = sorted(call.features & {"softcap", "alibi", "dropout"})
    if unsupported:
        raise NotImplementedError(f"the FP8 forward does not support {', '.join(unsupported)} "
                                  f"yet (supported: causal, local windows, GQA)")
    return call


@torch.compiler.assume_constant_result
def _decide(arch: int, hdim: int, requested: Optional[str]) -> Tuple[str, str]:
    """("", "") if fa3's e4m3 forward runs a head dim ``hdim`` call on ``arch``, else (exception
    name, message): returned, not raised, so that dynamo folds it into a constant (as
    _dispatch._decide)."""
    if requested not in (None, "fa3"):
        return ("NotImplementedError", f"backend {requested!r} (backend= or "
                f"{_dispatch.ENV_VAR}) has no FP8 kernels; FP8 inputs run on 'fa3' (sm90)")
    if arch != 90:
        return ("RuntimeError", f"this GPU is sm{arch}; the FP8 forward runs on sm90 (Hopper) "
                f"only")
    padded = -(-hdim // 8) * 8
    if not any(c.family == "fa3" and c.direction == "fwd" and c.dtype == "e4m3" and
               c.hdim >= padded for c in _dispatch.built_configs()):
        return ("NotImplementedError", f"this build has no fa3 e4m3 forward kernel for head "
                f"dim {hdim}; FP8 kernels exist for head dims "
                f"{build_matrix.FAMILIES['fa3'].fp8_hdims} (build with FLASH_ATTN_DTYPES "
                f"including e4m3)")
    return ("", "")


_ERRORS = {"RuntimeError": RuntimeError, "NotImplementedError": NotImplementedError}


def select(call, device, backend) -> str:
    """fa3, the one family with FP8 kernels, if this build and GPU run the call."""
    error, message = _decide(_dispatch.device_arch(device), call.shapes.head_dim,
                             _dispatch.requested_backend(backend))
    if error:
        raise _ERRORS[error](message)
    return "fa3"


def refuse(entry_point: str, *tensors) -> None:
    """NotImplementedError for FP8 inputs to an entry point without FP8 kernels yet."""
    if is_fp8(*tensors):
        raise NotImplementedError(f"{entry_point}: FP8 inputs run on flash_attn_func only so far "
                                  f"(dense calls); this entry point takes float16 / bfloat16")


def attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
              return_attn_probs, backend, names, tuning, q_descale, k_descale, v_descale,
              out_dtype):
    """flash_attn_func's path for FP8 inputs (flash_attn_interface._attention)."""
    call = check_call(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                      causal=causal, window_size=window_size, softcap=softcap,
                      alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale,
                      v_descale=v_descale, out_dtype=out_dtype, names=names)
    for name, t in zip(names, (q, k, v)):
        if t.requires_grad:
            raise RuntimeError(f"{name} requires grad; the FP8 forward has no backward (FP8 "
                               f"attention is for inference)")
    family = select(call, q.device, backend)
    s = call.shapes
    descales = tuple(None if d is None else d.expand(s.batch, s.nheads_k).contiguous()
                     for d in (q_descale, k_descale, v_descale))
    window_left, window_right = call.window
    # softmax_scale > 0: validated (resolve_softmax_scale), as the kernels need.
    out, lse = _ops.fp8_attention(q, k, v, *descales, call.softmax_scale, call.causal,
                                  window_left, window_right, family, _ops.tuning_text(tuning))
    return (out, lse, None) if return_attn_probs else out


# ---- quantize ---------------------------------------------------------------------------------

E4M3_MAX = 448.0


def _hadamard(n: int, device, dtype) -> torch.Tensor:
    """The n x n Hadamard matrix (Sylvester; n a power of two) divided by sqrt(n): orthogonal."""
    h = torch.ones(1, 1, device=device, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def rotation(head_dim: int, device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A random orthogonal (head_dim, head_dim) float32 matrix of the FA3 paper's incoherent
    processing: random signs times a Hadamard matrix, block-diagonal in blocks of the largest
    power of two that divides head_dim (all of it at 64, 128, 256). q R (R^T k^T) = q k^T, and
    the rotation spreads an outlier coordinate over the block."""
    block = head_dim & -head_dim
    signs = _signs(head_dim, device, generator)
    h = _hadamard(block, device, torch.float32)
    return torch.block_diag(*([h] * (head_dim // block))) * signs[:, None]


def _signs(head_dim: int, device, generator: Optional[torch.Generator]) -> torch.Tensor:
    """rotation's random signs, float32 (head_dim,) of +-1 on ``device``, drawn by
    ``generator`` on its device, or by torch's global generator of ``device`` (on a GPU, no
    host synchronisation: a CPU draw copied over would wait for the GPU to drain its queue)."""
    draw_on = generator.device if generator is not None else torch.device(device)
    signs = torch.randint(0, 2, (head_dim,), generator=generator, device=draw_on)
    return signs.to(device, non_blocking=True).float() * 2 - 1


def _per_kv_head_scale(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """amax / 448 per (batch, KV head) of x (batch, seqlen, heads, head_dim), float32."""
    b, s, h, d = x.shape
    amax = x.reshape(b, s, heads_k, h // heads_k, d).abs().amax(dim=(1, 3, 4)).float()
    return (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, hadamard: bool = True,
             generator: Optional[torch.Generator] = None):
    """(q8, k8, v8, descales): q, k, v (batch, seqlen, heads, head_dim), fp16 / bf16 / fp32, as
    float8_e4m3fn inputs of ``flash_attn_func(q8, k8, v8, **descales)``, the FA3 paper's way:
    with ``hadamard`` q and k are first rotated by the same random orthogonal matrix
    (``rotation``; q k^T is unchanged), then each of q, k, v is scaled per (batch, KV head) to
    e4m3's range (amax / 448). ``descales``: {"q_descale", "k_descale", "v_descale"}, float32
    (batch, heads_k). ``generator``: the random signs' (default: torch's global one).

    On CUDA one kernel does it (csrc/common/fp8_quantize.h: two passes over the inputs, head
    dims that are multiples of 16 up to 256, the FP8 forward's); on the CPU, PyTorch (a
    rotation GEMM, an amax and a scaled cast per tensor), the same computation."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.check_is_tensor(name, t)
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"quantize: {name} has dtype {t.dtype}; takes float16, bfloat16 or "
                            f"float32")
    shapes = _validate.check_shapes(q.shape, k.shape, v.shape)
    if not q.is_cuda:
        return _quantize_torch(q, k, v, shapes.nheads_k, hadamard, generator)
    _validate.check_same_device(("q", "k", "v"), [t.device for t in (q, k, v)])
    if shapes.head_dim % FP8_ALIGN or shapes.head_dim > _validate.MAX_HEAD_DIM:
        raise ValueError(f"quantize: head_dim {shapes.head_dim} on CUDA; takes multiples of "
                         f"{FP8_ALIGN} up to {_validate.MAX_HEAD_DIM} (the head dims of the FP8 "
                         f"forward)")
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    signs = _signs(shapes.head_dim, q.device, generator) if hadamard else None
    q8, k8, v8, descales = _ops.fp8_quantize_call(q, k, v, signs)
    return q8, k8, v8, {"q_descale": descales[0], "k_descale": descales[1],
                        "v_descale": descales[2]}


def _quantize_torch(q, k, v, heads_k: int, hadamard: bool,
                    generator: Optional[torch.Generator]):
    """quantize in PyTorch: the CPU path, and the GPU tests' reference for the kernel."""
    if hadamard:  # in fp32: R rounded to 16 bits would not be orthogonal
        r = rotation(q.shape[-1], q.device, generator)
        q, k = q.float() @ r, k.float() @ r
    out, descales = [], {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        scale = _per_kv_head_scale(t, heads_k)
        b, s, h, d = t.shape
        per_head = scale.repeat_interleave(h // heads_k, dim=1)[:, None, :, None]
        out.append((t.float() / per_head).to(FP8_DTYPE))
        descales[f"{name}_descale"] = scale
    return out[0], out[1], out[2], descales
