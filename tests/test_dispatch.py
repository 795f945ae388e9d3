"""The dispatch table: automatic choice per arch, forcing by env var / backend=, and the errors.

Most tests run ``choose`` (pure) against the build matrix (fa1, fa2) plus a stand-in fa3 family,
so the rules are exercised before that family exists; the rest go through the public functions
with the CPU stand-in extension (tests/conftest.py).
"""

import re
import sys
import warnings

import pytest
import torch

import flash_attn
from flash_attn import _dispatch as D, _ops, build_matrix
from conftest import matrix_configs

ALL = frozenset({"causal", "gqa", "local", "softcap", "alibi", "dropout"})


@pytest.fixture
def three_families(monkeypatch):
    """FAMILIES as they will look with fa3: fa3 forward-only without alibi / dropout."""
    families = dict(build_matrix.FAMILIES)
    assert families["fa2"].features == ALL
    families["fa3"] = build_matrix.Family(
        "fa3", 90, {"fp16": 90, "bf16": 90}, (64, 128, 256), ("fwd",),
        frozenset({"causal", "gqa", "local", "softcap"}))
    monkeypatch.setattr(build_matrix, "FAMILIES", families)
    D._DECISIONS.clear()
    return families


def built(*families):
    return frozenset(D.BuiltConfig(*row) for row in matrix_configs(families))


def choose(arch, dtype="fp16", hdim=128, features=(), requested=None, need_bwd=False,
           families=("fa1", "fa2", "fa3")):
    return D.choose(arch, dtype, hdim, features, requested, need_bwd=need_bwd, built=built(*families))


# ---- automatic choice -------------------------------------------------------------------------

