"""Build of flash-attn: the Python package plus the CUDA extension ``flash_attn._C``.

    pip install --no-build-isolation .        # needs torch (CUDA build), nvcc, ninja, nvidia-cutlass

What gets compiled is the build matrix in src/flash_attn/build_matrix.py, trimmed by the switches
FLASH_ATTN_CUDA_ARCHS / _FAMILIES / _HDIMS / _DTYPES; FLASH_ATTN_SKIP_CUDA_BUILD=1 installs the
Python package alone. MAX_JOBS bounds parallel compile jobs (unset: every core, fewer where
the available memory is short, see _compile_jobs); CUTLASS_DIR overrides where the
CUTLASS headers come from (third_party/find_cutlass.py). Build with ``pip install -v`` to see the
matrix being compiled and the build time.

A wheel with the extension requires the torch minor release it was compiled against
(``torch==X.Y.*``); a FLASH_ATTN_SKIP_CUDA_BUILD=1 wheel requires any torch.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
os.chdir(ROOT)  # setuptools wants sources relative to the project root


def _load_by_path(name: str, path: Path):
    """Import a stdlib-only helper by file path, without importing flash_attn (or torch)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses looks its module up here
    spec.loader.exec_module(module)
    return module


def _version() -> str:
    path = ROOT / "src" / "flash_attn" / "_version.py"
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", path.read_text(), re.M)
    if match is None:
        raise RuntimeError(f"no __version__ = '...' line in {path}")
    return match.group(1)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _torch_requirement(torch) -> str:
    """The torch an extension built against ``torch`` runs with: the same minor release.

    torch's C++ ABI (the symbols flash_attn._C links against) changes between minor versions, so
    the wheel must not let pip pair it with another one.
    """
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:
        sys.exit(f"flash-attn: cannot read major.minor from torch version {torch.__version__!r}")
    return f"torch=={match.group(1)}.{match.group(2)}.*"


# Memory one compile job may take: nvcc's front end (cicc) holds 3.5-4.3 GB for an fa2 backward
# file, and 16 jobs of the full matrix peaked at 45 and 47 GB together (ARCHITECTURE.md, Build).
GB_PER_JOB = 4


