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
import os
from pathlib import Path
from typing import Iterable, Mapping

DTYPES = ("fp16", "bf16")
# C++ element type of each dtype name, as the kernels spell it.
CXX_TYPE = {"fp16": "__half", "bf16": "__nv_bfloat16"}

# Archs whose machine code a default build contains: Turing, Ampere, Hopper. sm80 SASS does not
# run on sm90, so each target gets its own.
DEFAULT_ARCHS = (75, 80, 90)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    min_arch: int                  # oldest GPU it runs on
    dtype_min_arch: Mapping[str, int]  # dtype -> oldest GPU with the MMA for it
    hdims: tuple[int, ...]         # instantiated head dims, ascending
    directions: tuple[str, ...]    # "fwd", "bwd"
    features: frozenset[str]       # call features it supports (flash_attn/_validate.FEATURES)

    @property
    def max_hdim(self) -> int:
        return self.hdims[-1]


FAMILIES: dict[str, Family] = {
    # The original algorithm: outer loop over K/V tiles, O/m/l in global memory. mma.sync m16n8k8
    # on sm75 (fp16 only: Turing has no bf16 MMA), m16n8k16 on sm80+.
    "fa1": Family(
        name="fa1",
        min_arch=75,
        dtype_min_arch={"fp16": 75, "bf16": 80},
        hdims=(32, 64, 96, 128),
        directions=("fwd", "bwd"),
        features=frozenset({"causal", "gqa"}),
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
        features=frozenset({"causal", "gqa", "local", "softcap", "alibi", "dropout"}),
    ),
}

# Automatic choice, best first, for a device of compute capability (major*10+minor). A family
# that is not built or cannot run the call is skipped; the frontend says which one it took.
PREFERENCE = ("fa3", "fa2", "fa1")


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
        Config(f.name, direction, dtype, hdim)
        for f in FAMILIES.values()
        for direction in f.directions
        for dtype in f.dtype_min_arch
        for hdim in f.hdims
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


def cuda_archs(env: Mapping[str, str] = os.environ) -> list[int]:
    """Target archs from FLASH_ATTN_CUDA_ARCHS (e.g. "75;80;90"), default DEFAULT_ARCHS."""
    raw = _env_list(env, "FLASH_ATTN_CUDA_ARCHS")
    if raw is None:
        return list(DEFAULT_ARCHS)
    archs = sorted({int(a.lower().removeprefix("sm_").removeprefix("sm").rstrip("a")) for a in raw})
    oldest = min(f.min_arch for f in FAMILIES.values())
    if archs[0] < oldest:
        raise ValueError(f"FLASH_ATTN_CUDA_ARCHS: sm{archs[0]} is older than any family supports "
                         f"(oldest: sm{oldest})")
    return archs


def gencode_flags(archs: Iterable[int]) -> list[str]:
    """Machine code for every target, plus PTX of the newest one so that a GPU newer than any
    target can still JIT-compile the kernels."""
    archs = sorted(archs)
    return ([f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs] +
            [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"])


def runs_on(arch: int, built_archs: Iterable[int]) -> bool:
    """Whether code built for ``built_archs`` (see gencode_flags) runs on a GPU of ``arch``:
    machine code runs on its own major version at the same or a higher minor; the PTX of the
    newest target runs on anything at least that new."""
    built_archs = list(built_archs)
    return (any(a // 10 == arch // 10 and a <= arch for a in built_archs)
            or arch >= max(built_archs))


def kernel_runs_on(min_arch: int, arch: int, built_archs: Iterable[int]) -> bool:
    """Whether a kernel that needs sm``min_arch``+ has code that runs on a GPU of ``arch`` in a
    build for ``built_archs``. Only the targets >= min_arch count: below it the kernel compiles
    to an empty body (FLASH_ATTN_CUDA_ARCHS=75 on an A100 would JIT the sm75 PTX, in which fa2
    does nothing)."""
    usable = [a for a in built_archs if a >= min_arch]
    return bool(usable) and runs_on(arch, usable)


def supports(family: str, dtype: str, hdim: int, arch: int) -> str | None:
    """None if ``family`` can run this call on ``arch``, else the reason it cannot."""
    f = FAMILIES.get(family)
    if f is None:
        return f"family {family!r} does not exist (known: {sorted(FAMILIES)})"
    if arch < f.min_arch:
        return f"{family} needs sm{f.min_arch}+, this GPU is sm{arch}"
    if dtype not in f.dtype_min_arch:
        return f"{family} supports dtypes {sorted(f.dtype_min_arch)}, not {dtype}"
    if arch < f.dtype_min_arch[dtype]:
        return f"{family} runs {dtype} on sm{f.dtype_min_arch[dtype]}+ only, this GPU is sm{arch}"
    if hdim > f.max_hdim:
        return f"{family} supports head dims up to {f.max_hdim}, got {hdim}"
    return None


def kernel_hdim(family: str, hdim: int) -> int:
    """The instantiated head dim that serves a (padded) head dim."""
    for h in FAMILIES[family].hdims:
        if h >= hdim:
            return h
    raise ValueError(f"{family} has no kernel for head dim {hdim}")


# ---- source generation -----------------------------------------------------------------------

_INSTANTIATION = """\
// Generated by flash_attn/build_matrix.py: one kernel instantiation per file, so builds
// parallelise and a trimmed matrix compiles only what it names.
#include "{family}/{family}_{direction}_launch.cuh"

template void flash::{family}::run_{direction}<{cxx_type}, {hdim}>(const flash::{Params}&, cudaStream_t);
"""

_TABLE_HEADER = """\
// Generated by flash_attn/build_matrix.py: the kernels this build contains.
// FLASH_CONFIG(family, direction, cxx_type, dtype_name, hdim, min_arch)
"""


def write_sources(out_dir: str | os.PathLike, configs: Iterable[Config],
                  archs: Iterable[int] | None = None) -> list[str]:
    """Write one .cu per config, dispatch_table.inc and built_archs.inc (the target archs,
    default ``cuda_archs()``) into out_dir; return the .cu paths.

    Files whose content is unchanged are left alone, so ninja does not rebuild them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = sorted(configs)
    paths = []

    def put(path: Path, text: str) -> None:
        if not path.exists() or path.read_text() != text:
            path.write_text(text)

    for c in configs:
        path = out / f"{c.stem}.cu"
        put(path, _INSTANTIATION.format(
            family=c.family, direction=c.direction, cxx_type=CXX_TYPE[c.dtype], hdim=c.hdim,
            Params="FwdParams" if c.direction == "fwd" else "BwdParams"))
        paths.append(str(path))
    lines = [_TABLE_HEADER]
    for c in configs:
        min_arch = max(FAMILIES[c.family].min_arch, FAMILIES[c.family].dtype_min_arch[c.dtype])
        lines.append(f"FLASH_CONFIG({c.family}, {c.direction}, {CXX_TYPE[c.dtype]}, {c.dtype}, "
                     f"{c.hdim}, {min_arch})\n")
    put(out / "dispatch_table.inc", "".join(lines))
    archs = sorted(cuda_archs() if archs is None else archs)
    put(out / "built_archs.inc", "// Generated by flash_attn/build_matrix.py: the target archs "
        "(machine code for each, PTX for the last).\n" + ", ".join(map(str, archs)) + "\n")
    return paths


if __name__ == "__main__":  # python flash_attn/build_matrix.py OUT_DIR: what CMake runs
    import sys

    for p in write_sources(sys.argv[1], selected_configs()):
        print(p)