@pytest.mark.parametrize("arch,expected", [(90, "fa3"), (80, "fa2"), (86, "fa2"), (89, "fa2"), (75, "fa1")])
def test_arch_preference(three_families, arch, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        assert choose(arch) == expected


def test_sm90_without_fa3_built_falls_back_visibly(three_families):
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa2 instead of fa3, the preferred family on sm90, because this build has no fa3 fwd kernel"):
        assert choose(90, families=("fa1", "fa2")) == "fa2"


def test_feature_the_preferred_family_lacks_falls_back(three_families):
    with pytest.warns(D.BackendFallbackWarning, match=r"fa3 does not support alibi_slopes"):
        assert choose(90, features={"causal", "alibi"}) == "fa2"


def test_training_skips_a_forward_only_family(three_families):
    with pytest.warns(D.BackendFallbackWarning, match=r"no fa3 bwd kernel"):
        assert choose(90, need_bwd=True) == "fa2"


def test_head_dim_beyond_fa1_goes_to_fa2(three_families):
    assert choose(80, hdim=192) == "fa2"
    with pytest.raises(NotImplementedError, match=r"fa1: fa1 supports head dims up to 128, got 192"):
        choose(75, hdim=192)


def test_only_fa1_built_on_sm80(three_families):
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa2"):
        assert choose(80, dtype="bf16", families=("fa1",)) == "fa1"


def test_real_matrix_has_no_fallback_warning():
    # fa3 is not implemented yet, so sm90's first choice is fa2: nothing to warn about.
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        for arch, family in ((75, "fa1"), (80, "fa2"), (86, "fa2"), (90, "fa2")):
            assert D.choose(arch, "fp16", 64, {"causal"}, built=built("fa1", "fa2")) == family
            assert D.choose(arch, "fp16", 64, {"causal", "gqa"}, need_bwd=True,
                            built=built("fa1", "fa2")) == family


@pytest.mark.parametrize("feature", ["local", "softcap", "alibi", "dropout"])
def test_fa2_features_on_the_real_matrix(feature):
    b = built("fa1", "fa2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        for arch in (80, 90):
            assert D.choose(arch, "bf16", 128, {"causal", feature}, need_bwd=True, built=b) == "fa2"
    with pytest.raises(NotImplementedError, match=rf"backend='fa1' cannot run this call .*: fa1 does not support {re.escape(D._FEATURE_TEXT[feature])}\. backend='fa2' would run it"):
        D.choose(80, "fp16", 64, {feature}, "fa1", built=b)
    # On sm75 nothing runs it; the error says which family would, and on what GPU.
    with pytest.raises(NotImplementedError, match=r"fa2: fa2 needs sm80\+, this GPU is sm75.*families with every feature of this call: fa2 \(sm80\+\)"):
        D.choose(75, "fp16", 64, {feature}, built=b)


def test_fa2_head_dims_past_fa1():
    b = built("fa1", "fa2")
    assert D.choose(80, "fp16", 200, (), built=b) == "fa2"
    assert D.why_not("fa2", 80, "fp16", 256, (), ("fwd", "bwd"), b) is None
    with pytest.raises(NotImplementedError, match=r"fa1 supports head dims up to 128, got 200"):
        D.choose(75, "fp16", 200, (), built=b)


def test_nothing_can_run(three_families):
    with pytest.raises(NotImplementedError) as err:
        choose(75, dtype="bf16")
    msg = str(err.value)
    assert "no backend in this build can run this call (sm75, bf16, head dim 128, fwd" in msg
    assert "fa3: fa3 needs sm90+, this GPU is sm75" in msg
    assert "fa1: fa1 runs bf16 on sm80+ only" in msg


def test_feature_no_family_has(three_families, monkeypatch):
    del three_families["fa2"]
    with pytest.raises(NotImplementedError, match=r"No backend in this version supports dropout_p > 0"):
        choose(90, features={"dropout"}, families=("fa1", "fa3"))


def test_trimmed_build(three_families):
    # FLASH_ATTN_HDIMS=128 FLASH_ATTN_DTYPES=fp16 FLASH_ATTN_FAMILIES=fa1: hdim 64 runs on the
    # 128 kernel; bf16 has no kernel and says how to get one.
    only = frozenset(c for c in built("fa1") if c.hdim == 128 and c.dtype == "fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", D.BackendFallbackWarning)
        assert D.choose(80, "fp16", 64, (), built=only) == "fa1"
        with pytest.raises(NotImplementedError, match=r"this build has no fa1 fwd kernel for bf16 head dim 64 \(built: bwd fp16 hdim128, fwd fp16 hdim128\); rebuild with FLASH_ATTN_FAMILIES / FLASH_ATTN_DTYPES / FLASH_ATTN_HDIMS"):
            D.choose(80, "bf16", 64, (), requested="fa1", built=only)


def test_head_dim_padding_picks_the_kernel():
    # 120 pads to 128; 129 pads to 136, past fa1's largest kernel.
    b = built("fa1")
    assert D.why_not("fa1", 80, "fp16", 120, (), ("fwd", "bwd"), b) is None
    assert "up to 128, got 129" in D.why_not("fa1", 80, "fp16", 129, (), ("fwd",), b)


# ---- forcing ----------------------------------------------------------------------------------

def test_forced_family_runs_when_it_can(three_families):
    assert choose(90, requested="fa1") == "fa1"
    assert choose(90, requested="fa2") == "fa2"


def test_forced_family_that_cannot_run(three_families):
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call \(sm80, .*\): fa3 needs sm90\+, this GPU is sm80\. backend='fa2' would run it"):
        choose(80, requested="fa3")
    with pytest.raises(NotImplementedError, match=r"backend='fa1' cannot run this call .*: fa1 does not support softcap > 0\. backend='fa3' would run it"):
        choose(90, features={"softcap"}, requested="fa1")


def test_forcing_an_unimplemented_family():
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*: fa3 is not implemented in this version of flash_attn \(implemented: fa1, fa2\)\. backend='fa2' would run it"):
        D.choose(90, "fp16", 64, (), "fa3", built=built("fa1", "fa2"))


def test_requested_backend(monkeypatch):
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    assert D.requested_backend(None) is None
    assert D.requested_backend("fa2") == "fa2"
    assert D.requested_backend("auto") is None
    monkeypatch.setenv(D.ENV_VAR, "FA1")
    assert D.requested_backend(None) == "fa1"
    assert D.requested_backend("fa3") == "fa3"      # per call wins over the environment
    assert D.requested_backend("auto") is None      # ... including an explicit 'auto'
    monkeypatch.setenv(D.ENV_VAR, "auto")
    assert D.requested_backend(None) is None
    monkeypatch.setenv(D.ENV_VAR, "")
    assert D.requested_backend(None) is None


def test_bad_backend_names(monkeypatch):
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=r"backend='flash' is not a backend; supported: 'auto', 'fa3', 'fa2', 'fa1' or None"):
        D.requested_backend("flash")
    monkeypatch.setenv(D.ENV_VAR, "fa9")
    with pytest.raises(ValueError, match=r"FLASH_ATTN_BACKEND='fa9' is not a backend; supported: 'auto', 'fa3', 'fa2', 'fa1'"):
        D.requested_backend(None)


# ---- through the public functions (CPU stand-in for the extension) ----------------------------

def _qkv(d=64, dtype=torch.float16, h=4, hk=4):
    return (torch.randn(2, 5, h, d).to(dtype), torch.randn(2, 7, hk, d).to(dtype),
            torch.randn(2, 7, hk, d).to(dtype))


def test_env_var_is_read_at_call_time(fake_ext, monkeypatch):
    q, k, v = _qkv()
    assert flash_attn.select_backend(q, k, v) == "fa2"
    monkeypatch.setenv(D.ENV_VAR, "fa1")
    flash_attn.flash_attn_func(q, k, v)
    assert fake_ext.calls[-1][:2] == ("fwd", "fa1")
    with pytest.raises(NotImplementedError, match=r"backend='fa1' cannot run this call .*backend='fa2' would run it"):
        flash_attn.flash_attn_func(q, k, v, softcap=10.0)
    # backend= overrides the environment, both ways.
    flash_attn.flash_attn_func(q, k, v, backend="fa2")
    assert fake_ext.calls[-1][:2] == ("fwd", "fa2")
    flash_attn.flash_attn_func(q, k, v, backend="auto")
    assert fake_ext.calls[-1][:2] == ("fwd", "fa2")
    monkeypatch.setenv(D.ENV_VAR, "fa3")
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call"):
        flash_attn.flash_attn_func(q, k, v)
    monkeypatch.setenv(D.ENV_VAR, "fa1")
    assert flash_attn.select_backend(q, k, v) == "fa1"


def test_select_backend_reports_the_calls_choice(fake_ext, three_families):
    fake_ext.configs = matrix_configs(("fa1", "fa2", "fa3"))
    q, k, v = _qkv()
    for arch, family in ((90, "fa3"), (80, "fa2"), (75, "fa1")):
        fake_ext.arch = arch
        assert flash_attn.select_backend(q, k, v, causal=True) == family
        flash_attn.flash_attn_func(q, k, v, causal=True)
        assert fake_ext.calls[-1][:2] == ("fwd", family)
    fake_ext.arch = 90
    q.requires_grad_()
    with pytest.warns(D.BackendFallbackWarning, match=r"no fa3 bwd kernel"):
        assert flash_attn.select_backend(q, k, v) == "fa2"
    with torch.no_grad():
        assert flash_attn.select_backend(q, k, v) == "fa3"
    assert flash_attn.select_backend(q, k, v, backend="fa1") == "fa1"


def test_missing_extension(monkeypatch):
    monkeypatch.setattr(_ops, "_EXTENSION", "flash_attn._C_not_built_here")
    with pytest.raises(RuntimeError, match=r"installed without its CUDA kernels.*FLASH_ATTN_SKIP_CUDA_BUILD=1.*pip install --no-build-isolation"):
        D.built_configs()
    # The traced entry point returns the error for traced code to raise (see _decide).
    assert D._decide(80, "fp16", 64, frozenset(), None, False)[:2] == ("", "RuntimeError")


def test_missing_extension_through_the_call(fake_ext, monkeypatch):
    monkeypatch.setattr(_ops, "_EXTENSION", "flash_attn._C_not_built_here")
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"flash_attn was installed without its CUDA kernels"):
        flash_attn.flash_attn_func(q, k, v)
    assert flash_attn.available_backends() == []


