"""The kernel families' per-call plans, on the CPU: tests/cpp/*.cpp, built with the host C++
compiler against csrc/ and run. The plans are pure host logic (which kernel, grid, workspace),
so they need no GPU; the GPU suites check that the kernels they pick compute the right thing."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    build = subprocess.run([CXX, "-std=c++17", "-O1", "-Wall", f"-I{ROOT / 'csrc'}", *cuda_flags,
                            str(ROOT / "tests" / "cpp" / f"{name}.cpp"), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
