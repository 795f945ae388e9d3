"""THE dispatch point: (device arch, validated call, request) -> kernel family.

Automatic choice walks ``build_matrix.PREFERENCE`` (best first) and takes the first family that
is implemented, built into this ``flash_attn._C``, runs on the device's arch / dtype / head dim
(``build_matrix.supports``: from its min_arch up to its max_arch, if it has one), has machine
code or PTX for an arch it supports that runs on the device (``build_matrix.kernel_runs_on``:
fa2 built for sm75 only is empty, fa3 runs from sm_90a machine code only; the build carries PTX
only of its ``+PTX`` target, ``ptx_arch()``) and has every feature the call uses. That gives
sm90 -> fa3, sm80..89 and sm100+ (from the PTX of a default build) -> fa2, sm75 -> fa1 when
those are built. A decode call (a KV cache with few query rows per KV head, feature "decode")
walks ``build_matrix.preference``'s order instead, fa2 first: its decode kernel reads the cache
at a copy's rate. When the arch's first choice is skipped, a ``BackendFallbackWarning`` says
which family runs instead and why, once per distinct (arch, dtype, head dim, features,
request): on sm90 a call with dropout runs fa2 ("fa3 does not support dropout_p > 0").

The family returned is the forward's. Its gradient runs the kernels of
``build_matrix.backward_family(family, head_dim, features, deterministic)``: the family's own
backward where that takes the call, else its bwd_family's (fa3's backward takes every head
dim, dense or variable-length, any mask or score mod, deterministic or not, with
build_matrix.SHORT_Q_ROWS query rows per KV head or more; its other gradients run fa2's
backward, on the same O / LSE conventions). A call that needs a backward can run a family only
if that backward family is built, runs on the device and supports the call too; among those,
one whose backward kernel fits the device's shared memory per block comes first
(build_matrix's ``bwd_smem``: fa2's backward needs more than sm86 / sm89's 99 KB, so training
there runs fa1 where fa1 takes the call; ``choose`` says what happens where none fits).

A family is forced with ``FLASH_ATTN_BACKEND=auto|fa1|fa2|fa3`` (read at call time) or per call
with ``backend=`` (which wins). A forced family that cannot run the call is an error naming the
reason and the families that would run it; it never falls back silently.

Under ``torch.compile`` the choice is made while tracing (``assume_constant_result``) and baked
into the graph: set FLASH_ATTN_BACKEND before the first compiled call, or pass ``backend=``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Iterable, List, NamedTuple, Optional, Tuple

import torch

from . import _ops, build_matrix
from ._validate import MAX_HEAD_DIM, Call, check_arch

ENV_VAR = "FLASH_ATTN_BACKEND"
# Names a request may use: every family the preference order knows, implemented or not yet.
BACKENDS = tuple(build_matrix.PREFERENCE)

# How an error message names each call feature.
_FEATURE_TEXT = {
    "causal": "causal attention",
    "gqa": "grouped-query attention (nheads != nheads_k)",
    "local": "local attention (window_size != (-1, -1))",
    "softcap": "softcap > 0",
    "alibi": "alibi_slopes",
    "dropout": "dropout_p > 0",
    "varlen": "variable-length batches (cu_seqlens)",
    "paged_kv": "a paged K/V cache (block_table)",
    "paged_kv_unaligned": "a paged K/V cache whose page_block_size is not a multiple of "
                          f"{build_matrix.PAGE_ROWS}",
    "kvcache": "attention over a KV cache (flash_attn_with_kvcache)",
    "decode": "a KV-cache call with few query rows per KV head (decoding)",
    "short_q": f"fewer than {build_matrix.SHORT_Q_ROWS} query rows per KV head",
}


class BackendFallbackWarning(UserWarning):
    """The automatic choice skipped the device's preferred family (not built, or it cannot run
    this call). Filter it with ``warnings.simplefilter('ignore', BackendFallbackWarning)`` or
    turn it into an error to catch slow paths in tests."""


class BuiltConfig(NamedTuple):
    family: str
    direction: str
    dtype: str
    hdim: int
    min_arch: int


# ---- what this build and this machine have ----------------------------------------------------

_BUILT_CACHE: dict = {}
_ARCH_CACHE: dict = {}
_SMEM_CACHE: dict = {}


def built_archs() -> Tuple[int, ...]:
    """The archs ``flash_attn._C`` has machine code for; () if the extension predates
    ``built_archs`` (then nothing is ruled out by arch)."""
    ext = _ops.extension()
    archs = _BUILT_CACHE.get((ext, "archs"))
    if archs is None:
        archs = tuple(int(a) for a in getattr(ext, "built_archs", lambda: ())())
        _BUILT_CACHE[(ext, "archs")] = archs
    return archs


def ptx_arch() -> Optional[int]:
    """The arch whose portable PTX ``flash_attn._C`` carries (its FLASH_ATTN_CUDA_ARCHS entry
    marked +PTX), None if none. An extension that predates ``ptx_arch`` carried the PTX of its
    newest target, as every build did then."""
    ext = _ops.extension()
    key = (ext, "ptx")
    if key not in _BUILT_CACHE:
        get = getattr(ext, "ptx_arch", None)
        if get is None:
            archs = built_archs()
            _BUILT_CACHE[key] = max(archs) if archs else None
        else:
            _BUILT_CACHE[key] = int(get()) or None
    return _BUILT_CACHE[key]


def _targets_text(archs: Iterable[int], ptx: Optional[int]) -> str:
    """A build's targets as messages name them: "machine code for sm80, sm90 and no PTX"."""
    code = f"machine code for {', '.join(f'sm{a}' for a in archs)}"
    return f"{code} and {'no PTX' if ptx is None else f'PTX of sm{ptx}'}"