def test_broken_extension_keeps_the_loader_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn._C", None)    # makes the import fail
    monkeypatch.setattr(_ops.importlib, "import_module", _raise(ImportError("undefined symbol: _ZN3c10")))
    with pytest.raises(RuntimeError, match=r"flash_attn._C is installed but failed to load: undefined symbol: _ZN3c10"):
        _ops.extension()


def _raise(exc):
    def f(*args, **kwargs):
        raise exc
    return f


# ---- available_backends -----------------------------------------------------------------------

def test_available_backends_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash_attn.available_backends() == []
    assert flash_attn.available_backends("cuda:0") == []


def test_available_backends(fake_ext, monkeypatch, three_families):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake_ext.configs = matrix_configs(("fa1", "fa2", "fa3"))
    for arch, expected in ((90, ["fa3", "fa2", "fa1"]), (86, ["fa2", "fa1"]), (75, ["fa1"]), (70, [])):
        fake_ext.arch = arch
        assert flash_attn.available_backends() == expected
        assert flash_attn.available_backends(0) == expected
    fake_ext.arch = 90
    fake_ext.configs = matrix_configs(("fa1",))
    assert flash_attn.available_backends("cuda:0") == ["fa1"]
    assert flash_attn.available_backends("cpu") == []


def test_decisions_are_memoised(fake_ext):
    q, k, v = _qkv()
    flash_attn.flash_attn_func(q, k, v)
    n = len(D._DECISIONS)
    flash_attn.flash_attn_func(q, k, v)
    assert len(D._DECISIONS) == n == 1


