"""The dispatch table: automatic choice per arch, forcing by env var / backend=, and the errors.

Most tests run ``choose`` (pure) against the build matrix (fa1, fa2, fa3; fa3 is sm90 only, and
its gradient is fa2's backward where fa3's own does not take the call); the rest go through the
public functions with the CPU stand-in extension (tests/conftest.py).
"""

import dataclasses
import re
import sys
import warnings

import pytest
import torch

import flash_attn
from flash_attn import _dispatch as D, _ops, build_matrix
from conftest import matrix_configs

def built(*families, directions=("fwd", "bwd")):
    return frozenset(D.BuiltConfig(*row) for row in matrix_configs(families)
                     if row[1] in directions)


def choose(arch, dtype="fp16", hdim=128, features=(), requested=None, need_bwd=False,
           families=("fa1", "fa2", "fa3"), archs=(), ptx=None, smem=0):
    return D.choose(arch, dtype, hdim, features, requested, need_bwd=need_bwd,
                    built=built(*families), archs=archs, ptx=ptx, smem=smem)


@pytest.fixture
def no_fallback_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        yield


# ---- automatic choice -------------------------------------------------------------------------

@pytest.mark.parametrize("arch,expected", [(90, "fa3"), (80, "fa2"), (86, "fa2"), (89, "fa2"),
                                           (75, "fa1"), (100, "fa2"), (120, "fa2")])
@pytest.mark.parametrize("need_bwd", [False, True])
def test_arch_preference(no_fallback_warning, arch, expected, need_bwd):
    # fa3's sm_90a code runs on sm90 only: a newer GPU prefers fa2, without a warning.
    assert choose(arch, need_bwd=need_bwd) == expected
    assert D.preferred_family(arch) == expected


def test_sm90_without_fa3_built_falls_back_visibly():
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa2 instead of fa3, the preferred family on sm90, because this build has no fa3 fwd kernel"):
        assert choose(90, families=("fa1", "fa2")) == "fa2"


@pytest.mark.parametrize("need_bwd", [False, True])
def test_dropout_on_sm90_runs_fa2(need_bwd):
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa2 instead of fa3, the preferred family on sm90, because fa3 does not support dropout_p > 0"):
        assert choose(90, features={"causal", "dropout"}, need_bwd=need_bwd) == "fa2"
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*: fa3 does not support dropout_p > 0\. backend='fa2' would run it"):
        choose(90, features={"dropout"}, requested="fa3")


# KV caches on sm90: fa3 runs a cache's prefill, contiguous or paged; a decode call (few query
# rows per KV head) prefers fa2's decode kernel, and says nothing; pages that are not a multiple
# of 8 rows run fa2, visibly.
def test_kvcache_on_sm90(no_fallback_warning):
    assert choose(90, "bf16", 128, {"kvcache", "causal", "gqa"}) == "fa3"
    assert choose(90, "bf16", 128, {"kvcache", "decode", "causal", "gqa"}) == "fa2"
    assert D.preferred_family(90, {"kvcache", "decode"}) == "fa2"
    assert choose(90, "bf16", 128, {"kvcache", "decode"}, requested="fa3") == "fa3"
    assert choose(80, "bf16", 128, {"kvcache", "decode"}) == "fa2"


def test_paged_kvcache_on_sm90(no_fallback_warning):
    assert choose(90, "bf16", 128, {"kvcache", "paged_kv"}) == "fa3"
    assert choose(90, "bf16", 128, {"varlen", "paged_kv"}) == "fa3"
    assert choose(90, "bf16", 128, {"kvcache", "paged_kv", "decode"}) == "fa2"


def test_unaligned_pages_on_sm90_run_fa2_visibly():
    unaligned = {"kvcache", "paged_kv", "paged_kv_unaligned"}
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa2 instead of fa3, the preferred family on sm90, because fa3 does not support a paged K/V cache whose page_block_size is not a multiple of 8"):
        assert choose(90, "bf16", 128, unaligned) == "fa2"
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*: fa3 does not support a paged K/V cache whose page_block_size is not a multiple of 8"):
        choose(90, "bf16", 128, unaligned, requested="fa3")