def _rebuild_hint(arch: int, archs: Tuple[int, ...], ptx: Optional[int], min_arch: int) -> str:
    """How to rebuild so that code for sm``min_arch``+ runs on ``arch``: machine code for it,
    or PTX of the newest target it can JIT (when that target is at least min_arch)."""
    hint = f"rebuild with FLASH_ATTN_CUDA_ARCHS including {arch}"
    jit = [a for a in archs if min_arch <= a <= arch]
    if jit and max(jit) != ptx:
        hint += f", or with {max(jit)}+PTX (PTX that sm{arch} JIT-compiles)"
    return hint


def runs_here(arch: int) -> Optional[str]:
    """None if this build has code that runs on ``arch``, else why not."""
    archs, ptx = built_archs(), ptx_arch()
    if not archs or build_matrix.runs_on(arch, archs, ptx=ptx):
        return None
    return (f"this build has {_targets_text(archs, ptx)}, none of which runs on sm{arch}; "
            f"{_rebuild_hint(arch, archs, ptx, 0)}")


def built_configs() -> frozenset:
    """The kernels in ``flash_attn._C`` (``BuiltConfig``s); raises RuntimeError without it."""
    ext = _ops.extension()
    built = _BUILT_CACHE.get(ext)
    if built is None:
        built = frozenset(BuiltConfig(str(f), str(d), str(t), int(h), int(a))
                          for f, d, t, h, a in ext.built_configs())
        _BUILT_CACHE[ext] = built
    return built


def _device_index(device) -> int:
    """A CUDA device's index (an int, a torch.device or a string; no index: the current one)."""
    index = torch.device(device).index if not isinstance(device, int) else device
    return torch.cuda.current_device() if index is None else index


@torch.compiler.assume_constant_result
def device_arch(device) -> int:
    """Compute capability of a CUDA device as major * 10 + minor (sm90 -> 90)."""
    index = _device_index(device)
    arch = _ARCH_CACHE.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = _ARCH_CACHE[index] = major * 10 + minor
    return arch


@torch.compiler.assume_constant_result
def device_smem(device) -> int:
    """The shared memory a block may opt into on a CUDA device, in bytes; 0 if this torch does
    not say (then nothing is ruled out by it)."""
    index = _device_index(device)
    smem = _SMEM_CACHE.get(index)
    if smem is None:
        props = torch.cuda.get_device_properties(index)
        smem = _SMEM_CACHE[index] = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    return smem


def requested_backend(backend: Optional[str]) -> Optional[str]:
    """The forced family, or None for automatic: ``backend=`` if given, else FLASH_ATTN_BACKEND."""
    if backend is not None:
        source, value = "backend", backend
    else:
        source, value = ENV_VAR, os.environ.get(ENV_VAR, "")
        if not value.strip():
            return None
    name = value.strip().lower() if isinstance(value, str) else value
    if name == "auto":
        return None
    if name not in BACKENDS:
        raise ValueError(f"{source}={value!r} is not a backend; supported: 'auto', "
                         f"{', '.join(repr(b) for b in BACKENDS)}" +
                         (" or None" if source == "backend" else ""))
    return name


# ---- the choice (pure: everything it reads is an argument) -----------------------------------

