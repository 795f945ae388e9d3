"""Where the CUTLASS / CuTe headers are: the one place that decides it.

setup.py imports this file by path and CMakeLists.txt runs it (``python3
third_party/find_cutlass.py`` prints the include directory), so both builds compile against the
same headers. Standard library only: it runs before torch or the package is importable.

Order:
1. ``CUTLASS_DIR``: a CUTLASS checkout (its ``include/``) or the include directory itself.
2. ``third_party/cutlass``: a checkout or submodule next to this file.
3. The ``nvidia-cutlass`` pip package, which ships the headers in
   ``cutlass_library/source/include``. Found without importing it (importing pulls in its
   Python dependencies, which a build does not need).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping

_MARKER = Path("cutlass") / "cutlass.h"

HOW_TO_FIX = ("install the headers with `pip install nvidia-cutlass`, or point CUTLASS_DIR at a "
              "CUTLASS checkout (the directory that holds include/cutlass/cutlass.h)")


class CutlassNotFound(RuntimeError):
    pass


def _include_dir_of(root: Path) -> Path | None:
    for candidate in (root / "include", root):
        if (candidate / _MARKER).is_file():
            return candidate.resolve()
    return None


def _from_pip_package() -> Path | None:
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = _include_dir_of(Path(location) / "source")
        if found is not None:
            return found
    return None


def cutlass_include_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The directory to pass as -I so that ``#include <cutlass/cutlass.h>`` resolves."""
    override = env.get("CUTLASS_DIR", "").strip()
    if override:
        found = _include_dir_of(Path(override).expanduser())
        if found is None:
            raise CutlassNotFound(f"CUTLASS_DIR={override!r} holds no include/{_MARKER.as_posix()} "
                                  f"nor {_MARKER.as_posix()}; {HOW_TO_FIX}")
        return found
    found = _include_dir_of(Path(__file__).resolve().parent / "cutlass")
    if found is None:
        found = _from_pip_package()
    if found is None:
        raise CutlassNotFound(f"CUTLASS headers not found: {HOW_TO_FIX}")
    return found


if __name__ == "__main__":
    try:
        print(cutlass_include_dir())
    except CutlassNotFound as e:
        print(f"find_cutlass: {e}", file=sys.stderr)
        sys.exit(1)