def test_decode_without_fa2_built_runs_fa3_visibly():
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa3 instead of fa2, the preferred family on sm90, because this build has no fa2 fwd kernel"):
        assert choose(90, "bf16", 128, {"kvcache", "decode"}, families=("fa3",)) == "fa3"


@pytest.mark.parametrize("feature", ["local", "softcap", "alibi"])
def test_fa3_features(no_fallback_warning, feature):
    assert choose(90, "bf16", 256, {"causal", "gqa", feature}, need_bwd=True) == "fa3"


def test_training_on_sm90_runs_fa3_with_its_or_fa2s_backward(no_fallback_warning):
    b = built("fa1", "fa2", "fa3")
    assert {c.hdim for c in b if c.family == "fa3" and c.direction == "bwd"} == \
        {64, 96, 128, 192, 256}
    for hdim in (64, 128, 256):
        assert D.why_not("fa3", 90, "fp16", hdim, (), ("fwd", "bwd"), b) is None
    assert choose(90, need_bwd=True) == "fa3"


def test_fa3_gradient_needs_its_backward_kernels_at_128():
    # fa3's own backward takes head dim 128 (dense or variable-length, masks, score mods,
    # GQA): without fa2's backward fa3 still trains there, and needs fa2's for the rest.
    b = built("fa1", "fa3") | built("fa2", directions=("fwd",))
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        assert D.choose(90, "fp16", 128, {"causal", "gqa"}, need_bwd=True, built=b) == "fa3"
    no_fa3_bwd = frozenset(c for c in b if not (c.family == "fa3" and c.direction == "bwd"))
    assert "no fa3 bwd kernel for fp16 head dim 128" in \
        D.why_not("fa3", 90, "fp16", 128, (), ("fwd", "bwd"), no_fa3_bwd)
    # A short call takes fa2's backward there too; deterministic=True does not.
    assert D.why_not("fa3", 90, "fp16", 128, (), ("fwd", "bwd"), b, deterministic=True) is None
    assert "no fa2 bwd kernel (which computes fa3's gradient)" in \
        D.why_not("fa3", 90, "fp16", 128, {"short_q"}, ("fwd", "bwd"), b)
    assert D.why_not("fa3", 90, "fp16", 128, {"softcap", "local"}, ("fwd", "bwd"), b) is None


def test_fa3_gradient_needs_fa2s_backward_kernels():
    # fa2's forward kernels only: fa3 can run a forward but not the gradient of a short call
    # (fa3's backward leaves those to fa2's), nor can fa2.
    b = built("fa1", "fa3") | built("fa2", directions=("fwd",))
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        assert D.choose(90, "fp16", 96, (), built=b) == "fa3"
    no_bwd = (r"this build has no fa2 bwd kernel \(which computes fa3's gradient\) for fp16 "
              r"head dim 96 \(built: fwd bf16 hdim32, .*\); rebuild with FLASH_ATTN_FAMILIES")
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa3, the preferred family on sm90, because " + no_bwd):
        assert D.choose(90, "fp16", 96, {"short_q"}, need_bwd=True, built=b) == "fa1"
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call \(sm90, fp16, head dim 96, fwd\+bwd, .*\): " + no_bwd):
        D.choose(90, "fp16", 96, {"short_q"}, "fa3", need_bwd=True, built=b)
    # Without fa2 at all nothing else runs the call; the error says what fa3 lacks.
    with pytest.raises(NotImplementedError, match=r"fa3: this build has no fa2 bwd kernel \(which computes fa3's gradient\) for bf16 head dim 96 \(built: none\)"):
        D.choose(90, "bf16", 96, {"short_q"}, need_bwd=True, built=built("fa3"))
    # fa2's backward for some head dims only: fa3's short gradient runs where it has one.
    b = built("fa3") | frozenset(c for c in built("fa2") if c.hdim <= 128)
    assert D.why_not("fa3", 90, "fp16", 100, {"short_q"}, ("fwd", "bwd"), b) is None
    assert D.why_not("fa3", 90, "fp16", 200, (), ("fwd", "bwd"), b) is None  # fa3's own
    assert "no fa2 bwd kernel (which computes fa3's gradient) for fp16 head dim 200" in \
        D.why_not("fa3", 90, "fp16", 200, {"short_q"}, ("fwd", "bwd"), b)


