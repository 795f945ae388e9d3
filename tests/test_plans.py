"""The kernel families' per-call plans, on the CPU: tests/cpp/*.cpp, built with the host C++
compiler against csrc/ and run. The plans are pure host logic (which kernel, grid, workspace),
so they need no GPU; the GPU suites check that the kernels they pick compute the right thing.
Index helpers of the device code (the backward's query tiles and its deterministic order) are
checked the same way, compiled for the host."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "third_party"))
import find_cutlass  # noqa: E402


def _needs_cute(name):
    return "#include \"common/" in (ROOT / "tests" / "cpp" / f"{name}.cpp").read_text()


CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (c++, g++ or $CXX)")
@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "tests" / "cpp").glob("*.cpp")))
def test_plan(name, tmp_path):
    exe = tmp_path / name
    # Family headers that include cuda_runtime.h (for __host__ __device__) need the toolkit's
    # headers; the plans themselves never call CUDA.
    nvcc = shutil.which("nvcc")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             nvcc and str(Path(nvcc).resolve().parent.parent)]
    cuda_flags = [f"-I{Path(h) / 'include'}" for h in homes
                  if h and (Path(h) / "include" / "cuda_runtime.h").exists()][:1]
    # Tests of device-side helpers (the mask, the query tiles) include CuTe, which needs
    # CUTLASS's headers and the toolkit's libcu++ (include/cccl).
    if _needs_cute(name):
        if not cuda_flags:
            pytest.skip("no CUDA toolkit headers, which CuTe needs")
        try:
            cutlass = find_cutlass.cutlass_include_dir()
        except find_cutlass.CutlassNotFound as e:
            pytest.skip(str(e))
        cccl = Path(cuda_flags[0][2:]) / "cccl"
        cuda_flags += [f"-I{cutlass}"] + ([f"-I{cccl}"] if cccl.is_dir() else [])
    build = subprocess.run([CXX, "-std=c++17", "-O1", "-Wall", f"-I{ROOT / 'csrc'}", *cuda_flags,
                            str(ROOT / "tests" / "cpp" / f"{name}.cpp"), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
