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

Items marked ``gpu`` are skipped, with the reason, where there is no CUDA device, so CPU CI
runs the same files. Where there is one, a missing, unloadable or stale extension (built from
other sources than this checkout's csrc/) stops the session with the reason instead: a GPU run
that skipped its GPU tests would look like a pass. The ``cuda_device`` fixture returns
``torch.device('cuda')``, skipping without a device.

CPU tests of the frontend
-------------------------
The ``fake_ext`` fixture drives the whole frontend on CPU: it installs ``FakeExtension`` (a
pure-PyTorch ``flash_attn._C`` with the real one's functions), lets CPU tensors through the
device check and pretends the device is ``fake_ext.arch`` (80 unless a test changes it).
"""

import dataclasses
import functools
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import flash_attn
from flash_attn import _dispatch, _validate, build_matrix, reference


# ---- GPU tests --------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when GPU tests can run here, "no CUDA device" where they skip."""
    return None if torch.cuda.is_available() else "no CUDA device"


@functools.lru_cache(maxsize=None)
def extension_problem():
    """Why this GPU machine cannot run the GPU tests: no usable flash_attn._C, or one built
    from other sources than this checkout's csrc/. None if it can."""
    try:
        _dispatch.built_configs()
    except RuntimeError as e:
        return f"flash_attn._C is not usable: {e}"
    ext = sys.modules["flash_attn._C"]
    if (ROOT / "csrc").is_dir():
        ours, built = build_matrix.source_hash(ROOT), getattr(ext, "source_hash", lambda: "")()
        if built != ours:
            return (f"flash_attn._C ({ext.__file__}) was built from other sources than "
                    f"{ROOT / 'csrc'} (source hash {built or 'unrecorded'}, checkout {ours}): "
                    "rebuild it (README: Install)")
    return None


requires_gpu = pytest.mark.gpu


def requires_backend(family):
    """Mark: needs a GPU on which this build runs ``family`` (also marks the test ``gpu``)."""
    return pytest.mark.backend(family)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and the built extension")
    config.addinivalue_line("markers", "backend(name): needs a GPU on which this build runs name")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")
                 or item.get_closest_marker("backend")]
    if gpu_items and gpu_skip_reason() is None and extension_problem() is not None:
        pytest.exit(f"{len(gpu_items)} GPU tests cannot run on this GPU machine: "
                    f"{extension_problem()}", returncode=3)
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
def every_call_long(monkeypatch):
    """Calls of every length count as long (no feature short_q), so fa3's own backward takes
    the short shapes of a test too; the validated-call memo is emptied around the test, as it
    holds features."""
    monkeypatch.setattr(build_matrix, "SHORT_Q_ROWS", 0)
    _validate._VALID.clear()
    yield
    _validate._VALID.clear()


@pytest.fixture
def cuda_device():
    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda")


# ---- a pure-PyTorch stand-in for flash_attn._C ------------------------------------------------

def _probs(q, k, softmax_scale, causal, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """(probs, lse, tanh) in fp32, (b, h, sq, sk) / (b, h, sq), K already expanded to q's heads;
    tanh is the softcap's tanh(scores / softcap) (for the backward), None without softcap."""
    scores = q @ k.transpose(-1, -2) * softmax_scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
    sq, sk = scores.shape[-2:]
    if alibi_slopes is not None:
        scores = scores + reference.alibi_bias(alibi_slopes, sq, sk).float()
    visible = reference.attention_mask(sq, sk, causal, window, device=scores.device)
    scores = scores.masked_fill(~visible, -math.inf)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return probs, lse, tanh


def _heads_first(q, k, v):
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))    # (b, h, s, d)
    group = qf.shape[1] // kf.shape[1]
    return qf, kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1), group


def _dropped(p, keep, dropout_p):
    return p if keep is None else p * keep / (1.0 - dropout_p)