def test_fa3_gradient_needs_what_fa2s_backward_supports(monkeypatch):
    # A backward family lacking a feature of the call rules out training with the forward.
    families = dict(build_matrix.FAMILIES)
    families["fa2"] = dataclasses.replace(families["fa2"],
                                          features=families["fa2"].features - {"alibi"})
    monkeypatch.setattr(build_matrix, "FAMILIES", families)
    b = built("fa2", "fa3")
    assert D.why_not("fa3", 90, "fp16", 96, {"alibi"}, ("fwd",), b) is None
    assert D.why_not("fa3", 90, "fp16", 96, {"alibi", "short_q"}, ("fwd", "bwd"), b) == (
        "the fa2 bwd kernel (which computes fa3's gradient): fa2 does not support alibi_slopes")


def test_fa3_on_a_newer_gpu():
    assert D.why_not("fa3", 100, "fp16", 64, (), ("fwd",), built("fa3")) is not None
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call \(sm100, .*\): fa3 runs on sm90(-sm90)? only \(arch-specific instructions\), this GPU is sm100\. backend='fa2' would run it"):
        choose(100, requested="fa3")
    # Only fa3 built: nothing runs on sm100, and the error says fa3 is for sm90.
    with pytest.raises(NotImplementedError, match=r"no backend in this build can run this call \(sm100.*fa3: fa3 runs on sm90"):
        choose(100, families=("fa3",))


def test_fa3_needs_sm90_machine_code():
    """The portable PTX has empty fa3 kernels: without sm_90a machine code fa3 does not run,
    and fa2 runs from the PTX instead, visibly."""
    assert D.why_not("fa3", 90, "fp16", 64, (), ("fwd",), built("fa3"), archs=(90,)) is None
    reason = D.why_not("fa3", 90, "fp16", 64, (), ("fwd",), built("fa3"), archs=(75, 80))
    assert reason == ("this build's fa3 fp16 kernels need sm90 machine code, and its targets "
                      "are sm75, sm80; rebuild with FLASH_ATTN_CUDA_ARCHS including 90")
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa2 instead of fa3.*need sm90 machine code"):
        assert choose(90, archs=(80,), ptx=80) == "fa2"
    # sm100 JIT-compiles the sm90 PTX: fa2 and fa1 run from it, fa3 does not.
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        assert choose(100, archs=(80, 90), ptx=90) == "fa2"
    for ptx in (None, 90):
        assert D.why_not("fa3", 100, "fp16", 64, (), ("fwd",), built("fa3"), archs=(80, 90),
                         ptx=ptx) is not None


def test_without_ptx_nothing_runs_on_a_newer_gpu():
    """FLASH_ATTN_CUDA_ARCHS="80;90" (no +PTX) on sm100: no family has code there, and the
    error says the build has no PTX and how to get it."""
    with pytest.raises(NotImplementedError, match=r"fa2: this build's fa2 fp16 kernels need code for sm80\+ that runs on sm100, and it has machine code for sm80, sm90 and no PTX; rebuild with FLASH_ATTN_CUDA_ARCHS including 100, or with 90\+PTX"):
        choose(100, archs=(80, 90), ptx=None)
    # PTX of a target below fa2's min_arch: fa2's kernels are empty in it; fa1 runs from it.
    assert D.why_not("fa2", 90, "fp16", 64, (), ("fwd",), built("fa2"), archs=(75, 80),
                     ptx=75) == (
        "this build's fa2 fp16 kernels need code for sm80+ that runs on sm90, and it has machine "
        "code for sm75, sm80 and PTX of sm75; rebuild with FLASH_ATTN_CUDA_ARCHS including 90, "
        "or with 80+PTX (PTX that sm90 JIT-compiles)")
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa3"):
        assert choose(90, archs=(75, 80), ptx=75, families=("fa1",)) == "fa1"


