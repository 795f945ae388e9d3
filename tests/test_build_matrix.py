"""The build matrix: its data is consistent, the build switches trim it, the generator writes it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flash_attn import _dispatch, _validate, build_matrix as M


# ---- the data ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(M.FAMILIES))
def test_family_is_consistent(name):
    f = M.FAMILIES[name]
    assert f.name == name
    assert list(f.hdims) == sorted(set(f.hdims)), "hdims must be ascending and unique"
    # Multiples of 8 because the frontend pads to one; <= 256 because that is the API's limit.
    assert all(h % 8 == 0 and 8 <= h <= _validate.MAX_HEAD_DIM for h in f.hdims)
    assert f.max_hdim == f.hdims[-1]
    assert set(f.directions) <= {"fwd", "bwd"} and "fwd" in f.directions
    assert set(f.dtype_min_arch) <= set(M.DTYPES)
    assert all(a >= f.min_arch for a in f.dtype_min_arch.values())
    assert f.min_arch >= _validate.MIN_ARCH
    # Every feature must be one the frontend computes, or dispatch could never see it.
    assert f.features <= set(_validate.FEATURES), f.features
    assert {"causal", "gqa"} <= f.features
    assert f.max_arch is None or f.max_arch >= f.min_arch
    # The backward family computes this one's gradient wherever this one's forward runs and
    # its own backward does not: it has a backward, every feature, dtype and head dim of this
    # family, and the archs. A family without a bwd_family takes every call itself.
    assert f.bwd_family is None or f.bwd_family in M.FAMILIES
    bwd = M.FAMILIES[f.bwd_family or name]
    assert "bwd" in bwd.directions
    assert f.bwd_family is not None or (f.bwd_hdims is None and f.bwd_features is None and
                                        f.bwd_deterministic)
    assert set(f.backward_hdims) <= set(f.hdims)
    assert f.bwd_features is None or f.bwd_features <= f.features
    assert f.features <= bwd.features
    assert set(f.dtype_min_arch) <= set(bwd.dtype_min_arch)
    assert all(bwd.dtype_min_arch[t] <= a for t, a in f.dtype_min_arch.items())
    assert f.max_hdim <= bwd.max_hdim
    assert bwd.min_arch <= f.min_arch
    assert bwd.max_arch is None or (f.max_arch is not None and f.max_arch <= bwd.max_arch)


def test_preference_names_every_family():
    assert set(M.FAMILIES) <= set(M.PREFERENCE)
    assert len(set(M.PREFERENCE)) == len(M.PREFERENCE)
    assert _dispatch.BACKENDS == tuple(M.PREFERENCE)


def test_every_call_feature_has_an_error_text():
    assert set(_validate.FEATURES) == set(_dispatch._FEATURE_TEXT)


def test_cxx_types():
    assert set(M.CXX_TYPE) == set(M.DTYPES)
    assert M.CXX_TYPE == {"fp16": "__half", "bf16": "__nv_bfloat16", "e4m3": "__nv_fp8_e4m3"}


def test_all_configs_is_the_full_product():
    configs = M.all_configs()
    assert configs == sorted(configs)
    expected = sum(len(f.dtype_min_arch) * len(f.backward_hdims if d == "bwd" else f.hdims)
                   for f in M.FAMILIES.values() for d in f.directions)
    expected += sum(len(f.fp8_hdims) for f in M.FAMILIES.values())  # e4m3 forwards
    assert len(configs) == len(set(configs)) == expected
    fp8 = [c for c in configs if c.dtype == "e4m3"]
    assert fp8 == [M.Config("fa3", "fwd", "e4m3", h) for h in (64, 128, 256)]
    assert M.Config("fa1", "fwd", "bf16", 64).stem == "fa1_fwd_hdim64_bf16"


# ---- build switches ---------------------------------------------------------------------------

def test_no_switches_select_everything():
    assert M.selected_configs({}) == M.all_configs()
    assert M.selected_configs({"FLASH_ATTN_HDIMS": "  "}) == M.all_configs()


def test_switches_trim():
    env = {"FLASH_ATTN_FAMILIES": "fa1", "FLASH_ATTN_HDIMS": "64;128", "FLASH_ATTN_DTYPES": "fp16"}
    got = M.selected_configs(env)
    assert {(c.family, c.dtype) for c in got} == {("fa1", "fp16")}
    assert {c.hdim for c in got} == {64, 128}
    assert {c.direction for c in got} == set(M.FAMILIES["fa1"].directions)
    # Commas work as separators too.
    assert M.selected_configs({"FLASH_ATTN_FAMILIES": "fa1", "FLASH_ATTN_HDIMS": "64,128",
                               "FLASH_ATTN_DTYPES": "fp16"}) == got
    # A head dim selects the families that have it: 32 is fa1's and fa2's (fa3 starts at 64),
    # 192 is fa2's and fa3's.
    assert {c.family for c in M.selected_configs({"FLASH_ATTN_HDIMS": "32"})} == {"fa1", "fa2"}
    assert {c.family for c in M.selected_configs({"FLASH_ATTN_HDIMS": "192"})} == {"fa2", "fa3"}
    # fa3's backward exists at every head dim of its forward (its short or dropout gradients
    # are fa2's backward).
    assert {(c.direction, c.hdim) for c in M.selected_configs({"FLASH_ATTN_FAMILIES": "fa3"})
            if c.direction == "bwd"} == {("bwd", d) for d in (64, 96, 128, 192, 256)}


@pytest.mark.parametrize("env,pattern", [
    ({"FLASH_ATTN_FAMILIES": "fa1;fa7"}, r"FLASH_ATTN_FAMILIES: unknown family 'fa7'"),
    ({"FLASH_ATTN_DTYPES": "fp32"}, r"FLASH_ATTN_DTYPES: unknown dtype 'fp32'"),
    ({"FLASH_ATTN_HDIMS": "48"}, r"select no kernel"),
])
def test_bad_switches(env, pattern):
    with pytest.raises(ValueError, match=pattern):
        M.selected_configs(env)


def archs_env(value):
    return {"FLASH_ATTN_CUDA_ARCHS": value}


def test_cuda_archs():
    assert M.cuda_archs({}) == list(M.DEFAULT_ARCHS)
    assert M.cuda_archs(archs_env("90;sm_80,75;sm90a;80")) == [75, 80, 90]
    assert M.cuda_archs(archs_env("8.0;8.6,9.0;10.0")) == [80, 86, 90, 100]   # torch's spelling
    with pytest.raises(ValueError, match=r"sm70 is older than any family supports"):
        M.cuda_archs(archs_env("70;80"))
    with pytest.raises(ValueError, match=r"FLASH_ATTN_CUDA_ARCHS: cannot read 'hopper'"):
        M.cuda_archs(archs_env("80;hopper"))


@pytest.mark.parametrize("value,archs,ptx", [
    (None, [75, 80, 90], 80),          # unset: what a wheel needs, PTX of sm80 included
    ("", [75, 80, 90], 80),
    ("80;90", [80, 90], None),         # an explicit list has machine code only
    ("90", [90], None),
    ("80;90+PTX", [80, 90], 90),
    ("90+ptx", [90], 90),
    ("sm_80 , sm90a+Ptx", [80, 90], 90),
    ("8.0;9.0+PTX", [80, 90], 90),
    ("75+PTX;80", [75, 80], 75),       # PTX of an older target: allowed, as in torch
    ("90+PTX;90", [90], 90),
])
def test_ptx_arch(value, archs, ptx):
    env = {} if value is None else archs_env(value)
    assert M.cuda_archs(env) == archs
    assert M.ptx_arch(env) == ptx


def test_ptx_arch_on_one_entry_only():
    for value in ("80+PTX;90+PTX", "90+PTX;90+ptx"):
        with pytest.raises(ValueError, match=r"FLASH_ATTN_CUDA_ARCHS: at most one entry may carry \+PTX"):
            M.ptx_arch(archs_env(value))
        with pytest.raises(ValueError, match=r"at most one entry may carry \+PTX"):
            M.cuda_archs(archs_env(value))


def test_default_ptx_arch():
    # The newest portable target: its PTX comes out of its own pass (see test_gencode_flags).
    assert M.DEFAULT_PTX_ARCH == 80 and M.DEFAULT_PTX_ARCH in M.DEFAULT_ARCHS
    assert M.arch_code(M.DEFAULT_PTX_ARCH) == str(M.DEFAULT_PTX_ARCH)


def test_arch_code():
    assert M.arch_code(90) == "90a"         # wgmma and setmaxnreg, for fa3
    for arch in (75, 80, 86, 89, 100, 120):
        assert M.arch_code(arch) == str(arch)


def test_gencode_flags():
    # sm90 machine code is the arch-specific sm_90a; the PTX stays the portable compute_90.
    assert M.gencode_flags([90, 75], 90) == ["-gencode=arch=compute_75,code=sm_75",
                                             "-gencode=arch=compute_90a,code=sm_90a",
                                             "-gencode=arch=compute_90,code=compute_90"]
    # Same virtual arch as a target: nvcc makes the PTX and the machine code in one pass.
    assert M.gencode_flags([80], 80) == ["-gencode=arch=compute_80,code=sm_80",
                                         "-gencode=arch=compute_80,code=compute_80"]
    assert M.gencode_flags([100, 90], 100) == ["-gencode=arch=compute_90a,code=sm_90a",
                                               "-gencode=arch=compute_100,code=sm_100",
                                               "-gencode=arch=compute_100,code=compute_100"]
    assert M.gencode_flags([80, 75], 75)[-1] == "-gencode=arch=compute_75,code=compute_75"


def test_gencode_flags_without_ptx():
    # PTX of a virtual arch no target has costs a front-end pass: none unless asked for.
    assert M.gencode_flags([90, 80], None) == ["-gencode=arch=compute_80,code=sm_80",
                                               "-gencode=arch=compute_90a,code=sm_90a"]


@pytest.mark.parametrize("value,flags", [
    (None, ["-gencode=arch=compute_75,code=sm_75", "-gencode=arch=compute_80,code=sm_80",
            "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=compute_80"]),
    ("90", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("80;90+PTX", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                   "-gencode=arch=compute_90,code=compute_90"]),
])
def test_gencode_flags_from_the_switch(value, flags):
    # What setup.py and CMakeLists.txt pass to nvcc.
    env = {} if value is None else archs_env(value)
    assert M.gencode_flags(M.cuda_archs(env), M.ptx_arch(env)) == flags


@pytest.mark.parametrize("arch,built,ptx,runs", [
    (90, [75, 80, 90], 90, True),
    (90, [75, 80, 90], None, True),
    (86, [75, 80, 90], None, True),    # sm80 machine code runs on sm86
    (80, [90], 90, False),             # sm90 code does not run on an A100
    (75, [80, 90], 90, False),
    (89, [75, 90], 90, False),         # no sm8x machine code, and older than the PTX
    (89, [75, 90], 75, True),          # the sm75 PTX
    (100, [75, 80, 90], 90, True),     # newer than every target: the sm90 PTX is JIT-compiled
    (100, [75, 80, 90], None, False),  # ... which an explicit list without +PTX lacks
    (120, [80], 80, True),
    (120, [80], None, False),
])
def test_runs_on(arch, built, ptx, runs):
    assert M.runs_on(arch, built, ptx=ptx) is runs


def test_fa2_entry():
    f = M.FAMILIES["fa2"]
    assert (f.min_arch, dict(f.dtype_min_arch)) == (80, {"fp16": 80, "bf16": 80})
    assert f.hdims == (32, 64, 96, 128, 192, 256)
    assert f.directions == ("fwd", "bwd")
    assert f.features == set(_validate.FEATURES)


def test_sm75_in_the_targets_with_fa2():
    # fa2 is compiled for every target (its bodies are empty below sm80): sm75 stays a valid
    # target, and its code does not count as fa2 code for a newer GPU.
    assert M.cuda_archs(archs_env("75;80")) == [75, 80]
    assert M.kernel_runs_on(80, 80, [75, 80], ptx=None)
    assert not M.kernel_runs_on(80, 80, [75], ptx=75)        # only sm75 PTX: empty fa2 bodies
    assert M.kernel_runs_on(75, 80, [75], ptx=75)            # fa1 fp16 runs from the sm75 PTX
    assert not M.kernel_runs_on(75, 80, [75], ptx=None)
    assert not M.kernel_runs_on(80, 86, [75, 90], ptx=90)
    assert M.kernel_runs_on(80, 90, [75, 80], ptx=80)        # the sm80 PTX
    assert not M.kernel_runs_on(80, 90, [75, 80], ptx=75)    # the sm75 PTX: empty fa2 bodies
    assert not M.kernel_runs_on(80, 90, [75, 80], ptx=None)
    assert M.kernel_runs_on(80, 100, [75, 80, 90], ptx=90)
    assert not M.kernel_runs_on(80, 100, [75, 80, 90], ptx=None)


@pytest.mark.parametrize("ptx", [None, 80, 90])
@pytest.mark.parametrize("arch,built,runs", [
    (90, [75, 80, 90], True),
    (90, [90], True),
    (90, [80], False),           # the sm80 PTX: fa3's kernels are empty in any PTX
    (90, [75, 80, 100], False),  # no sm90 machine code
    (100, [80, 90], False),      # past max_arch: the sm90 PTX JIT-compiles to empty fa3 kernels
    (100, [90, 100], False),
    (89, [80, 90], False),       # below min_arch
])
def test_kernel_runs_on_with_max_arch(arch, built, runs, ptx):
    # Only machine code counts, whatever PTX the build carries.
    assert M.kernel_runs_on(90, arch, built, max_arch=90, ptx=ptx) is runs


def test_kernel_runs_on_without_max_arch_takes_the_ptx():
    assert M.kernel_runs_on(90, 100, [80, 90], ptx=90)
    assert M.kernel_runs_on(90, 100, [80, 90], max_arch=None, ptx=90)
    assert not M.kernel_runs_on(90, 100, [80, 90], ptx=None)
    assert not M.kernel_runs_on(90, 100, [80, 90], ptx=80)   # PTX below min_arch: empty bodies
    assert not M.kernel_runs_on(90, 90, [80], ptx=80)


@pytest.mark.parametrize("ptx,text", [(90, "90"), (None, "0")])
def test_write_sources_built_archs(tmp_path, ptx, text):
    M.write_sources(tmp_path, M.selected_configs({"FLASH_ATTN_HDIMS": "64"}), [90, 80], ptx)
    assert (tmp_path / "built_archs.inc").read_text().splitlines()[-1] == "80, 90"
    lines = (tmp_path / "ptx_arch.inc").read_text().splitlines()
    assert lines[0].startswith("//") and lines[1:] == [text]


def test_generator_main_reads_the_switch(tmp_path):
    # What CMake runs: python src/flash_attn/build_matrix.py OUT_DIR, with the switches in the env.
    env = dict(os.environ, FLASH_ATTN_CUDA_ARCHS="80,90+PTX", FLASH_ATTN_HDIMS="64")
    subprocess.run([sys.executable, M.__file__, str(tmp_path)], env=env, check=True,
                   capture_output=True)
    assert (tmp_path / "built_archs.inc").read_text().splitlines()[-1] == "80, 90"
    assert (tmp_path / "ptx_arch.inc").read_text().splitlines()[-1] == "90"
    env["FLASH_ATTN_CUDA_ARCHS"] = "80,90"
    subprocess.run([sys.executable, M.__file__, str(tmp_path)], env=env, check=True,
                   capture_output=True)
    assert (tmp_path / "ptx_arch.inc").read_text().splitlines()[-1] == "0"


# ---- supports / kernel_hdim -------------------------------------------------------------------

def test_supports():
    assert M.supports("fa1", "fp16", 128, 75) is None
    assert M.supports("fa1", "bf16", 64, 80) is None
    assert M.supports("fa1", "fp16", 64, 70) == "fa1 needs sm75+, this GPU is sm70"
    assert M.supports("fa1", "bf16", 64, 75) == "fa1 runs bf16 on sm80+ only, this GPU is sm75"
    assert M.supports("fa1", "fp32", 64, 80).startswith("fa1 supports dtypes")
    assert M.supports("fa1", "fp16", 129, 80) == "fa1 supports head dims up to 128, got 129"
    assert "does not exist" in M.supports("fa9", "fp16", 64, 80)
    assert M.supports("fa2", "bf16", 256, 80) is None
    assert M.supports("fa2", "fp16", 64, 75) == "fa2 needs sm80+, this GPU is sm75"
    assert M.supports("fa2", "fp16", 264, 90) == "fa2 supports head dims up to 256, got 264"
    assert M.supports("fa2", "bf16", 128, 100) is None


def test_supports_fa3():
    assert M.supports("fa3", "fp16", 256, 90) is None
    assert M.supports("fa3", "bf16", 32, 90) is None     # runs on the hdim-64 kernel
    assert M.supports("fa3", "fp16", 64, 89) == "fa3 needs sm90+, this GPU is sm89"
    for arch in (100, 120):
        reason = M.supports("fa3", "bf16", 64, arch)
        assert reason.startswith("fa3 runs on sm90") and reason.endswith(f"this GPU is sm{arch}")
    assert M.supports("fa3", "fp16", 264, 90) == "fa3 supports head dims up to 256, got 264"


def test_fa3_entry():
    f = M.FAMILIES["fa3"]
    assert (f.min_arch, f.max_arch, dict(f.dtype_min_arch)) == (90, 90, {"fp16": 90, "bf16": 90})
    assert f.hdims == (64, 96, 128, 192, 256)
    assert f.directions == ("fwd", "bwd")
    assert f.features == set(_validate.FEATURES) - {"dropout", "paged_kv_unaligned"}
    assert f.bwd_family == "fa2"
    assert (f.backward_hdims, f.bwd_features, f.bwd_deterministic) == (
        f.hdims, {"causal", "gqa", "local", "softcap", "alibi", "varlen"}, True)
    assert M.arch_code(f.max_arch) == "90a"    # its kernels need the arch-specific machine code
    assert M.PREFERENCE[0] == "fa3"


def test_backward_family():
    assert M.backward_family("fa1", 64) == "fa1"
    assert M.backward_family("fa2", 256, {"dropout", "alibi"}, deterministic=True) == "fa2"
    # fa3's own backward: every head dim of the forward, dense or variable-length, with a
    # mask, softcap, ALiBi, GQA, deterministic; not short, not dropout.
    assert M.backward_family("fa3", 128) == "fa3"
    assert M.backward_family("fa3", 100, {"causal", "gqa"}) == "fa3"
    assert M.backward_family("fa3", 40, {"causal", "gqa"}) == "fa3"
    assert M.backward_family("fa3", 96) == "fa3"
    assert M.backward_family("fa3", 80, {"causal"}) == "fa3"
    assert M.backward_family("fa3", 192) == "fa3"
    assert M.backward_family("fa3", 160, {"causal", "gqa"}) == "fa3"
    assert M.backward_family("fa3", 256, {"causal", "softcap"}) == "fa3"
    assert M.backward_family("fa3", 256, {"causal", "short_q"}) == "fa2"
    for feature in ("local", "softcap", "alibi", "varlen"):
        assert M.backward_family("fa3", 128, {"causal", feature}) == "fa3"
    assert M.backward_family("fa3", 128, {"causal", "short_q"}) == "fa2"
    assert M.backward_family("fa3", 128, deterministic=True) == "fa3"
    assert M.backward_family("fa3", 256, deterministic=True) == "fa3"
    assert M.backward_family("fa2", 512) == "fa2"   # past its head dims: no other to name
    with pytest.raises(KeyError):
        M.backward_family("fa9", 64)


@pytest.mark.parametrize("hdim,kernel", [(1, 32), (8, 32), (32, 32), (33, 64), (72, 96), (96, 96), (120, 128), (128, 128)])
def test_kernel_hdim_rounds_up(hdim, kernel):
    assert M.kernel_hdim("fa1", hdim) == kernel


@pytest.mark.parametrize("hdim,kernel", [(8, 32), (72, 96), (136, 192), (192, 192), (200, 256), (256, 256)])
def test_fa2_kernel_hdim_rounds_up(hdim, kernel):
    assert M.kernel_hdim("fa2", hdim) == kernel


def test_kernel_hdim_past_the_largest():
    with pytest.raises(ValueError, match=r"fa1 has no kernel for head dim 136"):
        M.kernel_hdim("fa1", 136)


# ---- source generation ------------------------------------------------------------------------

def test_write_sources(tmp_path):
    configs = M.selected_configs({"FLASH_ATTN_HDIMS": "64;128"})
    paths = M.write_sources(tmp_path / "gen", configs, M.DEFAULT_ARCHS, M.DEFAULT_PTX_ARCH)
    assert sorted(paths) == sorted(str(tmp_path / "gen" / f"{c.stem}.cu") for c in configs)
    for c in configs:
        text = (tmp_path / "gen" / f"{c.stem}.cu").read_text()
        assert f'#include "{c.family}/{c.family}_{c.direction}_launch.cuh"' in text
        params = "FwdParams" if c.direction == "fwd" else "BwdParams"
        plan = "FwdPlan" if c.direction == "fwd" else "BwdPlan"
        assert (f"template void flash::{c.family}::run_{c.direction}<{M.CXX_TYPE[c.dtype]}, "
                f"{c.hdim}>(\n    const flash::{params}&, const flash::{c.family}::{plan}&, "
                "cudaStream_t);") in text
    table = (tmp_path / "gen" / "dispatch_table.inc").read_text()
    assert "max_arch (0: none)" in table
    rows = re.findall(r"^FLASH_CONFIG\((\w+), (\w+), (\w+), (\w+), (\d+), (\d+), (\d+)\)$",
                      table, re.M)
    assert len(rows) == len(configs)
    for family, direction, cxx, dtype, hdim, min_arch, max_arch in rows:
        f = M.FAMILIES[family]
        assert cxx == M.CXX_TYPE[dtype]
        assert int(min_arch) == f.dtype_arch(dtype)
        assert int(max_arch) == (f.max_arch or 0)
    assert ("fa1", "fwd", "__nv_bfloat16", "bf16", "64", "80", "0") in rows
    assert ("fa1", "bwd", "__half", "fp16", "128", "75", "0") in rows
    assert ("fa2", "fwd", "__half", "fp16", "64", "80", "0") in rows
    assert ("fa2", "bwd", "__nv_bfloat16", "bf16", "128", "80", "0") in rows
    assert ("fa3", "fwd", "__half", "fp16", "64", "90", "90") in rows
    assert ("fa3", "fwd", "__nv_bfloat16", "bf16", "128", "90", "90") in rows
    assert ("fa3", "bwd", "__nv_bfloat16", "bf16", "128", "90", "90") in rows
    assert ("fa3", "bwd", "__half", "fp16", "64", "90", "90") in rows
    assert not any(r[0] == "fa3" and r[1] == "bwd" and r[4] not in ("64", "96", "128")
               for r in rows)


def test_write_sources_leaves_unchanged_files_alone(tmp_path):
    # ninja rebuilds on mtime: regenerating the same matrix must not touch any file.
    configs = M.selected_configs({"FLASH_ATTN_HDIMS": "64"})
    files = ([Path(p) for p in M.write_sources(tmp_path, configs, [80, 90], 90)] +
             [tmp_path / name for name in ("dispatch_table.inc", "built_archs.inc", "ptx_arch.inc")])
    for p in files:
        os.utime(p, ns=(1, 1))
    M.write_sources(tmp_path, configs, [80, 90], 90)
    assert all(p.stat().st_mtime_ns == 1 for p in files), "unchanged files were rewritten"
    # A different matrix rewrites the table; other PTX rewrites ptx_arch.inc alone.
    M.write_sources(tmp_path, M.selected_configs({"FLASH_ATTN_HDIMS": "128"}), [80, 90], None)
    assert (tmp_path / "dispatch_table.inc").stat().st_mtime_ns != 1
    assert (tmp_path / "ptx_arch.inc").stat().st_mtime_ns != 1
    assert (tmp_path / "built_archs.inc").stat().st_mtime_ns == 1


def test_page_rows_is_fa3s():
    # The frontend's "paged_kv_unaligned" rule is fa3's page requirement.
    header = (Path(__file__).resolve().parents[1] / "csrc" / "fa3" / "fa3.h").read_text()
    m = re.search(r"constexpr int kPageRows = (\d+);", header)
    assert m and int(m.group(1)) == M.PAGE_ROWS
    from flash_attn import _validate
    for page in (1, 7, M.PAGE_ROWS, 3 * M.PAGE_ROWS, 3 * M.PAGE_ROWS + 1, 256):
        unaligned = "paged_kv_unaligned" in _validate.paged_features(page)
        assert unaligned == (page % M.PAGE_ROWS != 0)


def test_decode_max_rows_is_fa2s():
    # The dispatcher's decode threshold (fa2 first) is the fa2 decode kernel's row limit.
    header = (Path(__file__).resolve().parents[1] / "csrc" / "fa2" / "fa2.h").read_text()
    m = re.search(r"constexpr int kDecodeMaxRows = (\d+);", header)
    assert m and int(m.group(1)) == M.DECODE_MAX_ROWS


def test_fa2_backward_shared_memory_is_fa2s():
    # The dispatcher's table of fa2's backward shared memory is fa2.h's kBwdMinSmem (which
    # fa2_bwd_launch.cuh asserts against the kernels' layout).
    header = (Path(__file__).resolve().parents[1] / "csrc" / "fa2" / "fa2.h").read_text()
    m = re.search(r"constexpr int kBwdMinSmem\[\]\[2\] = \{(.*?)\};", header, re.S)
    assert m
    table = {int(h): int(b) for h, b in re.findall(r"\{(\d+), (\d+)\}", m.group(1))}
    assert table == dict(M.FAMILIES["fa2"].bwd_smem)
    assert set(table) == set(M.FAMILIES["fa2"].backward_hdims)