def naive_attention(q, k, v, softmax_scale, causal, window=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, keep=None):
    """fp32 reference: (out, lse) in the kernels' layouts and conventions (bottom-right causal,
    lse +inf and out 0 for a row that sees no key). keep: (b, h, sq, sk) bool dropout mask."""
    qf, kf, vf, _ = _heads_first(q, k, v)
    probs, lse, _ = _probs(qf, kf, softmax_scale, causal, window, softcap, alibi_slopes)
    out = (_dropped(probs, keep, dropout_p) @ vf).transpose(1, 2)
    return out, torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def naive_attention_bwd(dout, q, k, v, softmax_scale, causal, window=(-1, -1), softcap=0.0,
                        alibi_slopes=None, dropout_p=0.0, keep=None):
    """fp32 (dq, dk, dv) of naive_attention, written out: an op implementation runs below
    autograd, so it cannot call torch.autograd.grad."""
    qf, kf, vf, group = _heads_first(q, k, v)
    do = dout.float().transpose(1, 2)
    probs, _, tanh = _probs(qf, kf, softmax_scale, causal, window, softcap, alibi_slopes)
    dv = _dropped(probs, keep, dropout_p).transpose(-1, -2) @ do
    dp = _dropped(do @ vf.transpose(-1, -2), keep, dropout_p)
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)     # d(softcap * tanh(s / softcap)) / ds
    dq = ds @ kf * softmax_scale
    dk = ds.transpose(-1, -2) @ qf * softmax_scale
    b, h, sk, d = dk.shape
    # GQA: a K/V head's gradient is the sum over the query heads that read it.
    dk, dv = (t.view(b, h // group, group, sk, d).sum(2) for t in (dk, dv))
    return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


class FakeExtension(types.ModuleType):
    """flash_attn._C's functions computed by the naive reference; records its calls, with the
    family each was asked for, and refuses a family / direction / dtype / head dim that its
    ``configs`` (the "build") lacks, as the real one's kernel lookup does: an fa3 forward's
    gradient must arrive as family "fa2".

    Dropout: like the real extension, the forward takes a (seed, offset) from a generator (here
    its own: a fixed seed, the offset advanced by 4 per call) and writes it to rng_state; the
    mask is a pure function of rng_state (``dropout_mask``), so the backward and
    return_attn_probs see the forward's mask. The draws are torch's, not the kernels' Philox.

    Targets: ``built_archs()`` / ``ptx_arch()`` say what ``set_targets`` set; by default ()
    and 0, a build that does not say (nothing is ruled out by arch).
    """

    SEED = 1234

    def __init__(self, configs):
        super().__init__("flash_attn._C")
        self.configs = configs
        self.calls = []
        self.offset = 0
        self.rng_states = []   # what each forward with dropout wrote
        self.set_targets((), 0)

    def set_targets(self, archs, ptx, *, has_ptx_arch=True):
        """The build's target archs and PTX arch (0: none). has_ptx_arch=False plays an
        extension built before ``ptx_arch()`` existed (it carried PTX of its newest target)."""
        self._archs, self._ptx, self._has_ptx_arch = list(archs), int(ptx), has_ptx_arch
        for key in [k for k in _dispatch._BUILT_CACHE if isinstance(k, tuple) and k[0] is self]:
            del _dispatch._BUILT_CACHE[key]
        _dispatch._DECISIONS.clear()

    def built_archs(self):
        return list(self._archs)

    @property
    def ptx_arch(self):
        if not self._has_ptx_arch:
            raise AttributeError("ptx_arch")   # getattr(ext, "ptx_arch", None) is None
        return lambda: self._ptx

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

    _DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

    def _find_kernel(self, family, direction, q):
        dtype, hdim = self._DTYPE_NAMES.get(q.dtype, str(q.dtype)), q.shape[-1]
        if not any(f == family and d == direction and t == dtype and h >= hdim
                   for f, d, t, h, _ in self.configs):
            raise RuntimeError(f"flash_attn: this build has no {family} {direction} kernel for "
                               f"dtype {dtype} and head dim {hdim} (see built_configs())")
        # The arch range (fa3 on sm90 only), as the real lookup checks min_arch and max_arch.
        arch = getattr(self, "arch", None)
        reason = None if arch is None else build_matrix.supports(family, dtype, hdim, arch)
        if reason is not None:
            raise RuntimeError(f"flash_attn: {reason}")

    @staticmethod
    def _check_family(family, window_left, window_right, causal, softcap, alibi_slopes,
                      dropout_p):
        # The real extension's second line of defence: fa1 runs causal and GQA only, fa3
        # everything but dropout.
        if family == "fa3" and dropout_p > 0:
            raise RuntimeError("flash_attn: fa3 does not support dropout; fa2 runs it")
        local = window_left >= 0 or (window_right >= 0 and not (causal or window_right == 0))
        if family == "fa1" and (local or softcap > 0 or alibi_slopes is not None
                                or dropout_p > 0):
            raise RuntimeError("flash_attn: fa1 supports causal and GQA only")

    def dropout_mask(self, rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p):
        seed, offset = (int(x) for x in rng_state.tolist())
        g = torch.Generator().manual_seed(seed * 1_000_003 + offset)
        return torch.rand(batch, heads, seqlen_q, seqlen_k, generator=g) >= dropout_p

    def _keep(self, rng_state, q, k, dropout_p):
        if dropout_p == 0:
            return None
        return self.dropout_mask(rng_state, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                                 dropout_p)

    def fp8_fwd(self, q, k, v, q_descale, k_descale, v_descale, out, lse, softmax_scale, causal,
                window_left, window_right, family, tuning=""):
        # The FP8 forward: the float64 truth of the dequantised inputs, out bf16.
        self.calls.append(("fp8_fwd", family, tuple(q.shape), softmax_scale, causal,
                           (window_left, window_right), q_descale, k_descale, v_descale))
        if not any(f == family and d == "fwd" and t == "e4m3" and h >= q.shape[-1]
                   for f, d, t, h, _ in self.configs):
            raise RuntimeError(f"flash_attn: this build has no {family} fwd kernel for dtype "
                               f"e4m3 and head dim {q.shape[-1]}")
        b, _, h, _ = q.shape
        hk = k.shape[2]

        def dequant(x, d):
            if d is None:
                return x.double()
            assert d.shape == (b, hk) and d.is_contiguous() and d.dtype == torch.float32
            per_head = d.repeat_interleave(x.shape[2] // hk, dim=1)[:, None, :, None]
            return x.double() * per_head.double()

        o, l = reference.attention_ref(dequant(q, q_descale), dequant(k, k_descale),
                                       dequant(v, v_descale), causal=causal,
                                       window_size=(window_left, window_right),
                                       softmax_scale=softmax_scale, return_lse=True)
        return o.to(torch.bfloat16), l.float()

    def fwd(self, q, k, v, out, lse, rng_state, alibi_slopes, softmax_scale, causal,
            window_left, window_right, softcap, dropout_p, family, tuning=""):
        # As the extension: None allocates the output; returns (out, lse, rng_state).
        if out is None:
            out = q.new_empty(q.shape)
        if lse is None:
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        if rng_state is None:
            rng_state = q.new_empty((2,), dtype=torch.int64)
        self.calls.append(("fwd", family, tuple(q.shape), softmax_scale, causal,
                           (window_left, window_right), softcap, alibi_slopes, dropout_p))
        self._find_kernel(family, "fwd", q)
        self._check_family(family, window_left, window_right, causal, softcap, alibi_slopes,
                           dropout_p)
        if dropout_p > 0:
            rng_state.copy_(torch.tensor([self.SEED, self.offset]))
            self.offset += 4
            self.rng_states.append(rng_state.clone())
        else:  # nothing drawn: zeros, as the extension writes them
            rng_state.zero_()
        # The truth the tests trust, in float64.
        o, l = reference.attention_ref(
            q, k, v, causal=causal, window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=alibi_slopes, softmax_scale=softmax_scale, dropout_p=dropout_p,
            dropout_mask=self._keep(rng_state, q, k, dropout_p), return_lse=True)
        out.copy_(o)
        lse.copy_(l)
        return out, lse, rng_state

    def bwd(self, dout, q, k, v, out, lse, rng_state, dq, dk, dv, alibi_slopes, softmax_scale,
            causal, window_left, window_right, softcap, dropout_p, deterministic, family,
            tuning=""):
        self.calls.append(("bwd", family, tuple(q.shape), softmax_scale, causal,
                           (window_left, window_right), softcap, alibi_slopes, dropout_p,
                           deterministic))
        self._find_kernel(family, "bwd", q)
        self._check_family(family, window_left, window_right, causal, softcap, alibi_slopes,
                           dropout_p)
        grads = naive_attention_bwd(dout, q, k, v, softmax_scale, causal,
                                    (window_left, window_right), softcap, alibi_slopes,
                                    dropout_p, self._keep(rng_state, q, k, dropout_p))
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)

    # ---- variable-length batches (the kernels' contract; see reference.attention_varlen_ref)

    def varlen_fwd(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                   max_seqlen_q, max_seqlen_k, block_table, out, lse, rng_state, alibi_slopes,
                   softmax_scale, causal, window_left, window_right, softcap, dropout_p, family,
                   tuning=""):
        out = q.new_empty(q.shape) if out is None else out
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32) if lse is None else lse
        rng_state = q.new_empty((2,), dtype=torch.int64) if rng_state is None else rng_state
        batch = cu_seqlens_q.shape[0] - 1
        self.calls.append(("varlen_fwd", family, tuple(q.shape), batch, max_seqlen_q,
                           max_seqlen_k, block_table is not None, softmax_scale, causal,
                           (window_left, window_right), softcap, alibi_slopes, dropout_p))
        self._find_kernel(family, "fwd", q)
        self._check_family(family, window_left, window_right, causal, softcap, alibi_slopes,
                           dropout_p)
        keep = None
        if dropout_p > 0:
            rng_state.copy_(torch.tensor([self.SEED, self.offset]))
            self.offset += 4
            keep = self.dropout_mask(rng_state, batch, q.shape[1], max_seqlen_q, max_seqlen_k,
                                     dropout_p)
        else:
            rng_state.zero_()
        o, l = reference.attention_varlen_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
            alibi_slopes=alibi_slopes, dropout_mask=keep, return_lse=True, causal=causal,
            window_size=(window_left, window_right), softcap=softcap,
            softmax_scale=softmax_scale, dropout_p=dropout_p)
        out.copy_(o)
        lse.copy_(l)
        return out, lse, rng_state

    def varlen_bwd(self, dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k,
                   seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, alibi_slopes,
                   softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                   deterministic, family, tuning=""):
        batch = cu_seqlens_q.shape[0] - 1
        self.calls.append(("varlen_bwd", family, tuple(q.shape), batch, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, (window_left, window_right),
                           softcap, alibi_slopes, dropout_p, deterministic))
        self._find_kernel(family, "bwd", q)
        self._check_family(family, window_left, window_right, causal, softcap, alibi_slopes,
                           dropout_p)
        keep = (None if dropout_p == 0 else
                self.dropout_mask(rng_state, batch, q.shape[1], max_seqlen_q, max_seqlen_k,
                                  dropout_p))
        # Rows and keys outside every sequence's used part get zero gradients.
        for t in (dq, dk, dv):
            t.zero_()
        for b, q0, len_q, k0, len_k in reference._sequences(cu_seqlens_q, cu_seqlens_k,
                                                            seqused_q, seqused_k):
            if len_q == 0 or len_k == 0:
                continue
            rows, keys = slice(q0, q0 + len_q), slice(k0, k0 + len_k)
            slopes = reference._sequence_slopes(alibi_slopes, b)
            grads = naive_attention_bwd(
                dout[None, rows], q[None, rows], k[None, keys], v[None, keys], softmax_scale,
                causal, (window_left, window_right), softcap,
                None if slopes is None else slopes.reshape(1, -1), dropout_p,
                None if keep is None else keep[b:b + 1, :, :len_q, :len_k])
            dq[rows] = grads[0][0].to(dq.dtype)
            dk[keys] += grads[1][0].to(dk.dtype)
            dv[keys] += grads[2][0].to(dv.dtype)

    # ---- the KV cache (reference.attention_kvcache_ref, the caches written in place)

    def kvcache_fwd(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_seqlen, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                    softmax_scale, causal, window_left, window_right, softcap,
                    rotary_interleaved, num_splits, family, tuning=""):
        self.calls.append(("kvcache_fwd", family, tuple(q.shape), tuple(k_cache.shape),
                           block_table is not None, k is not None, rotary_cos is not None,
                           softmax_scale, causal, (window_left, window_right), softcap,
                           num_splits))
        self._find_kernel(family, "fwd", q)
        self._check_family(family, window_left, window_right, causal, softcap, alibi_slopes, 0.0)
        seqlens = cache_seqlens if cache_seqlens is not None else (
            None if cache_seqlen < 0 else int(cache_seqlen))
        out, lse, k_after, v_after = reference.attention_kvcache_ref(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx,
            cache_leftpad, block_table, bool(rotary_interleaved), causal=causal,
            window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=alibi_slopes, softmax_scale=softmax_scale)
        k_cache.copy_(k_after)
        v_cache.copy_(v_after)
        return out.to(q.dtype), lse.float()