# Shared memory a block may opt into: sm80 (A100), sm86 / sm89 (RTX 30xx / 40xx, A10, L4),
# sm90 (H100).
SMEM = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@pytest.mark.parametrize("arch", [86, 89])
def test_training_where_fa2s_backward_does_not_fit(arch):
    # fa2's backward needs 106-161 KB a block, past these GPUs' 99 KB: a call that needs a
    # gradient runs fa1 where fa1 takes it (visibly).
    with pytest.warns(D.BackendFallbackWarning, match=rf"running fa1 instead of fa2, the preferred family on sm{arch}, because the fa2 bwd kernel for head dim 128 needs 161 KB of shared memory per block, and this GPU allows 99 KB"):
        assert choose(arch, "bf16", 128, {"causal"}, need_bwd=True, smem=SMEM[arch]) == "fa1"
    with pytest.warns(D.BackendFallbackWarning, match=r"fa2 bwd kernel for head dim 32 needs 106 KB"):
        assert choose(arch, hdim=20, features={"gqa"}, need_bwd=True, smem=SMEM[arch]) == "fa1"
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        assert choose(arch, "bf16", 128, {"causal"}, smem=SMEM[arch]) == "fa2"  # inference
        # Where fa1 does not take the call either, fa2's forward still runs (its backward
        # raises if it is asked for), as does a forced fa2.
        assert choose(arch, hdim=256, need_bwd=True, smem=SMEM[arch]) == "fa2"
        assert choose(arch, features={"local"}, need_bwd=True, smem=SMEM[arch]) == "fa2"
        assert choose(arch, requested="fa2", need_bwd=True, smem=SMEM[arch]) == "fa2"


def test_fa2s_backward_fits_sm80_and_sm90(no_fallback_warning):
    for hdim in (32, 64, 96, 128, 192, 256):
        assert choose(80, hdim=hdim, need_bwd=True, smem=SMEM[80]) == "fa2"
        # fa3's gradient where its own backward does not take it runs fa2's.
        assert choose(90, hdim=hdim, features={"short_q"}, need_bwd=True,
                      smem=SMEM[90]) == "fa3"


def test_head_dim_beyond_fa1_goes_to_fa2():
    assert choose(80, hdim=192) == "fa2"
    with pytest.raises(NotImplementedError, match=r"fa1: fa1 supports head dims up to 128, got 192"):
        choose(75, hdim=192)


def test_small_head_dim_on_sm90_runs_fa3():
    # fa3's smallest kernel is 64: head dim 32 runs on it, with the columns past 32 predicated off.
    assert D.why_not("fa3", 90, "fp16", 32, (), ("fwd", "bwd"), built("fa2", "fa3")) is None
    assert build_matrix.kernel_hdim("fa3", 32) == 64


def test_only_fa1_built_on_sm80():
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa2"):
        assert choose(80, dtype="bf16", families=("fa1",)) == "fa1"


def test_real_matrix_has_no_fallback_warning(no_fallback_warning):
    b = built("fa1", "fa2", "fa3")
    for arch, family in ((75, "fa1"), (80, "fa2"), (86, "fa2"), (90, "fa3"), (100, "fa2")):
        assert D.choose(arch, "fp16", 64, {"causal"}, built=b) == family
        assert D.choose(arch, "fp16", 64, {"causal", "gqa"}, need_bwd=True, built=b) == family


