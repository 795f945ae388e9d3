"""The benchmarks' pipelines on the CPU: a bug outside the timed kernels (the model, the report)
should not first show on a lent GPU, where it costs the run."""

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import benchmark_train  # noqa: E402


@pytest.fixture(scope="module")
def cpu_train_report(tmp_path_factory):
    """benchmark_train's report of one tiny CPU run (--profile asked for; it needs a GPU)."""
    out = tmp_path_factory.mktemp("train")
    rc = benchmark_train.main(["--quick", "--device", "cpu", "--backends", "sdpa_flash",
                               "--layers", "1", "--batch", "2", "--steps", "1", "--warmup", "0", "--rounds", "1",
                               "--profile", "--out-dir", str(out)])
    assert rc == 0
    (report,) = out.glob("train_*.json")
    return json.loads(report.read_text())


def test_train_step_pipeline_runs_on_cpu(cpu_train_report):
    (rec,) = cpu_train_report["results"]
    assert rec["error"] is None, rec["error"]
    assert rec["ms"] > 0 and math.isfinite(rec["first_loss"])
    assert "profile" not in rec  # --profile needs a GPU: skipped, said so, the report intact


def test_train_profile_sums_the_attention_kernels_a_step():
    us = {"void flash::fa3::bwd_kernel<Tr, true>(...)": 300.0, "sm90_xmma_gemm_bf16": 500.0,
          "cudnn_generated_fort_native_sdpa_sm90_fprop": 100.0, "elementwise_kernel": 60.0,
          "void pytorch_flash::flash_fwd_kernel<...>": 40.0}
    kernels = list(us.items()) * 2  # two steps
    s = benchmark_train.kernel_summary(kernels, steps=2)
    assert s["gpu_ms"] == pytest.approx(1.0) and s["attention_ms"] == pytest.approx(0.44)
    assert [k["name"] for k in s["attention_kernels"]] == [
        "void flash::fa3::bwd_kernel<Tr, true>(...)",
        "cudnn_generated_fort_native_sdpa_sm90_fprop", "void pytorch_flash::flash_fwd_kernel<...>"]
    assert s["attention_kernels"][0]["ms"] == pytest.approx(0.3)


def test_train_sees_a_flash_attn_distribution_as_transformers_does(tmp_path, monkeypatch):
    """transformers' flash_attention_2 looks for flash_attn by its installed distribution, which
    an in-place build lacks (benchmark_train then says how to give it one): a dist-info that
    names the package is enough."""
    info = tmp_path / "flash_attn-2.8.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.8.3\n")
    (info / "top_level.txt").write_text("flash_attn\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert benchmark_train._flash_attn_distribution()


def test_train_report_shows_the_attention_share_where_profiled(cpu_train_report):
    report = dict(cpu_train_report)
    (timed,) = report["results"]
    profiled = dict(timed, backend="a", profile=benchmark_train.kernel_summary(
        [("void flash::fa3::bwd_kernel<x>", 300.0), ("gemm", 700.0)], steps=1))
    failed = dict(timed, backend="b", profile_error="profile: RuntimeError: no CUPTI")
    report["results"] = [profiled, failed, dict(timed, backend="c")]
    markdown = benchmark_train.render_markdown(report)
    rows = {line.split("|")[1].strip(): line for line in markdown.splitlines()
            if line.startswith("| ")}
    assert rows["a"].rstrip(" |").endswith("0.30 of 1.00 (30%)")
    assert "profile: RuntimeError: no CUPTI" in rows["b"]
    assert rows["c"].count("|") == rows["a"].count("|")  # an empty cell, not a missing one
    assert "- a: 0.30 ms `void flash::fa3::bwd_kernel<x>`" in markdown


def test_fp8_report_names_what_cudnn_fp8_could_not_measure():
    import benchmark_fp8
    meta = dict(device="NVIDIA H100", torch="2.11", cuda="13.0", cudnn="9", python="3.12",
                date_utc="2026-12-07")
    config = dict(total_tokens=16384, hidden=2048, timing="t", cudnn_fp8="not measured: "
                  "ModuleNotFoundError: No module named 'cudnn'")
    cell = dict(hdim=128, nheads=16, seqlen=2048, batch=8, causal=False)
    measured = dict(cell, errors={}, **{"fp8": 900.0, "cuDNN fp8": 800.0, "bf16": 600.0,
                                         "quantize + fp8": 300.0, "SDPA cuDNN bf16": 500.0})
    missing = dict(cell, causal=True, errors={"cuDNN fp8": config["cudnn_fp8"]},
                   **{"fp8": 700.0, "bf16": 400.0})
    markdown = benchmark_fp8.render_markdown(
        dict(meta=meta, config=config, results=[measured, missing]))
    rows = [line for line in markdown.splitlines() if line.startswith("| 128")]
    assert "| 1.12 | 1.50 |" in rows[0]  # fp8 / cuDNN fp8, then fp8 / bf16
    assert "| - | 1.75 |" in rows[1]
    assert "- cuDNN fp8: not measured: ModuleNotFoundError" in markdown


def test_cudnn_fp8_takes_the_largest_of_our_descales():
    import torch
    import _cudnn_fp8
    ours = {n: torch.tensor([[0.5, 2.0], [1.0, 0.25]]) for n in ("q_descale", "k_descale",
                                                                 "v_descale")}
    d = _cudnn_fp8.per_tensor_descales(ours)
    assert d["q_descale"].shape == (1, 1, 1, 1) and d["q_descale"].item() == 2.0
    assert d["v_scale"].item() == 0.5
