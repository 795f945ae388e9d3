"""Shared test helpers.

GPU tests
---------
Mark a test (or a module, with ``pytestmark = requires_gpu``) that needs a CUDA device and the
compiled ``flash_attn._C``::

    from conftest import requires_gpu, requires_backend

    @requires_gpu                      # same as @pytest.mark.gpu
    def test_something(): ...

    @requires_backend("fa2")           # also skips unless this build runs fa2 on this GPU
    def test_fa2_only(): ...

Items marked ``gpu`` are skipped, with the reason, when ``gpu_skip_reason()`` is not None (no
CUDA device, or the package was installed without its kernels), so CPU CI runs the same files.
The ``cuda_device`` fixture does the same for a single test and returns ``torch.device('cuda')``.

CPU tests of the frontend
-------------------------
The ``fake_ext`` fixture drives the whole frontend on CPU: it installs ``FakeExtension`` (a
pure-PyTorch ``flash_attn._C`` with the real one's functions), lets CPU tensors through the
device check and pretends the device is ``fake_ext.arch`` (80 unless a test changes it).
"""

import functools
import math
import sys
import types

import pytest
import torch

import flash_attn
from flash_attn import _dispatch, _validate, build_matrix


# ---- GPU tests --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when GPU tests can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _dispatch.built_configs()
    except RuntimeError as e:
        return f"flash_attn._C is not usable: {e}"
    return None


requires_gpu = pytest.mark.gpu


def requires_backend(family):
    """Mark: needs a GPU on which this build runs ``family`` (also marks the test ``gpu``)."""
    return pytest.mark.backend(family)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and the built extension")
    config.addinivalue_line("markers", "backend(name): needs a GPU on which this build runs name")


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("backend")
        if marker is not None:
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") is None:
            continue
        reason = gpu_skip_reason()
        if reason is None and marker is not None:
            family = marker.args[0]
            if family not in flash_attn.available_backends():
                reason = (f"this build does not run {family} on this GPU (available: "
                          f"{flash_attn.available_backends()})")
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def cuda_device():
    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda")


# ---- a pure-PyTorch stand-in for flash_attn._C ------------------------------------------------

def _probs(q, k, softmax_scale, causal):
    """(probs, lse) in fp32, (b, h, sq, sk) / (b, h, sq), K already expanded to q's heads."""
    scores = q @ k.transpose(-1, -2) * softmax_scale
    if causal:
        sq, sk = scores.shape[-2:]
        i = torch.arange(sq).unsqueeze(1)
        j = torch.arange(sk).unsqueeze(0)
        scores = scores.masked_fill(j > i + sk - sq, -math.inf)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return probs, lse


def _heads_first(q, k, v):
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))    # (b, h, s, d)
    group = qf.shape[1] // kf.shape[1]
    return qf, kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1), group


def naive_attention(q, k, v, softmax_scale, causal):
    """fp32 reference: (out, lse) in the kernels' layouts and conventions (bottom-right causal,
    lse +inf and out 0 for a row that sees no key)."""
    qf, kf, vf, _ = _heads_first(q, k, v)
    probs, lse = _probs(qf, kf, softmax_scale, causal)
    out = (probs @ vf).transpose(1, 2)
    return out, torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def naive_attention_bwd(dout, q, k, v, softmax_scale, causal):
    """fp32 (dq, dk, dv) of naive_attention, written out: an op implementation runs below
    autograd, so it cannot call torch.autograd.grad."""
    qf, kf, vf, group = _heads_first(q, k, v)
    do = dout.float().transpose(1, 2)
    probs, _ = _probs(qf, kf, softmax_scale, causal)
    dv = probs.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
    dq = ds @ kf * softmax_scale
    dk = ds.transpose(-1, -2) @ qf * softmax_scale
    b, h, sk, d = dk.shape
    # GQA: a K/V head's gradient is the sum over the query heads that read it.
    dk, dv = (t.view(b, h // group, group, sk, d).sum(2) for t in (dk, dv))
    return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


class FakeExtension(types.ModuleType):
    """flash_attn._C's functions computed by the naive reference; records its calls."""

    def __init__(self, configs):
        super().__init__("flash_attn._C")
        self.configs = configs
        self.calls = []

    @property
    def configs(self):
        return self._configs

    @configs.setter
    def configs(self, rows):
        # A test may change what the "build" contains; drop what dispatch cached about it.
        self._configs = list(rows)
        _dispatch._BUILT_CACHE.pop(self, None)
        _dispatch._DECISIONS.clear()

    def built_configs(self):
        return list(self.configs)

    def fwd(self, q, k, v, out, lse, softmax_scale, causal, family):
        self.calls.append(("fwd", family, tuple(q.shape), softmax_scale, causal))
        o, l = naive_attention(q, k, v, softmax_scale, causal)
        out.copy_(o)
        lse.copy_(l)

    def bwd(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic,
            family):
        self.calls.append(("bwd", family, tuple(q.shape), softmax_scale, causal, deterministic))
        grads = naive_attention_bwd(dout, q, k, v, softmax_scale, causal)
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)


def matrix_configs(families=None, archs_ok=True):
    """built_configs() tuples for the whole build matrix (optionally some families only)."""
    rows = []
    for c in build_matrix.all_configs():
        if families is not None and c.family not in families:
            continue
        fam = build_matrix.FAMILIES[c.family]
        rows.append((c.family, c.direction, c.dtype, c.hdim,
                     max(fam.min_arch, fam.dtype_min_arch[c.dtype])))
    return rows


@pytest.fixture
def fake_ext(monkeypatch):
    ext = FakeExtension(matrix_configs())
    ext.arch = 80
    monkeypatch.setitem(sys.modules, "flash_attn._C", ext)
    monkeypatch.setattr(_validate, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(_dispatch, "device_arch", lambda device: ext.arch)
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    _dispatch._DECISIONS.clear()
    yield ext
    _dispatch._DECISIONS.clear()