@pytest.mark.parametrize("feature", ["local", "softcap", "alibi", "dropout"])
def test_fa2_features_on_the_real_matrix(feature):
    b = built("fa1", "fa2", "fa3")
    with warnings.catch_warnings():
        # On sm90 fa3 runs them, except dropout, which goes to fa2 with a warning.
        warnings.simplefilter("ignore" if feature == "dropout" else "error",
                              D.BackendFallbackWarning)
        for arch, family in ((80, "fa2"), (90, "fa2" if feature == "dropout" else "fa3")):
            got = D.choose(arch, "bf16", 128, {"causal", feature}, need_bwd=True, built=b)
            assert got == family
    with pytest.raises(NotImplementedError, match=rf"backend='fa1' cannot run this call .*: fa1 does not support {re.escape(D._FEATURE_TEXT[feature])}\. backend='fa2' would run it"):
        D.choose(80, "fp16", 64, {feature}, "fa1", built=b)
    # On sm75 nothing runs it; the error says which families would, and on what GPU.
    having = "fa2 \\(sm80\\+\\)" if feature == "dropout" else "fa3 \\(sm90\\), fa2 \\(sm80\\+\\)"
    with pytest.raises(NotImplementedError, match=r"fa2: fa2 needs sm80\+, this GPU is sm75.*families with every feature of this call: " + having + r"\.$"):
        D.choose(75, "fp16", 64, {feature}, built=b)


def test_fa2_head_dims_past_fa1():
    b = built("fa1", "fa2")
    assert D.choose(80, "fp16", 200, (), built=b) == "fa2"
    assert D.why_not("fa2", 80, "fp16", 256, (), ("fwd", "bwd"), b) is None
    with pytest.raises(NotImplementedError, match=r"fa1 supports head dims up to 128, got 200"):
        D.choose(75, "fp16", 200, (), built=b)


def test_nothing_can_run():
    with pytest.raises(NotImplementedError) as err:
        choose(75, dtype="bf16")
    msg = str(err.value)
    assert "no backend in this build can run this call (sm75, bf16, head dim 128, fwd" in msg
    assert "fa3: fa3 needs sm90+, this GPU is sm75" in msg
    assert "fa1: fa1 runs bf16 on sm80+ only" in msg


def test_feature_no_family_has(monkeypatch):
    families = dict(build_matrix.FAMILIES)
    del families["fa2"]
    monkeypatch.setattr(build_matrix, "FAMILIES", families)
    with pytest.raises(NotImplementedError, match=r"No backend in this version supports dropout_p > 0"):
        choose(90, features={"dropout"}, families=("fa1", "fa3"))


def test_trimmed_build():
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

def test_forced_family_runs_when_it_can():
    assert choose(90, requested="fa1") == "fa1"
    assert choose(90, requested="fa2") == "fa2"
    assert choose(90, requested="fa3", need_bwd=True) == "fa3"


def test_forced_family_that_cannot_run():
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call \(sm80, .*\): fa3 needs sm90\+, this GPU is sm80\. backend='fa2' would run it"):
        choose(80, requested="fa3")
    with pytest.raises(NotImplementedError, match=r"backend='fa1' cannot run this call .*: fa1 does not support softcap > 0\. backend='fa3' would run it"):
        choose(90, features={"softcap"}, requested="fa1")


def test_forcing_a_family_this_build_lacks():
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*: this build has no fa3 fwd kernel for fp16 head dim 64 \(built: none\); .*\. backend='fa2' would run it"):
        D.choose(90, "fp16", 64, (), "fa3", built=built("fa1", "fa2"))


def test_forcing_an_unimplemented_family(monkeypatch):
    # A name the preference order knows but this version has no family for (as fa3 once was).
    families = dict(build_matrix.FAMILIES)
    del families["fa3"]
    monkeypatch.setattr(build_matrix, "FAMILIES", families)
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*: fa3 is not implemented in this version of flash_attn \(implemented: fa1, fa2\)\. backend='fa2' would run it"):
        D.choose(90, "fp16", 64, (), "fa3", built=built("fa1", "fa2"))
    assert D.preferred_family(90) == "fa2"


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

