"""The package on a machine without a GPU or without its compiled extension."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_attn
from flash_attn import _ops

ROOT = Path(__file__).resolve().parents[1]


def test_version_file_is_one_line_setup_py_can_read():
    text = (ROOT / "src" / "flash_attn" / "_version.py").read_text()
    assert re.fullmatch(r'__version__ = "2\.\d+\.\d+"\n', text), text


def test_version_is_the_distributions():
    from flash_attn._version import __version__ as source
    try:
        expected = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        expected = source
    assert flash_attn.__version__ == expected
    # Libraries gate on a 2.x version of the flash-attn distribution.
    assert flash_attn.__version__.startswith("2.")


def test_import_does_not_load_the_extension():
    code = "import sys, flash_attn; print('flash_attn._C' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_public_names():
    for name in flash_attn.__all__:
        assert hasattr(flash_attn, name), name
    # What HF transformers and others import by name.
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
                 "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"):
        assert callable(getattr(flash_attn, name))
    from flash_attn.flash_attn_interface import flash_attn_func
    assert flash_attn_func is flash_attn.flash_attn_func


def test_available_backends_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash_attn.available_backends() == []


def test_available_backends_without_extension(monkeypatch):
    monkeypatch.setattr(_ops, "_EXTENSION", "flash_attn._C_not_built_here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flash_attn.available_backends() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_available_backends_on_this_machine():
    assert flash_attn.available_backends() == []


def test_cpu_call_raises_a_clear_error():
    q = torch.randn(1, 4, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"q must be on a CUDA device, got cpu"):
        flash_attn.flash_attn_func(q, q, q)