def _compile_jobs() -> str:
    """MAX_JOBS as given; unset: every core, but no more jobs than the available memory holds
    at GB_PER_JOB each, so that a many-core machine with little memory builds slower instead of
    running out of it."""
    if os.environ.get("MAX_JOBS", "").strip():
        return os.environ["MAX_JOBS"].strip()
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return str(cores)
    return str(max(1, min(cores, kb // (GB_PER_JOB * 2**20))))


# CUDA sources that are not build-matrix instantiations; CMakeLists.txt lists the same.
COMMON_SOURCES = ["csrc/common/dropout_mask.cu", "csrc/common/fp8_quantize.cu",
                  "csrc/common/kvcache_prep.cu"]


def _cuda_extension():
    """The CUDAExtension and its BuildExtension; imports torch, so only when building it."""
    build_matrix = _load_by_path("_flash_attn_build_matrix", ROOT / "src" / "flash_attn" / "build_matrix.py")
    find_cutlass = _load_by_path("_flash_attn_find_cutlass", ROOT / "third_party" / "find_cutlass.py")

    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        sys.exit(f"flash-attn: torch {torch.__version__} is not a CUDA build, so the CUDA "
                 "extension cannot be built against it. Install a CUDA build of torch, or set "
                 "FLASH_ATTN_SKIP_CUDA_BUILD=1 to install the Python package alone.")
    if cpp_extension.CUDA_HOME is None:
        sys.exit("flash-attn: no CUDA toolkit found; put nvcc on PATH or set CUDA_HOME.")
    if not cpp_extension.is_ninja_available():
        sys.exit("flash-attn: ninja not found; `pip install ninja` (the fallback compiles one "
                 "file at a time).")
    try:
        cutlass_include = find_cutlass.cutlass_include_dir()
    except find_cutlass.CutlassNotFound as e:
        sys.exit(f"flash-attn: {e}")

    torch_requirement = _torch_requirement(torch)
    os.environ["MAX_JOBS"] = _compile_jobs()  # what torch's ninja build runs with
    configs = build_matrix.selected_configs()
    archs = build_matrix.cuda_archs()
    ptx = build_matrix.ptx_arch()  # the "+PTX" entry (sm80 when unset), None for none
    kernel_sources = build_matrix.write_sources(ROOT / "csrc" / "generated", configs, archs, ptx,
                                                ROOT)
    api_sources = sorted(glob.glob("csrc/api/*.cpp"))
    if not api_sources:
        sys.exit("flash-attn: csrc/api/*.cpp is missing (the torch glue, flash_api.cpp).")
    # Helpers outside the matrix (the dropout-mask kernel), compiled once for every target arch.
    # The kernels first, heaviest first (build_matrix.compile_order): ninja starts jobs in this order.
    sources = [os.path.relpath(p, ROOT) for p in kernel_sources] + api_sources + COMMON_SOURCES

    print(f"flash-attn {_version()}: building flash_attn._C for "
          f"{' '.join(f'sm{a}' for a in archs)} ({f'+ PTX of sm{ptx}' if ptx else 'no PTX'}), "
          f"{len(configs)} kernels "
          f"(torch {torch.__version__}, CUDA {torch.version.cuda}, CUDA_HOME={cpp_extension.CUDA_HOME}, "
          f"MAX_JOBS={os.environ['MAX_JOBS']}); the wheel requires {torch_requirement}:")
    for c in configs:
        print(f"  {c.family} {c.direction} {c.dtype} hdim{c.hdim}")
    print(f"  CUTLASS: {cutlass_include}")

    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "-lineinfo",
        # CUTLASS's pipeline debug checks put a branch into every mbarrier wait, and ptxas waits
        # for all WGMMAs before it: no FA3 overlap survives them.
        "-DNDEBUG",
        "--expt-relaxed-constexpr",
        # torch's COMMON_NVCC_FLAGS hide the half / bfloat16 operators; the kernels use them.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        # Explicit -gencode flags keep TORCH_CUDA_ARCH_LIST out.
        *build_matrix.gencode_flags(archs, ptx),
    ]
    extension = cpp_extension.CUDAExtension(
        name="flash_attn._C",
        sources=sources,
        # csrc/ for "common/...", "fa2/..."; CUTLASS for the CuTe headers of the fa2 kernels.
        include_dirs=[str(ROOT / "csrc"), str(cutlass_include)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
    )

    class TimedBuildExtension(cpp_extension.BuildExtension):
        def build_extensions(self) -> None:
            start = time.perf_counter()
            ok = False
            try:
                super().build_extensions()
                ok = True
            finally:
                print(f"flash-attn: {'built' if ok else 'FAILED to build'} flash_attn._C "
                      f"({len(configs)} kernels x {len(archs)} archs"
                      f"{' + PTX' if ptx else ''}) in "
                      f"{time.perf_counter() - start:.1f} s")

    return extension, TimedBuildExtension.with_options(use_ninja=True), torch_requirement


# pyproject.toml declares `dependencies` dynamic: they are these install_requires.
if _flag("FLASH_ATTN_SKIP_CUDA_BUILD"):
    ext_modules, cmdclass, install_requires = [], {}, ["torch"]
    # An extension left in build/lib by an earlier full build would otherwise ship in this wheel.
    for stale in glob.glob("build/lib*/flash_attn/_C*.so"):
        os.remove(stale)
else:
    _extension, _build_ext, _torch_req = _cuda_extension()
    ext_modules, cmdclass, install_requires = [_extension], {"build_ext": _build_ext}, [_torch_req]

setup(
    version=_version(),
    packages=["flash_attn"],
    package_dir={"": "src"},
    include_package_data=False,
    install_requires=install_requires,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
