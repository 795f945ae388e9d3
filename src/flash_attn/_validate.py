"""Every argument check of the public functions, run once before any launch.

Each check raises a Python exception whose message names the argument, what was given and what
is supported:

- TypeError: not a tensor, or a dtype / Python type the API never accepts;
- ValueError: a value or shape outside the API (wrong device, ndim, mismatched sizes, ...);
- NotImplementedError: a valid call this build has no kernel for (raised by ``_dispatch``);
- RuntimeError: the machine cannot run any kernel (GPU too old, extension not built).

The checks are pure functions of plain values (shapes, dtypes, devices, numbers) so they are unit
tested without a GPU; ``validate_call`` feeds them from the tensors. They look only at metadata,
never at tensor values, so ``torch.compile(fullgraph=True)`` traces them without a graph break.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from . import build_matrix

# The kernels exist for these dtypes only; the names are build_matrix's.
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# flash_attn 2.x's limit; a family may stop earlier (``_dispatch`` says which one runs it).
MAX_HEAD_DIM = 256
# The oldest GPU any family runs on (Turing's tensor-core MMA).
MIN_ARCH = min(f.min_arch for f in build_matrix.FAMILIES.values())
# Where the kernels run. Only tests change it, to drive the whole frontend on CPU tensors with a
# pure-PyTorch stand-in for ``flash_attn._C`` (tests/conftest.py).
KERNEL_DEVICE_TYPE = "cuda"

FEATURES = ("causal", "gqa", "local", "softcap", "alibi", "dropout", "varlen", "paged_kv",
            "paged_kv_unaligned", "kvcache", "decode", "short_q")


class Shapes(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int


class Call(NamedTuple):
    """A validated call: what dispatch and the op need, with 2.x's window / causal rules applied.
    A variable-length call's shapes hold its number of sequences and max_seqlen_q / _k."""

    shapes: Shapes
    dtype: str                   # "fp16" | "bf16"
    softmax_scale: float
    causal: bool
    window: Tuple[int, int]      # (-1, -1) unless the call is local
    features: frozenset          # subset of FEATURES


# ---- tensors ----------------------------------------------------------------------------------

def check_is_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_device(name: str, device: torch.device) -> None:
    if device.type != KERNEL_DEVICE_TYPE:
        raise ValueError(f"{name} must be on a CUDA device, got {device}; flash_attn kernels run "
                         f"on NVIDIA GPUs only (move the tensors with .cuda())")


def check_same_device(names: Sequence[str], devices: Sequence[torch.device]) -> None:
    for name, device in zip(names[1:], devices[1:]):
        if device != devices[0]:
            raise ValueError(f"{names[0]} and {name} must be on the same device, got "
                             f"{devices[0]} and {device}")


def dtype_name(name: str, dtype: torch.dtype) -> str:
    """The build-matrix name of a supported dtype ('fp16' / 'bf16')."""
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"{name} has dtype {dtype}; supported: torch.float16, torch.bfloat16 "
                        f"(cast with .half() / .bfloat16())")
    return DTYPE_NAMES[dtype]


def check_same_dtype(names: Sequence[str], dtypes: Sequence[torch.dtype]) -> None:
    for name, dtype in zip(names[1:], dtypes[1:]):
        if dtype != dtypes[0]:
            raise TypeError(f"{names[0]} and {name} must have the same dtype, got {dtypes[0]} "
                            f"and {dtype}")


def check_ndim(name: str, shape: Sequence[int], layout: str) -> None:
    """``layout`` spells the expected dims, e.g. '(batch, seqlen, nheads, headdim)'."""
    ndim = layout.count(",") + 1
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(shape)}")


def check_packed_shape(name: str, shape: Sequence[int], npacked: int, layout: str) -> None:
    """qkv (b, s, 3, h, d) / kv (b, s, 2, hk, d): the packing dim must hold exactly npacked."""
    check_ndim(name, shape, layout)
    if shape[2] != npacked:
        raise ValueError(f"{name} must have shape {layout}, with {npacked} at dim 2, got shape "
                         f"{tuple(shape)}")