def test_build_without_code_for_this_arch(fake_ext, monkeypatch):
    """A build for sm90 only cannot run on an sm80 GPU: a clear error, no launch, and
    available_backends() says nothing runs."""
    fake_ext.built_archs = lambda: [90]
    D._BUILT_CACHE.clear()
    D._DECISIONS.clear()
    family, error, message = D._decide(80, "fp16", 64, frozenset(), None, False)
    assert (family, error) == ("", "RuntimeError")
    assert "sm90" in message and "sm80" in message and "FLASH_ATTN_CUDA_ARCHS" in message
    assert D._decide(90, "fp16", 64, frozenset(), None, False)[0] == "fa2"
    D._BUILT_CACHE.clear()


def test_sm75_only_build_on_an_sm80_gpu(fake_ext, monkeypatch):
    """FLASH_ATTN_CUDA_ARCHS=75 on an A100: the sm75 PTX runs, but fa2's kernels are empty in it
    (they need sm80), so fa1 runs, visibly, and a forced fa2 says why not."""
    fake_ext.built_archs = lambda: [75]
    D._BUILT_CACHE.clear()
    D._DECISIONS.clear()
    q, k, v = _qkv()
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa2.*fa2 fp16 kernels need code for sm80\+ that runs on sm80, and its targets are sm75; rebuild with FLASH_ATTN_CUDA_ARCHS including 80"):
        assert flash_attn.select_backend(q, k, v) == "fa1"
    with pytest.raises(NotImplementedError, match=r"backend='fa2' cannot run this call .*targets are sm75"):
        flash_attn.flash_attn_func(q, k, v, backend="fa2")
    with pytest.raises(NotImplementedError, match=r"fa1 runs bf16|kernels need code for sm80"):
        flash_attn.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert flash_attn.available_backends() == ["fa1"]
    fake_ext.built_archs = lambda: [75, 80]
    D._BUILT_CACHE.clear()
    assert flash_attn.available_backends() == ["fa2", "fa1"]
    D._BUILT_CACHE.clear()