def why_not(family: str, arch: int, dtype: str, hdim: int, features: Iterable[str],
            directions: Tuple[str, ...], built: frozenset,
            archs: Iterable[int] = (), ptx: Optional[int] = None,
            deterministic: bool = False, smem: int = 0) -> Optional[str]:
    """None if ``family`` can run the call, else the reason it cannot. ``directions``: "fwd"
    and, for a call that needs a gradient, "bwd", which runs the kernels of the call's
    backward family (build_matrix.backward_family: ``family``'s own or its bwd_family, by head
    dim, features and ``deterministic``). ``archs``: the build's target archs
    (``built_archs()``); empty means unknown, nothing ruled out by them. ``ptx``: the arch
    whose PTX the build carries (``ptx_arch()``), None for none. ``smem``: the shared memory a
    block may opt into on the device (``device_smem``), 0 for unknown."""
    if family not in build_matrix.FAMILIES:
        return (f"{family} is not implemented in this version of flash_attn (implemented: "
                f"{', '.join(sorted(build_matrix.FAMILIES))})")
    features = frozenset(features)
    archs = tuple(archs)
    for direction in directions:
        owner = (family if direction == "fwd" else
                 build_matrix.backward_family(family, hdim, features, deterministic))
        reason = _why_not_kernels(owner, direction, family, arch, dtype, hdim, features, built,
                                  archs, ptx, smem)
        if reason is not None:
            return reason
    return None