def check_shapes(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int],
                 names: Sequence[str] = ("q", "k", "v")) -> Shapes:
    nq, nk, nv = names
    check_ndim(nq, q_shape, "(batch, seqlen_q, nheads, headdim)")
    check_ndim(nk, k_shape, "(batch, seqlen_k, nheads_k, headdim)")
    check_ndim(nv, v_shape, "(batch, seqlen_k, nheads_k, headdim)")
    batch, seqlen_q, nheads, head_dim = q_shape
    _, seqlen_k, nheads_k, _ = k_shape
    for name, shape in ((nk, k_shape), (nv, v_shape)):
        if shape[0] != batch:
            raise ValueError(f"{name} has batch size {shape[0]} but {nq} has {batch}; they must "
                             f"match")
    if v_shape[1] != seqlen_k:
        raise ValueError(f"{nv} has seqlen {v_shape[1]} but {nk} has {seqlen_k}; they must match")
    if v_shape[2] != nheads_k:
        raise ValueError(f"{nv} has {v_shape[2]} heads but {nk} has {nheads_k}; they must match")
    for name, shape in ((nk, k_shape), (nv, v_shape)):
        if shape[3] != head_dim:
            raise ValueError(f"{name} has head dim {shape[3]} but {nq} has {head_dim}; this "
                             f"build needs the same head dim for q, k and v")
    if batch < 1:
        raise ValueError(f"{nq} has batch size {batch}; it must be at least 1")
    if nheads < 1 or nheads_k < 1:
        raise ValueError(f"nheads ({nq}: {nheads}) and nheads_k ({nk}: {nheads_k}) must be at "
                         f"least 1")
    if nheads % nheads_k != 0:
        raise ValueError(f"{nq} has {nheads} heads, which is not a multiple of the {nheads_k} "
                         f"heads of {nk} / {nv} (grouped-query attention needs nheads % "
                         f"nheads_k == 0)")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{nq} has head dim {head_dim}; supported: 1 to {MAX_HEAD_DIM}")
    return Shapes(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)


# ---- options ----------------------------------------------------------------------------------

def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_dropout(dropout_p) -> None:
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale, defaulting to 1 / sqrt(head dim) of the caller's (unpadded) head dim."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not _is_real(softmax_scale):
        raise TypeError(f"softmax_scale must be a float or None, got "
                        f"{type(softmax_scale).__name__}")
    # Any finite float, as in flash_attn 2.x (0 or a negative scale is odd but well defined).
    # Comparisons, not math.isfinite: they also trace when torch.compile makes the float
    # symbolic. NaN fails both.
    if not -math.inf < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be a finite number (or None for "
                         f"1/sqrt(headdim)), got {softmax_scale}")
    return softmax_scale * 1.0 if isinstance(softmax_scale, int) else softmax_scale


def check_window(window_size) -> Tuple[int, int]:
    ok = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size))
    if not ok or window_size[0] < -1 or window_size[1] < -1:
        raise ValueError(f"window_size must be a pair of ints >= -1 (left, right), -1 meaning "
                         f"unlimited, got {window_size!r}")
    return (window_size[0], window_size[1])


def check_softcap(softcap) -> None:
    if not _is_real(softcap):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not 0.0 <= softcap < math.inf:
        raise ValueError(f"softcap must be 0 (off) or a finite positive number, got {softcap}")


def check_alibi(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                batch: int, nheads: int, q_device: torch.device) -> None:
    if tuple(shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) "
                         f"= ({batch}, {nheads}), got {tuple(shape)}")
    if dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be torch.float32, got {dtype}")
    if device != q_device:
        raise ValueError(f"alibi_slopes must be on the device of q ({q_device}), got {device}")


def check_arch(arch: int, device) -> None:
    if arch < MIN_ARCH:
        raise RuntimeError(f"{device} is sm{arch} (compute capability {arch // 10}.{arch % 10}); "
                           f"flash_attn needs compute capability {MIN_ARCH // 10}.{MIN_ARCH % 10} "
                           f"(Turing) or newer")