def matrix_configs(families=None, archs_ok=True):
    """built_configs() tuples for the whole build matrix (optionally some families only)."""
    rows = []
    for c in build_matrix.all_configs():
        if families is not None and c.family not in families:
            continue
        fam = build_matrix.FAMILIES[c.family]
        rows.append((c.family, c.direction, c.dtype, c.hdim,
                     fam.dtype_arch(c.dtype)))
    return rows


def give_features(monkeypatch, features, families=("fa2", "fa3")):
    """Play a build whose ``families`` have ``features`` too (build_matrix.FAMILIES, patched for
    the test), with dispatch's memo of decisions fresh for it and restored after it."""
    for name in families:
        fam = build_matrix.FAMILIES[name]
        monkeypatch.setitem(build_matrix.FAMILIES, name,
                            dataclasses.replace(fam, features=fam.features | set(features)))
    monkeypatch.setattr(_dispatch, "_DECISIONS", {})


@pytest.fixture
def fake_ext(monkeypatch):
    ext = FakeExtension(matrix_configs())
    ext.arch = 80
    ext.smem = 0  # the device's shared memory per block: unknown
    monkeypatch.setitem(sys.modules, "flash_attn._C", ext)
    monkeypatch.setattr(_validate, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(_dispatch, "device_arch", lambda device: ext.arch)
    monkeypatch.setattr(_dispatch, "device_smem", lambda device: ext.smem)
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    _dispatch._DECISIONS.clear()
    yield ext
    _dispatch._DECISIONS.clear()