def _qkv(d=64, dtype=torch.float16, h=4, hk=4, sq=5):
    return (torch.randn(2, sq, h, d).to(dtype), torch.randn(2, 7, hk, d).to(dtype),
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


def test_select_backend_reports_the_calls_choice(fake_ext):
    q, k, v = _qkv()
    for arch, family in ((90, "fa3"), (80, "fa2"), (75, "fa1"), (100, "fa2")):
        fake_ext.arch = arch
        assert flash_attn.select_backend(q, k, v, causal=True) == family
        flash_attn.flash_attn_func(q, k, v, causal=True)
        assert fake_ext.calls[-1][:2] == ("fwd", family)
    fake_ext.arch = 90
    q.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)
        # The forward's family; its gradient at head dim 64 runs fa2's backward.
        assert flash_attn.select_backend(q, k, v) == "fa3"
        with torch.no_grad():
            assert flash_attn.select_backend(q, k, v) == "fa3"
    assert flash_attn.select_backend(q, k, v, backend="fa1") == "fa1"
    with pytest.warns(D.BackendFallbackWarning, match=r"fa3 does not support dropout_p > 0"):
        assert flash_attn.select_backend(q, k, v, dropout_p=0.1) == "fa2"


def test_dropout_on_sm90_runs_fa2_through_the_call(fake_ext):
    fake_ext.arch = 90
    q, k, v = (t.requires_grad_() for t in _qkv())
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa2 instead of fa3, the preferred family on sm90, because fa3 does not support dropout_p > 0"):
        out = flash_attn.flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
    out.float().sum().backward()
    assert [c[:2] for c in fake_ext.calls] == [("fwd", "fa2"), ("bwd", "fa2")]