# ---- semantics --------------------------------------------------------------------------------

def normalize_window(causal: bool, window: Tuple[int, int],
                     seqlen_k: int) -> Tuple[bool, Tuple[int, int]]:
    """flash_attn 2.x's rules: causal forces right = 0; a side >= seqlen_k is unlimited; and
    (left=-1, right=0) is plain causal. Returns (causal, window), window (-1, -1) unless local."""
    left, right = window
    if causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if left < 0 and right == 0:
        return True, (-1, -1)
    return False, (left, right)


def call_features(causal: bool, window: Tuple[int, int], softcap, has_alibi: bool, dropout_p,
                  nheads: int, nheads_k: int, seqlen_q: int) -> frozenset:
    """What a call needs from a family beyond plain attention, in build_matrix's feature names.
    ``seqlen_q``: a batch's longest query sequence (max_seqlen_q of a variable-length one)."""
    used = (
        ("causal", causal),
        ("gqa", nheads != nheads_k),
        ("short_q", seqlen_q * (nheads // nheads_k) < build_matrix.SHORT_Q_ROWS),
        ("local", window != (-1, -1)),
        ("softcap", softcap > 0),
        ("alibi", has_alibi),
        ("dropout", dropout_p > 0),
    )
    return frozenset(name for name, on in used if on)


# ---- the tensor entry point -------------------------------------------------------------------

# Calls that passed every check, by what the checks read of their arguments (``_metadata``):
# a training or decode loop repeats the same few calls, and the checks were a third to a half
# of the frontend's host time. Bounded, since an int cache_seqlens makes each decode step a new
# entry. Not under torch.compile, which traces the checks once anyway.
_VALID: dict = {}
_VALID_MAX = 512


def _metadata(t):
    """What the checks read of an argument: a tensor's type, shape, strides, dtype and device
    (never its values), or the value with its type (True and 1 are equal keys otherwise, and
    the checks refuse a bool where they want an int)."""
    if isinstance(t, torch.Tensor):
        return type(t), t.shape, t.stride(), t.dtype, t.device
    return type(t), t


def _remembered(check, *args, **kwargs) -> Call:
    """check(*args, **kwargs), or the result of an earlier call with the same metadata."""
    if torch.compiler.is_compiling():
        return check(*args, **kwargs)
    try:
        key = (check, KERNEL_DEVICE_TYPE, tuple(map(_metadata, args)),
               tuple((name, _metadata(value)) for name, value in kwargs.items()))
        call = _VALID.get(key)
    except TypeError:  # an unhashable argument (a list window_size, ...): checked every time
        return check(*args, **kwargs)
    if call is None:
        call = check(*args, **kwargs)
        if len(_VALID) >= _VALID_MAX:
            _VALID.clear()
        _VALID[key] = call
    return call


def validate_call(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes: Optional[torch.Tensor] = None,
                  names: Sequence[str] = ("q", "k", "v")) -> Call:
    """All checks of one attention call, from its tensors (remembered, see ``_remembered``).
    Layout (stride) problems are not errors: the frontend copies such tensors into the layout
    the kernels read."""
    return _remembered(_check_call, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                       causal=causal, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, names=names)


def _check_call(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, names) -> Call:
    tensors = (q, k, v)
    for name, t in zip(names, tensors):
        check_is_tensor(name, t)
    check_device(names[0], q.device)
    check_same_device(names, [t.device for t in tensors])
    dtype = dtype_name(names[0], q.dtype)
    check_same_dtype(names, [t.dtype for t in tensors])
    shapes = check_shapes(q.shape, k.shape, v.shape, names)

    return call_options(shapes, dtype, q.device, dropout_p=dropout_p,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, alibi_slopes=alibi_slopes)


def call_options(shapes: Shapes, dtype: str, q_device: torch.device, *, dropout_p, softmax_scale,
                 causal, window_size, softcap, alibi_slopes, extra=frozenset()) -> Call:
    """The checks of the options every entry point shares, and the Call they make with
    ``shapes`` (whose seqlen_k bounds the window: the longest sequence's, or the cache's
    capacity). ``extra``: features beyond the options' (varlen, paged_kv, kvcache)."""
    check_dropout(dropout_p)
    scale = resolve_softmax_scale(softmax_scale, shapes.head_dim)
    window = check_window(window_size)
    check_softcap(softcap)
    if alibi_slopes is not None:
        check_is_tensor("alibi_slopes", alibi_slopes)
        check_alibi(alibi_slopes.shape, alibi_slopes.dtype, alibi_slopes.device,
                    shapes.batch, shapes.nheads, q_device)
    # A window side as long as seqlen_k is unlimited (for every sequence, when it is the max).
    causal, window = normalize_window(bool(causal), window, shapes.seqlen_k)
    features = call_features(causal, window, softcap, alibi_slopes is not None, dropout_p,
                             shapes.nheads, shapes.nheads_k, shapes.seqlen_q)
    return Call(shapes, dtype, scale, causal, window, frozenset(features | extra))


# ---- variable-length batches ------------------------------------------------------------------
# Checked from metadata only, as above: reading cu_seqlens' values would synchronise with the
# GPU on every call. A sequence longer than the max_seqlen given is the caller's error, as in
# flash_attn 2.x.

def check_max_seqlen(name: str, value) -> int:
    """The int value of max_seqlen_q / _k. A 0-d integer tensor or a NumPy int is taken as
    flash_attn 2.x takes it (transformers passes ``position_ids.max() + 1``): a tensor's value
    costs one host sync, the caller's choice."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool \
            and not torch.compiler.is_compiling():
        value = int(value)
    elif not isinstance(value, (bool, torch.SymInt, torch.Tensor)) and hasattr(value, "__index__"):
        value = operator.index(value)
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int (the longest sequence's length), got "
                        f"{type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def paged_features(page_size: int) -> set:
    """A paged call's features: "paged_kv", and "paged_kv_unaligned" for pages that are not a
    multiple of build_matrix.PAGE_ROWS rows (fa3 reads pages in TMA boxes of that many rows or
    more; fa2 takes any page)."""
    unaligned = page_size % build_matrix.PAGE_ROWS
    return {"paged_kv"} | ({"paged_kv_unaligned"} if unaligned else set())


def check_index_tensor(name: str, t, shape: Sequence[int], layout: str,
                       q_device: torch.device) -> None:
    """cu_seqlens / seqused / block_table: int32 of ``shape`` (None: any size) on q's device."""
    check_is_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want
                                    for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    if t.device != q_device:
        raise ValueError(f"{name} must be on the device of q ({q_device}), got {t.device}")


def validate_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         seqused_q=None, seqused_k=None, block_table=None, dropout_p=0.0,
                         softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes: Optional[torch.Tensor] = None,
                         names: Sequence[str] = ("q", "k", "v")) -> Call:
    """All checks of one ``flash_attn_varlen_func`` call. q is (total_q, nheads, headdim); k / v
    are (total_k, nheads_k, headdim), or with ``block_table`` a paged cache (num_blocks,
    page_block_size, nheads_k, headdim) whose pages block_table (batch, max_blocks) lists per
    sequence."""
    nq, nk, nv = names
    tensors = (q, k, v)
    for name, t in zip(names, tensors):
        check_is_tensor(name, t)
    check_device(nq, q.device)
    check_same_device(names, [t.device for t in tensors])
    dtype = dtype_name(nq, q.dtype)
    check_same_dtype(names, [t.dtype for t in tensors])

    check_ndim(nq, q.shape, "(total_q, nheads, headdim)")
    paged = block_table is not None
    kv_layout = ("(num_blocks, page_block_size, nheads_k, headdim)" if paged
                 else "(total_k, nheads_k, headdim)")
    check_ndim(nk, k.shape, kv_layout)
    check_ndim(nv, v.shape, kv_layout)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{nv} must have the shape of {nk}, {tuple(k.shape)}, got "
                         f"{tuple(v.shape)}")
    # The dense checks on (1, rows, heads, headdim) views: heads, GQA and head dims.
    rows_k = k.shape[0] * k.shape[1] if paged else k.shape[0]
    shapes = check_shapes((1, q.shape[0]) + tuple(q.shape[1:]), (1, rows_k) + tuple(k.shape[-2:]),
                          (1, rows_k) + tuple(v.shape[-2:]), names)

    check_index_tensor("cu_seqlens_q", cu_seqlens_q, (None,), "(batch + 1,)", q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1:
        raise ValueError(f"cu_seqlens_q must hold batch + 1 >= 2 offsets (0 first, total_q "
                         f"last), got shape {tuple(cu_seqlens_q.shape)}")
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, (batch + 1,), f"(batch + 1,) = ({batch + 1},)"
                       f" like cu_seqlens_q", q.device)
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None:
            check_index_tensor(name, used, (batch,), f"(batch,) = ({batch},)", q.device)
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if paged:
        check_index_tensor("block_table", block_table, (batch, None),
                           f"(batch, max_blocks_per_seq) = ({batch}, ...)", q.device)
        page_size, pages = k.shape[1], block_table.shape[1]
        if page_size < 1:
            raise ValueError(f"{nk} has page_block_size {page_size}; it must be at least 1")
        if max_seqlen_k > pages * page_size:
            raise ValueError(f"max_seqlen_k is {max_seqlen_k}, more than block_table's "
                             f"{pages} pages of {page_size} keys hold")
    shapes = Shapes(batch, max_seqlen_q, max_seqlen_k, shapes.nheads, shapes.nheads_k,
                    shapes.head_dim)
    return call_options(shapes, dtype, q.device, dropout_p=dropout_p,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, alibi_slopes=alibi_slopes,
                        extra={"varlen"} | (paged_features(k.shape[1]) if paged else set()))


