"""The build matrix: its data is consistent, the build switches trim it, the generator writes it."""

import os
import re
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


def test_preference_names_every_family():
    assert set(M.FAMILIES) <= set(M.PREFERENCE)
    assert len(set(M.PREFERENCE)) == len(M.PREFERENCE)
    assert _dispatch.BACKENDS == tuple(M.PREFERENCE)


def test_every_call_feature_has_an_error_text():
    assert set(_validate.FEATURES) == set(_dispatch._FEATURE_TEXT)


def test_cxx_types():
    assert set(M.CXX_TYPE) == set(M.DTYPES)
    assert M.CXX_TYPE == {"fp16": "__half", "bf16": "__nv_bfloat16"}


def test_all_configs_is_the_full_product():
    configs = M.all_configs()
    assert configs == sorted(configs)
    expected = sum(len(f.directions) * len(f.dtype_min_arch) * len(f.hdims) for f in M.FAMILIES.values())
    assert len(configs) == len(set(configs)) == expected
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
    # A head dim only fa2 has selects fa2 alone.
    assert {c.family for c in M.selected_configs({"FLASH_ATTN_HDIMS": "192"})} == {"fa2"}


@pytest.mark.parametrize("env,pattern", [
    ({"FLASH_ATTN_FAMILIES": "fa1;fa7"}, r"FLASH_ATTN_FAMILIES: unknown family 'fa7'"),
    ({"FLASH_ATTN_DTYPES": "fp32"}, r"FLASH_ATTN_DTYPES: unknown dtype 'fp32'"),
    ({"FLASH_ATTN_HDIMS": "48"}, r"select no kernel"),
])
def test_bad_switches(env, pattern):
    with pytest.raises(ValueError, match=pattern):
        M.selected_configs(env)


def test_cuda_archs():
    assert M.cuda_archs({}) == list(M.DEFAULT_ARCHS)
    assert M.cuda_archs({"FLASH_ATTN_CUDA_ARCHS": "90;sm_80,75;sm90a;80"}) == [75, 80, 90]
    with pytest.raises(ValueError, match=r"sm70 is older than any family supports"):
        M.cuda_archs({"FLASH_ATTN_CUDA_ARCHS": "70;80"})


def test_gencode_flags():
    assert M.gencode_flags([90, 75]) == ["-gencode=arch=compute_75,code=sm_75",
                                         "-gencode=arch=compute_90,code=sm_90",
                                         "-gencode=arch=compute_90,code=compute_90"]


@pytest.mark.parametrize("arch,built,runs", [
    (90, [75, 80, 90], True),
    (86, [75, 80, 90], True),    # sm80 machine code runs on sm86
    (80, [90], False),           # sm90 code does not run on an A100
    (75, [80, 90], False),
    (89, [75, 90], False),       # no sm8x machine code, and older than the PTX
    (100, [75, 80, 90], True),   # newer than every target: the sm90 PTX is JIT-compiled
    (120, [80], True),
])
def test_runs_on(arch, built, runs):
    assert M.runs_on(arch, built) is runs


def test_fa2_entry():
    f = M.FAMILIES["fa2"]
    assert (f.min_arch, dict(f.dtype_min_arch)) == (80, {"fp16": 80, "bf16": 80})
    assert f.hdims == (32, 64, 96, 128, 192, 256)
    assert f.directions == ("fwd", "bwd")
    assert f.features == set(_validate.FEATURES)


def test_sm75_in_the_targets_with_fa2():
    # fa2 is compiled for every target (its bodies are empty below sm80): sm75 stays a valid
    # target, and its code does not count as fa2 code for a newer GPU.
    assert M.cuda_archs({"FLASH_ATTN_CUDA_ARCHS": "75;80"}) == [75, 80]
    assert M.kernel_runs_on(80, 80, [75, 80])
    assert not M.kernel_runs_on(80, 80, [75])        # only sm75 PTX: empty fa2 bodies
    assert M.kernel_runs_on(75, 80, [75])            # fa1 fp16 runs from the sm75 PTX
    assert not M.kernel_runs_on(80, 86, [75, 90])
    assert M.kernel_runs_on(80, 90, [75, 80])        # the sm80 PTX
    assert M.kernel_runs_on(80, 100, [75, 80, 90])


def test_write_sources_built_archs(tmp_path):
    M.write_sources(tmp_path, M.selected_configs({"FLASH_ATTN_HDIMS": "64"}), archs=[90, 80])
    text = (tmp_path / "built_archs.inc").read_text()
    assert text.splitlines()[-1] == "80, 90"


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
    paths = M.write_sources(tmp_path / "gen", configs)
    assert sorted(paths) == sorted(str(tmp_path / "gen" / f"{c.stem}.cu") for c in configs)
    for c in configs:
        text = (tmp_path / "gen" / f"{c.stem}.cu").read_text()
        assert f'#include "{c.family}/{c.family}_{c.direction}_launch.cuh"' in text
        params = "FwdParams" if c.direction == "fwd" else "BwdParams"
        assert (f"template void flash::{c.family}::run_{c.direction}<{M.CXX_TYPE[c.dtype]}, "
                f"{c.hdim}>(const flash::{params}&, cudaStream_t);") in text
    table = (tmp_path / "gen" / "dispatch_table.inc").read_text()
    rows = re.findall(r"^FLASH_CONFIG\((\w+), (\w+), (\w+), (\w+), (\d+), (\d+)\)$", table, re.M)
    assert len(rows) == len(configs)
    for family, direction, cxx, dtype, hdim, min_arch in rows:
        f = M.FAMILIES[family]
        assert cxx == M.CXX_TYPE[dtype]
        assert int(min_arch) == max(f.min_arch, f.dtype_min_arch[dtype])
    assert ("fa1", "fwd", "__nv_bfloat16", "bf16", "64", "80") in rows
    assert ("fa1", "bwd", "__half", "fp16", "128", "75") in rows
    assert ("fa2", "fwd", "__half", "fp16", "64", "80") in rows
    assert ("fa2", "bwd", "__nv_bfloat16", "bf16", "128", "80") in rows


def test_write_sources_leaves_unchanged_files_alone(tmp_path):
    # ninja rebuilds on mtime: regenerating the same matrix must not touch any file.
    configs = M.selected_configs({"FLASH_ATTN_HDIMS": "64"})
    files = [Path(p) for p in M.write_sources(tmp_path, configs)] + [tmp_path / "dispatch_table.inc"]
    for p in files:
        os.utime(p, ns=(1, 1))
    M.write_sources(tmp_path, configs)
    assert all(p.stat().st_mtime_ns == 1 for p in files), "unchanged files were rewritten"
    # A different matrix rewrites the table.
    M.write_sources(tmp_path, M.selected_configs({"FLASH_ATTN_HDIMS": "128"}))
    assert (tmp_path / "dispatch_table.inc").stat().st_mtime_ns != 1
