"""The build matrix: which kernels this project instantiates, stated once.

setup.py reads it to choose what to compile (trimmed by the FLASH_ATTN_* build switches), it
writes the instantiation files and the C++ dispatch table from it (``write_sources``), and the
tests read it for the list of supported configurations. It imports nothing outside the standard
library, so setup.py can load it before torch or the package is importable.

A kernel for head dim ``d`` is the instantiation for the smallest listed head dim >= d; inside
it, the columns past ``d`` are predicated off. Head dims that are not a multiple of 8 are padded
with zeros by the frontend, because the kernels move rows in 16-byte vectors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Iterable, Mapping

DTYPES = ("fp16", "bf16", "e4m3")
# C++ element type of each dtype name, as the kernels spell it. e4m3: FP8 (float8_e4m3fn), a
# forward of its own (Family.fp8_hdims).
CXX_TYPE = {"fp16": "__half", "bf16": "__nv_bfloat16", "e4m3": "__nv_fp8_e4m3"}

# Archs whose machine code a default build contains: Turing, Ampere, Hopper. sm80 SASS does not
# run on sm90, so each target gets its own. A default build also carries PTX, which a GPU newer
# than any target (sm100, sm120) JIT-compiles: that of sm80, the newest portable target, because
# nvcc makes it in the sm80 pass at no cost, where the sm90 PTX (compute_90, not the compute_90a
# of sm90's machine code) costs a pass of its own, as much front-end time as a target's (cicc is
# most of a file's compile). A newer GPU then runs fa1 and fa2 without their sm90 extras; fa3 has
# no portable PTX anyway. An explicit FLASH_ATTN_CUDA_ARCHS has PTX only for an entry marked
# "+PTX" (torch's TORCH_CUDA_ARCH_LIST convention).
DEFAULT_ARCHS = (75, 80, 90)
DEFAULT_PTX_ARCH = 80

# Targets compiled as their arch-specific variant ("a"): sm90's machine code is sm_90a, which
# has wgmma and setmaxnreg (fa3) and runs on sm90 only, as any sm90 machine code does. The PTX
# (of the "+PTX" target) stays the portable compute_XX, which is what a newer GPU can JIT.
ARCH_SPECIFIC = frozenset({90})


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    min_arch: int                  # oldest GPU it runs on
    dtype_min_arch: Mapping[str, int]  # dtype -> oldest GPU with the MMA for it
    hdims: tuple[int, ...]         # instantiated head dims, ascending
    directions: tuple[str, ...]    # "fwd", "bwd"
    features: frozenset[str]       # call features it supports (flash_attn/_validate.FEATURES)
    # Newest GPU it runs on; None: any newer one too. Arch-specific instructions (sm_90a's
    # wgmma) are not in the portable PTX, so such a family's kernels are empty there.
    max_arch: int | None = None
    # The family whose backward computes the gradient of this one's forward (same O and LSE
    # conventions) where its own backward cannot (below); None: its own everywhere.
    bwd_family: str | None = None
    # What its own backward takes, where that is less than its forward: the forward kernel
    # head dims it has a backward for, the features, whether deterministic=True. None: all.
    bwd_hdims: tuple[int, ...] | None = None
    bwd_features: frozenset[str] | None = None
    bwd_deterministic: bool = True
    # The shared memory per block (bytes) its backward needs at the least, per kernel head dim
    # (its launcher's smallest variant). A GPU that allows less cannot run that backward. Empty:
    # any GPU of its archs can.
    bwd_smem: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # FP8 (e4m3 q / k / v, bf16 out): the head dims of its forward kernels, on its min_arch;
    # dense calls with causal / local masks and GQA (flash_attn/fp8.py). Empty: none.
    fp8_hdims: tuple[int, ...] = ()

    @property
    def backward_hdims(self) -> tuple[int, ...]:
        return self.hdims if self.bwd_hdims is None else self.bwd_hdims

    @property
    def max_hdim(self) -> int:
        return self.hdims[-1]

    def dtype_arch(self, dtype: str) -> int:
        """The oldest GPU that runs its kernels of ``dtype`` (e4m3: its min_arch)."""
        return max(self.min_arch, self.dtype_min_arch.get(dtype, 0))


FAMILIES: dict[str, Family] = {
    # The original algorithm: outer loop over K/V tiles, O/m/l in global memory. mma.sync m16n8k8
    # on sm75 (fp16 only: Turing has no bf16 MMA), m16n8k16 on sm80+.
    "fa1": Family(
        name="fa1",
        min_arch=75,
        dtype_min_arch={"fp16": 75, "bf16": 80},
        hdims=(32, 64, 96, 128),
        directions=("fwd", "bwd"),
        features=frozenset({"causal", "gqa", "short_q"}),
    ),
    # FlashAttention-2: outer loop over Q tiles, O/m/l in registers, one normalisation at the
    # end; the backward walks K/V tiles with dQ accumulated in fp32. CuTe on mma.sync m16n8k16
    # (sm80+: cp.async and bf16 MMA). Built for every target arch like the rest; its kernels
    # compile to empty bodies for an arch below min_arch, and dispatch never picks them there.
    "fa2": Family(
        name="fa2",
        min_arch=80,
        dtype_min_arch={"fp16": 80, "bf16": 80},
        hdims=(32, 64, 96, 128, 192, 256),
        directions=("fwd", "bwd"),
        features=frozenset({"causal", "gqa", "local", "softcap", "alibi", "dropout", "varlen",
                            "paged_kv", "paged_kv_unaligned", "kvcache", "decode", "short_q"}),
        # csrc/fa2/fa2.h's kBwdMinSmem (a test keeps them equal): 106-161 KB, past the 99 KB of
        # sm86 / sm89 (and sm120), where a call that needs a gradient runs fa1 if fa1 takes it
        # (_dispatch.choose).
        bwd_smem={32: 108544, 64: 149504, 96: 132096, 128: 164864, 192: 140288, 256: 147968},
    ),
    # FlashAttention-3 for Hopper: TMA loads by a producer warpgroup, WGMMA in two or three
    # consumer warpgroups, setmaxnreg (sm_90a machine code: runs on sm90 only). Its backward
    # takes every head dim of its forward, dense and variable-length calls (causal, window,
    # softcap, ALiBi, GQA; deterministic too) with at least SHORT_Q_ROWS query rows per KV
    # head; other gradients of its forward run fa2's backward. Dropout is not implemented, nor
    # pages that are not a multiple of 8 rows: such calls run fa2 (visibly).
    "fa3": Family(
        name="fa3",
        min_arch=90,
        dtype_min_arch={"fp16": 90, "bf16": 90},
        hdims=(64, 96, 128, 192, 256),
        directions=("fwd", "bwd"),
        features=frozenset({"causal", "gqa", "local", "softcap", "alibi", "varlen", "paged_kv",
                            "kvcache", "decode", "short_q"}),
        max_arch=90,
        bwd_family="fa2",
        bwd_features=frozenset({"causal", "gqa", "local", "softcap", "alibi", "varlen"}),
        fp8_hdims=(64, 128, 256),
    ),
}

# Automatic choice, best first, for a device of compute capability (major*10+minor). A family
# that is not built or cannot run the call is skipped; the frontend says which one it took.
PREFERENCE = ("fa3", "fa2", "fa1")

# A KV-cache call with at most this many query rows per KV head (seqlen_q * nheads / nheads_k:
# decoding, speculative decoding with a few tokens) is a "decode" call: its time is the reading
# of K / V, and fa2's decode kernel reads them at a copy's rate, where fa3's forward (128-row
# tiles of one query head) would read each KV head's K / V once per query head. Such calls
# prefer fa2. The limit is fa2's kDecodeMaxRows (csrc/fa2/fa2.h; a test keeps them equal).
DECODE_MAX_ROWS = 64

# A call with fewer query rows per KV head than this (seqlen_q * nheads / nheads_k) is
# "short_q". Each CTA of fa3's backward walks that many rows against one key tile, and below
# about 1k rows its fixed cost a CTA (K / V in, dK / dV out, one CTA an SM) outweighs the
# walk: on an H100 (bf16, head dim 128, 16k tokens) fa3's backward ran 0.92x (full) / 0.83x
# (causal) fa2's at 512 rows, 1.10x / 1.00x at 1k, 1.18-1.60x from 2k. Its gradient runs
# fa2's backward there (fa3's bwd_features lack it); every forward takes it.
SHORT_Q_ROWS = 1024

# fa3 reads a paged K / V cache as TMA boxes of 8 rows or more within a page, so its pages must
# be a multiple of this many rows; other pages carry the feature "paged_kv_unaligned", which only
# fa2 has. fa3's kPageRows (csrc/fa3/fa3.h; a test keeps them equal).
PAGE_ROWS = 8


def preference(features: Iterable[str] = ()) -> tuple[str, ...]:
    """PREFERENCE for a call with these features: decode calls try fa2 first."""
    if "decode" in features:
        return ("fa2",) + tuple(f for f in PREFERENCE if f != "fa2")
    return PREFERENCE


@dataclasses.dataclass(frozen=True, order=True)
class Config:
    family: str
    direction: str
    dtype: str
    hdim: int

    @property
    def stem(self) -> str:
        return f"{self.family}_{self.direction}_hdim{self.hdim}_{self.dtype}"


def _env_list(env: Mapping[str, str], key: str) -> list[str] | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    return [item.strip() for item in raw.replace(",", ";").split(";") if item.strip()]


def all_configs() -> list[Config]:
    return sorted(
        [Config(f.name, direction, dtype, hdim)
         for f in FAMILIES.values()
         for direction in f.directions
         for dtype in f.dtype_min_arch
         for hdim in (f.backward_hdims if direction == "bwd" else f.hdims)]
        + [Config(f.name, "fwd", "e4m3", hdim) for f in FAMILIES.values() for hdim in f.fp8_hdims]
    )


def selected_configs(env: Mapping[str, str] = os.environ) -> list[Config]:
    """The configurations a build compiles, after FLASH_ATTN_FAMILIES / _HDIMS / _DTYPES."""
    families = _env_list(env, "FLASH_ATTN_FAMILIES")
    hdims = _env_list(env, "FLASH_ATTN_HDIMS")
    dtypes = _env_list(env, "FLASH_ATTN_DTYPES")
    for name in families or ():
        if name not in FAMILIES:
            raise ValueError(f"FLASH_ATTN_FAMILIES: unknown family {name!r}; known: {sorted(FAMILIES)}")
    for name in dtypes or ():
        if name not in DTYPES:
            raise ValueError(f"FLASH_ATTN_DTYPES: unknown dtype {name!r}; known: {list(DTYPES)}")
    want_hdims = {int(h) for h in hdims} if hdims else None
    configs = [
        c for c in all_configs()
        if (families is None or c.family in families)
        and (dtypes is None or c.dtype in dtypes)
        and (want_hdims is None or c.hdim in want_hdims)
    ]
    if not configs:
        raise ValueError("the FLASH_ATTN_FAMILIES / _HDIMS / _DTYPES switches select no kernel; "
                         f"the full matrix is {[c.stem for c in all_configs()]}")
    return configs


def _parse_arch(entry: str) -> tuple[int, bool]:
    """One FLASH_ATTN_CUDA_ARCHS entry -> (arch, whether it asks for PTX). Spellings: "90",
    "sm_90", "sm90a", "9.0" (torch's), each optionally with "+PTX" (any case)."""
    text = entry.strip().lower()
    ptx = text.endswith("+ptx")
    text = text.removesuffix("+ptx").strip().removeprefix("sm_").removeprefix("sm")
    text = text.removesuffix("a")
    major, dot, minor = text.partition(".")
    if (dot and len(minor) == 1 and major.isdigit() and minor.isdigit()) or text.isdigit():
        return (int(major) * 10 + int(minor) if dot else int(text)), ptx
    raise ValueError(f"FLASH_ATTN_CUDA_ARCHS: cannot read {entry!r} as an arch (e.g. 80, "
                     f"sm_90a, 9.0, 90+PTX)")


def _targets(env: Mapping[str, str]) -> tuple[list[int], int | None]:
    """(sorted target archs, the arch whose PTX the build carries or None) from
    FLASH_ATTN_CUDA_ARCHS; unset: DEFAULT_ARCHS with the PTX of DEFAULT_PTX_ARCH."""
    raw = _env_list(env, "FLASH_ATTN_CUDA_ARCHS")
    if raw is None:
        return list(DEFAULT_ARCHS), DEFAULT_PTX_ARCH
    entries = [_parse_arch(entry) for entry in raw]
    archs = sorted({arch for arch, _ in entries})
    oldest = min(f.min_arch for f in FAMILIES.values())
    if archs[0] < oldest:
        raise ValueError(f"FLASH_ATTN_CUDA_ARCHS: sm{archs[0]} is older than any family supports "
                         f"(oldest: sm{oldest})")
    marked = [entry for entry, (_, ptx) in zip(raw, entries) if ptx]
    if len(marked) > 1:
        raise ValueError(f"FLASH_ATTN_CUDA_ARCHS: at most one entry may carry +PTX, got "
                         f"{', '.join(marked)}")
    return archs, (next(arch for arch, ptx in entries if ptx) if marked else None)


def cuda_archs(env: Mapping[str, str] = os.environ) -> list[int]:
    """Target archs (machine code for each) from FLASH_ATTN_CUDA_ARCHS (e.g. "75;80;90+PTX"),
    default DEFAULT_ARCHS."""
    return _targets(env)[0]


def ptx_arch(env: Mapping[str, str] = os.environ) -> int | None:
    """The arch whose portable PTX the build carries: the FLASH_ATTN_CUDA_ARCHS entry marked
    "+PTX" (at most one), None without one; DEFAULT_PTX_ARCH when the switch is unset."""
    return _targets(env)[1]


def arch_code(arch: int) -> str:
    """The machine-code target of an arch: "90a" for sm90 (ARCH_SPECIFIC), else "80" etc."""
    return f"{arch}a" if arch in ARCH_SPECIFIC else str(arch)


def gencode_flags(archs: Iterable[int], ptx: int | None) -> list[str]:
    """Machine code for every target (arch-specific where ARCH_SPECIFIC says), plus, if ``ptx``
    is not None, the portable PTX of that arch, so that a GPU newer than any target can still
    JIT-compile the kernels (those of a family with a max_arch are empty in it)."""
    flags = [f"-gencode=arch=compute_{arch_code(a)},code=sm_{arch_code(a)}" for a in sorted(archs)]
    if ptx is not None:
        flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return flags


def _machine_code_runs_on(arch: int, built_archs: Iterable[int]) -> bool:
    """Machine code runs on its own major version at the same or a higher minor."""
    return any(a // 10 == arch // 10 and a <= arch for a in built_archs)


def runs_on(arch: int, built_archs: Iterable[int], *, ptx: int | None) -> bool:
    """Whether code built for ``built_archs`` with the PTX of ``ptx`` (None: no PTX; see
    gencode_flags) runs on a GPU of ``arch``: machine code of the same major at the same or a
    lower minor, or PTX of an arch no newer than the GPU."""
    return _machine_code_runs_on(arch, built_archs) or (ptx is not None and arch >= ptx)


def kernel_runs_on(min_arch: int, arch: int, built_archs: Iterable[int],
                   max_arch: int | None = None, *, ptx: int | None) -> bool:
    """Whether a kernel that needs sm``min_arch``+ (and at most sm``max_arch``) has code that
    runs on a GPU of ``arch`` in a build for ``built_archs`` with the PTX of ``ptx`` (None: no
    PTX). Only code for archs >= min_arch counts: below it the kernel compiles to an empty body
    (FLASH_ATTN_CUDA_ARCHS=75+PTX on an A100 would JIT the sm75 PTX, in which fa2 does
    nothing). With a max_arch only machine code counts: the portable PTX lacks the
    arch-specific instructions."""
    usable = [a for a in built_archs if a >= min_arch]
    if max_arch is not None:
        return arch <= max_arch and _machine_code_runs_on(arch, usable)
    return (_machine_code_runs_on(arch, usable)
            or (ptx is not None and ptx >= min_arch and arch >= ptx))


def supports(family: str, dtype: str, hdim: int, arch: int) -> str | None:
    """None if ``family`` can run this call on ``arch``, else the reason it cannot."""
    f = FAMILIES.get(family)
    if f is None:
        return f"family {family!r} does not exist (known: {sorted(FAMILIES)})"
    if arch < f.min_arch:
        return f"{family} needs sm{f.min_arch}+, this GPU is sm{arch}"
    if f.max_arch is not None and arch > f.max_arch:
        return (f"{family} runs on sm{f.min_arch}-sm{f.max_arch} only (arch-specific "
                f"instructions), this GPU is sm{arch}")
    if dtype not in f.dtype_min_arch:
        return f"{family} supports dtypes {sorted(f.dtype_min_arch)}, not {dtype}"
    if arch < f.dtype_min_arch[dtype]:
        return f"{family} runs {dtype} on sm{f.dtype_min_arch[dtype]}+ only, this GPU is sm{arch}"
    if hdim > f.max_hdim:
        return f"{family} supports head dims up to {f.max_hdim}, got {hdim}"
    return None


def own_backward(family: str, hdim: int, features: Iterable[str] = (),
                 deterministic: bool = False) -> bool:
    """Whether ``family``'s own backward takes the gradient of a call of its forward with this
    head dim (the caller's), features and determinism."""
    f = FAMILIES[family]
    padded = -(-hdim // 8) * 8
    if "bwd" not in f.directions or padded > f.max_hdim:
        return False
    if kernel_hdim(family, padded) not in f.backward_hdims:
        return False
    takes = f.features if f.bwd_features is None else f.bwd_features
    return frozenset(features) <= takes and (f.bwd_deterministic or not deterministic)


def backward_family(family: str, hdim: int, features: Iterable[str] = (),
                    deterministic: bool = False) -> str:
    """The family whose backward kernels run the gradient of such a call of ``family``'s
    forward: its own where they take it, else its bwd_family."""
    if own_backward(family, hdim, features, deterministic):
        return family
    return FAMILIES[family].bwd_family or family


def kernel_hdim(family: str, hdim: int) -> int:
    """The instantiated head dim that serves a (padded) head dim."""
    for h in FAMILIES[family].hdims:
        if h >= hdim:
            return h
    raise ValueError(f"{family} has no kernel for head dim {hdim}")


# ---- source generation -----------------------------------------------------------------------

_INSTANTIATION = """\
// Generated by src/flash_attn/build_matrix.py: one kernel instantiation per file, so builds
// parallelise and a trimmed matrix compiles only what it names.
#include "{family}/{family}_{direction}_launch.cuh"

template void flash::{family}::run_{direction}<{cxx_type}, {hdim}>(
    const flash::{Params}&, const flash::{family}::{Plan}&, cudaStream_t);
"""

_TABLE_HEADER = """\
// Generated by src/flash_attn/build_matrix.py: the kernels this build contains.
// FLASH_CONFIG(family, direction, cxx_type, dtype_name, hdim, min_arch, max_arch (0: none))
"""


def source_hash(root: str | os.PathLike) -> str:
    """A hash of the CUDA / C++ sources under root/csrc (build output excluded): an extension
    records the hash of the sources it was built from (``flash_attn._C.source_hash()``), so that
    the tests of a checkout notice an extension built from other sources."""
    csrc = Path(root) / "csrc"
    digest = hashlib.sha256()
    for path in sorted(csrc.rglob("*")):
        rel = path.relative_to(csrc).as_posix()
        if path.is_file() and not rel.startswith("generated/") and path.suffix in (
                ".h", ".cuh", ".cu", ".cpp", ".inc"):
            digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


# Relative compile cost of one file of each (family, direction), for compile_order: fa2's
# backward file holds six kernels, fa3's forward one per schedule, fa1's are small.
_COMPILE_WEIGHT = {("fa2", "bwd"): 4, ("fa3", "fwd"): 3, ("fa2", "fwd"): 2, ("fa1", "bwd"): 1,
                   ("fa1", "fwd"): 0}


def compile_order(configs: Iterable[Config]) -> list[Config]:
    """Heaviest first. A fresh ninja build starts its jobs in the order of the build file, so a
    heavy file listed last would compile alone while the other cores idle."""
    return sorted(configs, key=lambda c: (-_COMPILE_WEIGHT.get((c.family, c.direction), 0),
                                          -c.hdim, c))


def write_sources(out_dir: str | os.PathLike, configs: Iterable[Config], archs: Iterable[int],
                  ptx: int | None, root: str | os.PathLike | None = None) -> list[str]:
    """Write into out_dir one .cu per config, dispatch_table.inc, built_archs.inc (the target
    archs: a comma-separated list), ptx_arch.inc (the arch whose PTX the build carries: one
    int, 0 for none), as ``cuda_archs()`` and ``ptx_arch()`` give them for a build, and
    source_hash.inc (``source_hash(root)`` as a string literal, "" without a root); return the
    .cu paths, heaviest first (compile_order). csrc/api/flash_api.cpp includes the last four.

    Files whose content is unchanged are left alone, so ninja does not rebuild them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = sorted(configs)
    paths = []

    def put(path: Path, text: str) -> None:
        if not path.exists() or path.read_text() != text:
            path.write_text(text)

    for c in compile_order(configs):
        path = out / f"{c.stem}.cu"
        put(path, _INSTANTIATION.format(
            family=c.family, direction=c.direction, cxx_type=CXX_TYPE[c.dtype], hdim=c.hdim,
            Params="FwdParams" if c.direction == "fwd" else "BwdParams",
            Plan="FwdPlan" if c.direction == "fwd" else "BwdPlan"))
        paths.append(str(path))
    lines = [_TABLE_HEADER]
    for c in configs:
        min_arch = FAMILIES[c.family].dtype_arch(c.dtype)
        max_arch = FAMILIES[c.family].max_arch or 0
        lines.append(f"FLASH_CONFIG({c.family}, {c.direction}, {CXX_TYPE[c.dtype]}, {c.dtype}, "
                     f"{c.hdim}, {min_arch}, {max_arch})\n")
    put(out / "dispatch_table.inc", "".join(lines))
    put(out / "built_archs.inc", "// Generated by src/flash_attn/build_matrix.py: the target archs "
        "(machine code for each; ptx_arch.inc says which PTX).\n" +
        ", ".join(map(str, sorted(archs))) + "\n")
    put(out / "ptx_arch.inc", "// Generated by src/flash_attn/build_matrix.py: the arch whose "
        "portable PTX this build carries (the +PTX target), 0: none.\n" + f"{ptx or 0}\n")
    put(out / "source_hash.inc", "// Generated by src/flash_attn/build_matrix.py: the hash of "
        "the csrc/ this build was made from.\n" + f'"{source_hash(root) if root else ""}"\n')
    return paths


if __name__ == "__main__":  # python src/flash_attn/build_matrix.py OUT_DIR: what CMake runs
    import sys

    checkout = Path(__file__).resolve().parents[2]
    for p in write_sources(sys.argv[1], selected_configs(), cuda_archs(), ptx_arch(),
                           checkout if (checkout / "csrc").is_dir() else None):
        print(p)