def test_fa3_gradient_runs_fa3s_backward_where_it_takes_the_call(fake_ext):
    # At least SHORT_Q_ROWS query rows per KV head: fa3's backward, at any head dim, with or
    # without a mask or score mod, deterministic or not; fewer rows: fa2's, on the same O and
    # LSE.
    fake_ext.arch = 90
    rows = build_matrix.SHORT_Q_ROWS
    for d, shape, kwargs, bwd in (
            (128, dict(sq=rows), {}, "fa3"), (128, dict(sq=rows), {"causal": True}, "fa3"),
            (120, dict(sq=rows), {}, "fa3"), (128, dict(sq=rows // 4, hk=1), {}, "fa3"),
            (128, dict(sq=rows - 1), {}, "fa2"), (128, dict(sq=rows // 4 - 1, hk=1), {}, "fa2"),
            (128, dict(sq=rows), {"deterministic": True}, "fa3"),
            (128, dict(sq=rows), {"window_size": (2, 0)}, "fa3"),
            (128, dict(sq=rows), {"softcap": 5.0}, "fa3"), (64, dict(sq=rows), {}, "fa3"),
            (96, dict(sq=rows), {}, "fa3"), (192, dict(sq=rows), {"causal": True}, "fa3"),
            (200, dict(sq=rows), {}, "fa3"), (256, dict(sq=rows - 1), {}, "fa2")):
        q, k, v = (t.requires_grad_() for t in _qkv(d=d, **shape))
        flash_attn.flash_attn_func(q, k, v, **kwargs).float().sum().backward()
        assert [c[:2] for c in fake_ext.calls[-2:]] == [("fwd", "fa3"), ("bwd", bwd)], (
            d, shape, kwargs)


def test_training_without_fa2s_backward_on_sm90(fake_ext):
    # A build with fa3 and fa1 only: fa3 runs inference; training at head dim 64 needs fa2's
    # backward for fa3's gradient, so it runs fa1, visibly; forcing fa3 says what is missing.
    fake_ext.configs = matrix_configs(("fa1", "fa3"))
    fake_ext.arch = 90
    q, k, v = _qkv()
    flash_attn.flash_attn_func(q, k, v)
    assert fake_ext.calls[-1][:2] == ("fwd", "fa3")
    q.requires_grad_()
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa3.*no fa2 bwd kernel \(which computes fa3's gradient\)"):
        flash_attn.flash_attn_func(q, k, v).float().sum().backward()
    assert [c[:2] for c in fake_ext.calls[-2:]] == [("fwd", "fa1"), ("bwd", "fa1")]
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*this build has no fa2 bwd kernel \(which computes fa3's gradient\) for fp16 head dim 64 \(built: none\).*backend='fa1' would run it"):
        flash_attn.flash_attn_func(q, k, v, backend="fa3")


def test_training_on_sm86_runs_fa1_through_the_call(fake_ext):
    fake_ext.arch, fake_ext.smem = 86, SMEM[86]
    q, k, v = _qkv()
    flash_attn.flash_attn_func(q, k, v, causal=True)
    assert fake_ext.calls[-1][:2] == ("fwd", "fa2")
    q.requires_grad_()
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa2.*needs 146 KB of shared memory per block, and this GPU allows 99 KB"):
        flash_attn.flash_attn_func(q, k, v, causal=True).float().sum().backward()
    assert [c[:2] for c in fake_ext.calls[-2:]] == [("fwd", "fa1"), ("bwd", "fa1")]


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


def test_available_backends(fake_ext, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for arch, expected in ((90, ["fa3", "fa2", "fa1"]), (100, ["fa2", "fa1"]), (86, ["fa2", "fa1"]),
                           (75, ["fa1"]), (70, [])):
        fake_ext.arch = arch
        assert flash_attn.available_backends() == expected
        assert flash_attn.available_backends(0) == expected
    fake_ext.arch = 90
    fake_ext.configs = matrix_configs(("fa1",))
    assert flash_attn.available_backends("cuda:0") == ["fa1"]
    assert flash_attn.available_backends("cpu") == []


@pytest.mark.parametrize("arch,targets,ptx,expected", [
    (90, [75, 80, 90], 90, ["fa3", "fa2", "fa1"]),
    (90, [90], 0, ["fa3", "fa2", "fa1"]),
    (90, [75, 80], 80, ["fa2", "fa1"]),     # the sm80 PTX runs fa2 and fa1; fa3 needs sm_90a
    (90, [75, 80], 75, ["fa1"]),            # the sm75 PTX: fa2's kernels are empty in it
    (90, [75, 80], 0, []),                  # no PTX: nothing runs on sm90
    (100, [80, 90], 90, ["fa2", "fa1"]),    # the sm90 PTX: its fa3 kernels are empty
    (100, [80, 90], 0, []),
    (100, [], 0, ["fa2", "fa1"]),           # an extension without built_archs(): max_arch still
])
def test_available_backends_by_target(fake_ext, monkeypatch, arch, targets, ptx, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake_ext.set_targets(targets, ptx)
    fake_ext.arch = arch
    assert flash_attn.available_backends() == expected


@pytest.mark.parametrize("has_ptx_arch", [True, False])
def test_ptx_arch_of_the_extension(fake_ext, has_ptx_arch):
    """_C.ptx_arch() says which PTX the build carries (0: none); an extension built before it
    existed carried the PTX of its newest target."""
    fake_ext.set_targets([80, 90], 0, has_ptx_arch=has_ptx_arch)
    assert D.built_archs() == (80, 90)
    assert D.ptx_arch() == (None if has_ptx_arch else 90)
    fake_ext.set_targets([80, 90], 80, has_ptx_arch=has_ptx_arch)
    assert D.ptx_arch() == (80 if has_ptx_arch else 90)
    fake_ext.set_targets([], 0, has_ptx_arch=has_ptx_arch)
    assert D.ptx_arch() is None


@pytest.mark.parametrize("ptx,has_ptx_arch", [(0, True), (90, True), (0, False)])
def test_build_for_80_90_on_an_sm100_gpu(fake_ext, monkeypatch, ptx, has_ptx_arch):
    """FLASH_ATTN_CUDA_ARCHS="80;90" on sm100: a clear error before any launch. With
    "80;90+PTX" (or an extension older than ptx_arch(), which always had it) fa2 runs from the
    sm90 PTX, fa3 does not (its sm_90a code runs on sm90 only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake_ext.set_targets([80, 90], ptx, has_ptx_arch=has_ptx_arch)
    fake_ext.arch = 100
    q, k, v = _qkv()
    if ptx == 0 and has_ptx_arch:
        with pytest.raises(RuntimeError, match=r"this build has machine code for sm80, sm90 and no PTX, none of which runs on sm100; rebuild with FLASH_ATTN_CUDA_ARCHS including 100, or with 90\+PTX"):
            flash_attn.flash_attn_func(q, k, v)
        assert fake_ext.calls == []
        assert flash_attn.available_backends() == []
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", D.BackendFallbackWarning)   # fa2 is sm100's first choice
        flash_attn.flash_attn_func(q, k, v)
    assert fake_ext.calls[-1][:2] == ("fwd", "fa2")
    assert flash_attn.available_backends() == ["fa2", "fa1"]
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call \(sm100"):
        flash_attn.flash_attn_func(q, k, v, backend="fa3")


def test_decisions_are_memoised(fake_ext):
    q, k, v = _qkv()
    flash_attn.flash_attn_func(q, k, v)
    n = len(D._DECISIONS)
    flash_attn.flash_attn_func(q, k, v)
    assert len(D._DECISIONS) == n == 1


def test_build_without_code_for_this_arch(fake_ext, monkeypatch):
    """A build for sm90 only cannot run on an sm80 GPU: a clear error, no launch, and
    available_backends() says nothing runs."""
    fake_ext.set_targets([90], 90)
    family, error, message = D._decide(80, "fp16", 64, frozenset(), None, False)
    assert (family, error) == ("", "RuntimeError")
    assert message == ("flash_attn: this build has machine code for sm90 and PTX of sm90, none of "
                       "which runs on sm80; rebuild with FLASH_ATTN_CUDA_ARCHS including 80")
    assert D._decide(90, "fp16", 64, frozenset(), None, False)[0] == "fa3"
    assert D._decide(90, "fp16", 64, frozenset(), None, True)[0] == "fa3"


def test_sm75_only_build_on_an_sm80_gpu(fake_ext, monkeypatch):
    """FLASH_ATTN_CUDA_ARCHS=75+PTX on an A100: the sm75 PTX runs, but fa2's kernels are empty
    in it (they need sm80), so fa1 runs, visibly, and a forced fa2 says why not."""
    fake_ext.set_targets([75], 75)
    q, k, v = _qkv()
    with pytest.warns(D.BackendFallbackWarning, match=r"running fa1 instead of fa2.*fa2 fp16 kernels need code for sm80\+ that runs on sm80, and it has machine code for sm75 and PTX of sm75; rebuild with FLASH_ATTN_CUDA_ARCHS including 80 \("):
        assert flash_attn.select_backend(q, k, v) == "fa1"
    with pytest.raises(NotImplementedError, match=r"backend='fa2' cannot run this call .*machine code for sm75 and PTX of sm75"):
        flash_attn.flash_attn_func(q, k, v, backend="fa2")
    with pytest.raises(NotImplementedError, match=r"fa1 runs bf16|kernels need code for sm80"):
        flash_attn.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert flash_attn.available_backends() == ["fa1"]
    fake_ext.set_targets([75, 80], 80)
    assert flash_attn.available_backends() == ["fa2", "fa1"]
    # FLASH_ATTN_CUDA_ARCHS=75 (no PTX): the sm75 machine code does not run on sm80 at all.
    fake_ext.set_targets([75], 0)
    assert flash_attn.available_backends() == []
    with pytest.raises(RuntimeError, match=r"machine code for sm75 and no PTX, none of which runs on sm80; rebuild with FLASH_ATTN_CUDA_ARCHS including 80, or with 75\+PTX"):
        flash_attn.flash_attn_func(q, k, v)