def _why_not_kernels(family: str, direction: str, forward_family: str, arch: int, dtype: str,
                     hdim: int, features: frozenset, built: frozenset,
                     archs: Tuple[int, ...], ptx: Optional[int],
                     smem: int = 0) -> Optional[str]:
    """None if ``family``'s ``direction`` kernels can run the call, else why not.
    ``forward_family``: the family whose forward the call runs (another one when these
    kernels compute its gradient)."""
    fam = build_matrix.FAMILIES[family]
    kernel = f"{family} {direction} kernel"
    if forward_family != family:
        kernel += f" (which computes {forward_family}'s gradient)"
    missing = sorted(features - fam.features)
    reason = (f"{family} does not support {', '.join(_FEATURE_TEXT[m] for m in missing)}"
              if missing else build_matrix.supports(family, dtype, hdim, arch))
    if reason is not None:
        return reason if forward_family == family else f"the {kernel}: {reason}"
    padded = -(-hdim // 8) * 8
    kernels = [c for c in built if c.family == family and c.direction == direction
               and c.dtype == dtype and c.hdim >= padded and c.min_arch <= arch]
    if not kernels:
        return (f"this build has no {kernel} for {dtype} head dim {hdim} "
                f"(built: {_summary(built, family)}); rebuild with FLASH_ATTN_FAMILIES / "
                f"FLASH_ATTN_DTYPES / FLASH_ATTN_HDIMS including it")
    if archs and not any(build_matrix.kernel_runs_on(c.min_arch, arch, archs, fam.max_arch,
                                                     ptx=ptx)
                         for c in kernels):
        need = min(c.min_arch for c in kernels)
        which = (f"{family} {dtype} kernels" if forward_family == family else
                 f"{family} {dtype} {direction} kernels (which compute {forward_family}'s "
                 f"gradient)")
        if fam.max_arch is not None:
            # Only machine code counts: the PTX lacks the arch-specific instructions.
            return (f"this build's {which} need {_arch_range(fam, need)} machine code, and its "
                    f"targets are {', '.join(f'sm{a}' for a in archs)}; rebuild with "
                    f"FLASH_ATTN_CUDA_ARCHS including {arch}")
        return (f"this build's {which} need code for sm{need}+ that runs on sm{arch}, and it "
                f"has {_targets_text(archs, ptx)}; {_rebuild_hint(arch, archs, ptx, need)}")
    # The call runs the smallest kernel head dim that holds it.
    kernel_hdim = min(c.hdim for c in kernels)
    need_smem = fam.bwd_smem.get(kernel_hdim, 0) if direction == "bwd" else 0
    if smem and need_smem > smem:
        return (f"the {kernel} for head dim {kernel_hdim} needs {-(-need_smem // 1024)} KB of "
                f"shared memory per block, and this GPU allows {smem // 1024} KB")
    return None


def _arch_range(fam: build_matrix.Family, low: Optional[int] = None) -> str:
    """The GPUs a family runs on, as an error message names them: "sm80+", "sm90"."""
    low = fam.min_arch if low is None else low
    if fam.max_arch is None:
        return f"sm{low}+"
    return f"sm{low}" if low == fam.max_arch else f"sm{low}-sm{fam.max_arch}"


def _summary(built: frozenset, family: str) -> str:
    mine = sorted({(c.direction, c.dtype, c.hdim) for c in built if c.family == family})
    return ", ".join(f"{d} {t} hdim{h}" for d, t, h in mine) or "none"


def preferred_family(arch: int, features: Iterable[str] = ()) -> Optional[str]:
    """The family an arch should run when everything is built: 90 -> fa3, 100 -> fa2; a
    decode call (build_matrix.preference) fa2 from sm80 on."""
    for name in build_matrix.preference(features):
        family = build_matrix.FAMILIES.get(name)
        if family is not None and _arch_in(family, arch):
            return name
    return None


def _arch_in(family: build_matrix.Family, arch: int) -> bool:
    """Whether ``arch`` is in the family's range, min_arch to max_arch (if it has one)."""
    return family.min_arch <= arch and (family.max_arch is None or arch <= family.max_arch)


def choose(arch: int, dtype: str, hdim: int, features: Iterable[str],
           requested: Optional[str] = None, *, need_bwd: bool = False,
           built: frozenset = frozenset(), archs: Iterable[int] = (),
           ptx: Optional[int] = None, deterministic: bool = False, smem: int = 0) -> str:
    """The family that runs the call; raises NotImplementedError when none can (or the forced
    one cannot). ``hdim`` is the caller's head dim, before padding to a multiple of 8;
    ``archs`` / ``ptx`` / ``smem``: the build's targets and the device's shared memory, as
    ``why_not`` takes them.

    A backward that needs more shared memory than the device allows (fa2's on sm86 / sm89)
    rules its family out only where another family's backward fits: otherwise the call keeps
    its forward, whose gradient, if asked for, raises then (a caller that never asks loses
    nothing)."""
    features = frozenset(features)
    directions = ("fwd", "bwd") if need_bwd else ("fwd",)
    archs = tuple(archs)
    order = build_matrix.preference(features)
    reasons = {f: why_not(f, arch, dtype, hdim, features, directions, built, archs, ptx,
                          deterministic) for f in order}
    runnable = [f for f in order if reasons[f] is None]
    if smem and need_bwd:
        # The shared memory as a reason too; a family that fits first.
        reasons = {f: reasons[f] or why_not(f, arch, dtype, hdim, features, directions, built,
                                            archs, ptx, deterministic, smem) for f in order}
        runnable = sorted(runnable, key=lambda f: reasons[f] is not None)
    what = (f"sm{arch}, {dtype}, head dim {hdim}, {'fwd+bwd' if need_bwd else 'fwd'}, "
            f"features: {', '.join(sorted(features)) or 'none'}")
    if requested is not None:
        if requested not in reasons:
            raise ValueError(f"backend={requested!r} is not a backend; supported: "
                             f"{', '.join(repr(b) for b in BACKENDS)}")
        if requested in runnable:
            return requested
        reason = reasons[requested]
        runs_it = (f"backend={runnable[0]!r} would run it (or leave backend unset for the "
                   f"automatic choice)" if runnable else _none_runs_it(features))
        raise NotImplementedError(f"backend={requested!r} cannot run this call ({what}): "
                                  f"{reason}. {runs_it}")
    if not runnable:
        details = "; ".join(f"{f}: {reasons[f]}" for f in order)
        raise NotImplementedError(f"no backend in this build can run this call ({what}). "
                                  f"{details}. {_none_runs_it(features)}")
    chosen, preferred = runnable[0], preferred_family(arch, features)
    if preferred is not None and chosen != preferred:
        warnings.warn(f"flash_attn: running {chosen} instead of {preferred}, the preferred "
                      f"family on sm{arch}, because {reasons[preferred]} ({what})",
                      BackendFallbackWarning, stacklevel=2)
    return chosen


def _none_runs_it(features: frozenset) -> str:
    families = build_matrix.FAMILIES
    unsupported = [f for f in sorted(features)
                   if not any(f in fam.features for fam in families.values())]
    if unsupported:
        return (f"No backend in this version supports "
                f"{', '.join(_FEATURE_TEXT[f] for f in unsupported)}.")
    having = [f for f in build_matrix.PREFERENCE
              if f in families and features <= families[f].features]
    if len(having) < len(families):
        # Some family lacks a feature of the call: say which ones have them all, and where.
        return (f"No backend in this build runs it; the families with every feature of this "
                f"call: {', '.join(f'{f} ({_arch_range(families[f])})' for f in having)}.")
    return "No backend in this build runs it."


# ---- the entry point used by the public functions --------------------------------------------

_DECISIONS: dict = {}


@torch.compiler.assume_constant_result
def _decide(arch: int, dtype: str, hdim: int, features: frozenset, requested: Optional[str],
            need_bwd: bool, deterministic: bool = False, smem: int = 0) -> Tuple[str, str, str]:
    """``choose`` as (family, "", "") or ("", exception name, message), memoised: dynamo turns
    the result into a constant, and an exception raised while it traces would reach the user
    wrapped in a dynamo error, so errors are returned here and raised by traced code. The memo
    is keyed by the loaded extension itself (what it was built with cannot change), so that a
    call that was decided before costs one lookup: its built configs, archs and PTX are read
    only to decide."""
    key = (sys.modules.get(_ops._EXTENSION), arch, dtype, hdim, features, requested,
           need_bwd, deterministic, smem)
    decision = _DECISIONS.get(key) if key[0] is not None else None
    if decision is not None:
        return decision
    try:
        built = built_configs()
        archs, ptx = built_archs(), ptx_arch()
        wrong_arch = runs_here(arch)
    except RuntimeError as e:
        return ("", "RuntimeError", str(e))
    if wrong_arch is not None:
        decision = ("", "RuntimeError", f"flash_attn: {wrong_arch}")
    else:
        try:
            decision = (choose(arch, dtype, hdim, features, requested, need_bwd=need_bwd,
                               built=built, archs=archs, ptx=ptx,
                               deterministic=deterministic, smem=smem), "", "")
        except NotImplementedError as e:
            decision = ("", "NotImplementedError", str(e))
    _DECISIONS[(_ops.extension(),) + key[1:]] = decision
    return decision


_ERRORS = {"RuntimeError": RuntimeError, "NotImplementedError": NotImplementedError}


def select(call: Call, device, backend: Optional[str], need_bwd: bool,
           deterministic: bool = False) -> str:
    """The family for a validated call on ``device`` (traceable by torch.compile).
    ``deterministic``: the call's, which picks the backward family when ``need_bwd``."""
    if torch.version.hip is not None:
        raise RuntimeError("flash_attn's kernels are CUDA-only; this torch is a ROCm build "
                           f"(HIP {torch.version.hip})")
    arch = device_arch(device)
    check_arch(arch, device)
    head_dim = call.shapes.head_dim
    if torch.compiler.is_compiling():
        # Under dynamic=True the head dim is symbolic and cannot be a constant argument; the
        # kernel depends only on it rounded up to a multiple of 8, which range guards pin down.
        for padded in range(8, MAX_HEAD_DIM + 1, 8):
            if head_dim <= padded:
                head_dim = padded
                break
    family, error, message = _decide(arch, call.dtype, head_dim, call.features,
                                     requested_backend(backend), need_bwd,
                                     bool(deterministic) and need_bwd,
                                     device_smem(device) if need_bwd else 0)
    if error:
        raise _ERRORS[error](message)
    return family


def available_backends(device=None) -> List[str]:
    """The families this build can run on ``device`` (default: the current CUDA device), best
    first. Empty without a CUDA GPU, without the compiled extension, or with an extension that
    has no code for the GPU; a ``UserWarning`` then says which (once per reason)."""
    families, reason = _available(device)
    if not families and reason not in _EMPTY_REASONS_SAID:
        _EMPTY_REASONS_SAID.add(reason)
        warnings.warn(f"flash_attn.available_backends() is empty: {reason}", stacklevel=2)
    return families


_EMPTY_REASONS_SAID: set = set()


def _available(device) -> Tuple[List[str], Optional[str]]:
    """(available_backends, why it is empty)."""
    if torch.version.hip is not None:
        return [], f"torch {torch.__version__} is a ROCm build; the kernels are CUDA only"
    if not torch.cuda.is_available():
        why = ("a CPU build of torch" if torch.version.cuda is None
               else "a CUDA build of torch that sees no GPU")
        return [], f"no CUDA device (torch {torch.__version__} is {why})"
    if device is not None and not isinstance(device, int) and torch.device(device).type != "cuda":
        return [], f"{device} is not a CUDA device"
    try:
        built = built_configs()
    except RuntimeError as e:
        return [], str(e)
    arch = device_arch(torch.cuda.current_device() if device is None else device)
    why = runs_here(arch)
    if why is not None:
        return [], why
    archs, ptx = built_archs(), ptx_arch()
    families = build_matrix.FAMILIES
    # The forward's kernels decide: a family whose gradient runs elsewhere is still listed.
    found = [f for f in build_matrix.PREFERENCE
             if f in families and _arch_in(families[f], arch)
             and any(c.family == f and c.direction == "fwd" and c.min_arch <= arch
                     and (not archs or build_matrix.kernel_runs_on(c.min_arch, arch, archs,
                                                                   families[f].max_arch, ptx=ptx))
                     for c in built)]
    return found, None if found else (f"this build has no forward kernel that runs on sm{arch} "
                                      f"(built: {sorted({c.family for c in built})})")