# ---- the KV cache -----------------------------------------------------------------------------

def check_rotary_dim(rotary_dim: int, head_dim: int) -> None:
    if rotary_dim % 16 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_cos / rotary_sin cover rotary_dim = 2 x their dim 1 = "
                         f"{rotary_dim} dims; it must be a multiple of 16 from 16 to the head "
                         f"dim {head_dim}")


def check_like_q(name: str, t, q, layout: str) -> None:
    """A tensor of the KV-cache call that takes q's device and dtype, with the dims of layout."""
    check_is_tensor(name, t)
    check_ndim(name, t.shape, layout)
    if t.device != q.device or t.dtype != q.dtype:
        raise ValueError(f"{name} must be {q.dtype} on {q.device} like q, got {t.dtype} on "
                         f"{t.device}")


def validate_kvcache_call(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                          cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                          block_table=None, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                          num_splits=0) -> Call:
    """All checks of one ``flash_attn_with_kvcache`` call (remembered, see ``_remembered``);
    the call's shapes hold the cache's capacity per sequence as seqlen_k."""
    return _remembered(_check_kvcache_call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                       cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, num_splits)


def _check_kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                        cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                        window_size, softcap, alibi_slopes, num_splits) -> Call:
    names = ("q", "k_cache", "v_cache")
    tensors = (q, k_cache, v_cache)
    for name, t in zip(names, tensors):
        check_is_tensor(name, t)
    check_device("q", q.device)
    check_same_device(names, [t.device for t in tensors])
    dtype = dtype_name("q", q.dtype)
    check_same_dtype(names, [t.dtype for t in tensors])
    paged = block_table is not None
    layout = ("(num_blocks, page_block_size, nheads_k, headdim)" if paged
              else "(batch_cache, seqlen_cache, nheads_k, headdim)")
    check_ndim("q", q.shape, "(batch, seqlen_q, nheads, headdim)")
    check_ndim("k_cache", k_cache.shape, layout)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have the shape of k_cache, {tuple(k_cache.shape)}, got "
                         f"{tuple(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        # Written in place, so never copied into a layout the kernels read.
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (the cache is updated "
                             f"in place, so it cannot be copied), got strides {t.stride()}")
    batch = q.shape[0]
    if paged:
        check_index_tensor("block_table", block_table, (batch, None),
                           f"(batch, max_blocks_per_seq) = ({batch}, ...)", q.device)
        capacity = block_table.shape[1] * k_cache.shape[1]
        if k_cache.shape[1] < 1:
            raise ValueError(f"k_cache has page_block_size {k_cache.shape[1]}; it must be at "
                             f"least 1")
        for name, value in (("cache_batch_idx", cache_batch_idx),
                            ("cache_leftpad", cache_leftpad)):
            if value is not None:
                raise ValueError(f"{name} cannot be combined with block_table (a paged cache "
                                 f"picks each sequence's pages itself)")
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has batch size {k_cache.shape[0]} but q has {batch}; "
                             f"they must match unless cache_batch_idx picks the cache rows")
    shapes = check_shapes(q.shape, (batch, capacity) + tuple(k_cache.shape[2:]),
                          (batch, capacity) + tuple(v_cache.shape[2:]), names)

    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values to append) must be given together")
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens must be given with k and v: it says where in the cache "
                         "the new keys and values go")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            check_like_q(name, t, q, "(batch, seqlen_new, nheads_k, headdim)")
            want = (batch, k.shape[1], shapes.nheads_k, shapes.head_dim)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape (batch, seqlen_new, nheads_k, headdim)"
                                 f" = {want}, got {tuple(t.shape)}")
        if k.shape[1] > capacity:
            raise ValueError(f"k has {k.shape[1]} new tokens, more than the cache holds "
                             f"({capacity} per sequence)")
    if isinstance(cache_seqlens, torch.Tensor):
        check_index_tensor("cache_seqlens", cache_seqlens, (batch,), f"(batch,) = ({batch},)",
                           q.device)
    elif cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.SymInt)):
            raise TypeError(f"cache_seqlens must be an int, an int32 tensor (batch,) or None, "
                            f"got {type(cache_seqlens).__name__}")
        new = 0 if k is None else k.shape[1]
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(f"cache_seqlens is {cache_seqlens}; with {new} new tokens it must "
                             f"be in [0, {capacity - new}] (the cache holds {capacity})")
    if cache_batch_idx is not None:
        check_index_tensor("cache_batch_idx", cache_batch_idx, (batch,),
                           f"(batch,) = ({batch},)", q.device)
    if cache_leftpad is not None:
        check_index_tensor("cache_leftpad", cache_leftpad, (batch,), f"(batch,) = ({batch},)",
                           q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_like_q(name, t, q, "(seqlen_ro, rotary_dim / 2)")
        if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
            raise ValueError(f"rotary_sin must have the shape of rotary_cos, "
                             f"{tuple(rotary_cos.shape)}, got {tuple(rotary_sin.shape)}")
        check_rotary_dim(2 * rotary_cos.shape[1], shapes.head_dim)
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions; it needs one per "
                             f"cache position ({capacity})")
        rotary_positions = rotary_cos.shape[0]
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")

    extra = {"kvcache"} | (paged_features(k_cache.shape[1]) if paged else set())
    if shapes.seqlen_q * (shapes.nheads // shapes.nheads_k) <= build_matrix.DECODE_MAX_ROWS:
        extra.add("decode")
    call = call_options(shapes, dtype, q.device, dropout_p=0.0, softmax_scale=softmax_scale,
                        causal=causal, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_slopes, extra=extra)
    if rotary_cos is not None and not isinstance(cache_seqlens, torch.Tensor):
        # q is rotated at cache_seqlens (+ its row when causal or local). With a tensor of
        # lengths this cannot be checked without reading it; the kernels clamp.
        start = capacity - (0 if k is None else k.shape[1]) if cache_seqlens is None \
            else cache_seqlens
        last = start + (shapes.seqlen_q - 1 if call.causal or call.window != (-1, -1) else 0)
        if last >= rotary_positions:
            raise ValueError(f"q is rotated up to position {last} (cache_seqlens {start}"
                             f"{f' + seqlen_q - 1' if last > start else ''}), past the "
                             f"{rotary_positions} positions of rotary_cos / rotary_sin")
    return call
