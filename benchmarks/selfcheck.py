#!/usr/bin/env python
"""CPU-only check of the benchmark scripts' plumbing: argument parsing, FLOP counts, file names,
the markdown / JSON / PNG writers on synthetic results, and one tiny end-to-end run of
benchmark_attn.py on the CPU (SDPA's CPU flash kernel and plain attention; an injected OOM).
No GPU needed; it says nothing about performance.

    python benchmarks/selfcheck.py
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
import benchmark_attn as BA  # noqa: E402
import benchmark_memory as BM  # noqa: E402
import benchmark_train as BT  # noqa: E402

META = {"device": "NVIDIA H100 80GB HBM3", "device_short": "H100", "compute_capability": "9.0",
        "sm_count": 132, "memory_bytes": 80 * 2**30, "torch": "2.11.0+cu130", "cuda": "13.0",
        "cudnn": 91300, "python": "3.12.0", "flash_attn": "2.8.3", "flash_attn_backends": ["fa1"],
        "git_commit": "0123456789abcdef", "git_dirty": False, "date_utc": "2026-11-22T10:00:00Z"}


def check_args() -> None:
    a = BA.parse_args([])
    assert a.seqlens == [512, 1024, 2048, 4096, 8192, 16384] and a.hdims == [64, 128, 256]
    assert a.causal == [False, True] and a.modes == ["fwd", "bwd", "fwd_bwd"]
    assert (a.min_reps, a.max_reps, a.reps) == (6, 60, None) and a.dtype == "bf16"
    q = BA.parse_args(["--quick", "--seqlens", "1k,2048", "--causal", "true", "--modes", "bwd"])
    assert q.seqlens == [1024, 2048] and q.causal == [True] and q.modes == ["bwd"]
    for bad in (["--backends", "fa9"], ["--modes", "fwdd"]):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                BA.parse_args(bad)
        except SystemExit:
            continue
        raise AssertionError(f"{bad} was accepted")
    m = BM.parse_args([])
    assert m.seqlens[0] == 1024 and m.seqlens[-1] == 65536
    assert (m.batch, m.nheads, m.hdim, m.causal) == (1, 16, 128, False)


def check_helpers() -> None:
    # FlashAttention-2 paper, seqlen 2k, hdim 64: batch 8, 32 heads.
    fwd = BA.attn_flops(8, 32, 2048, 2048, 64, False, "fwd")
    assert fwd == 4 * 8 * 32 * 2048 * 2048 * 64
    assert BA.attn_flops(8, 32, 2048, 2048, 64, True, "fwd") == fwd / 2
    assert BA.attn_flops(8, 32, 2048, 2048, 64, True, "bwd") == fwd / 2 * 2.5
    assert BA.attn_flops(8, 32, 2048, 2048, 64, False, "fwd_bwd") == fwd * 3.5
    for name, short in [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
                        ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA GeForce RTX 4090", "RTX4090"),
                        ("Tesla T4", "T4"), ("NVIDIA H100 PCIe", "H100")]:
        assert C.device_short_name(name) == short, (name, C.device_short_name(name))
    assert C.output_stem("attn", META, "bf16", False, None) == "attn_H100_bf16"
    assert C.output_stem("attn", META, "fp16", True, "x y") == "attn_H100_fp16_quick_x_y"
    assert C.parse_int_list("512, 1k,64K") == [512, 1024, 65536]
    assert [C.fmt_seqlen(s) for s in (512, 1024, 16384, 1536)] == ["512", "1k", "16k", "1536"]
    expanded = C.expand_backend_names(["ours", "cudnn", "fa1"], ["fa2", "fa1"])
    assert expanded == ["fa2", "fa1", "cudnn"]
    calls = []  # "fa3+det": fa3's flash_attn_func with deterministic=True; not built: refused
    fake_fa = types.SimpleNamespace(flash_attn_func=lambda *a, **kw: calls.append(kw))
    det, plain, absent = C.make_backends(["fa3+det", "fa3", "fa2+det"], fake_fa, ["fa3"], None)
    assert det.kind == "ours" and absent.fn is None and absent.unavailable
    det.fn(None, None, None, True), plain.fn(None, None, None, True)
    assert calls == [dict(causal=True, backend="fa3", deterministic=True),
                     dict(causal=True, backend="fa3")]
    assert BA.parse_args(["--backends", "fa3,fa3+det,cudnn"]).backends == ["fa3", "fa3+det",
                                                                           "cudnn"]
    assert C.describe_error(torch.cuda.OutOfMemoryError("CUDA out of memory.")) == "OOM"


def synthetic_attn_report() -> dict:
    cfg = dict(dtype="bf16", total_tokens=16384, hidden=2048, seqlens=[512, 1024], hdims=[64, 256],
               causal=[False, True], modes=["fwd", "bwd"], timing=BA.TIMING)
    backends = [dict(name="fa1", kind="ours"), dict(name="cudnn", kind="baseline"),
                dict(name="torch", kind="baseline")]
    results = []
    for mode in cfg["modes"]:
        for causal in cfg["causal"]:
            for hdim in cfg["hdims"]:
                for s in cfg["seqlens"]:
                    for i, b in enumerate(backends):
                        r = dict(mode=mode, causal=causal, hdim=hdim, seqlen=s, backend=b["name"],
                                 kind=b["kind"], ms=1.0, tflops=100.0 + 10 * i, error=None,
                                 oom=False, check={"ref": "cudnn", "rel_err": 0.01,
                                                   "suspicious": False})
                        if b["name"] == "fa1" and hdim == 256:
                            r.update(ms=None, tflops=None, check=None,
                                     error="NotImplementedError: fa1 supports head dims up to 128")
                        if b["name"] == "torch" and s == 1024:
                            r.update(ms=None, tflops=None, error="OOM", oom=True)
                        if b["name"] == "cudnn" and causal and hdim == 64:
                            r["check"] = {"ref": "sdpa_efficient", "rel_err": 0.9,
                                          "suspicious": True}
                        results.append(r)
    return dict(meta=META, config=cfg, backends=backends, results=results, complete=True)


def check_attn_output(tmp: Path) -> None:
    report = synthetic_attn_report()
    md = BA.render_markdown(report)
    assert "| mode | causal | hdim | seqlen | fa1 | cudnn | torch | ours / best baseline |" in md
    assert "| fwd | no | 64 | 512 | 100.0 | 110.0 | 120.0 | 0.83x |" in md, md
    # Suspicious cuDNN output is flagged and left out of the ratio; OOM shows; hdim 256 is empty.
    assert "| fwd | yes | 64 | 512 | 100.0 | 110.0* | 120.0 | 0.83x |" in md, md
    assert "| fwd | yes | 64 | 1k | 100.0 | 110.0* | OOM |  |" in md, md
    assert "| bwd | no | 256 | 512 |  | 110.0 | 120.0 |  |" in md, md
    assert "fa1 (8 cells): NotImplementedError" in md
    assert json.loads(json.dumps(report)) == report
    if BA.plot(report, tmp / "attn.png"):
        assert (tmp / "attn.png").stat().st_size > 10_000


def check_memory_output(tmp: Path) -> None:
    cfg = dict(dtype="bf16", batch=1, nheads=16, hdim=128, causal=False,
               seqlens=[1024, 2048, 4096], method=BM.METHOD)
    backends = [dict(name="fa1", kind="ours"), dict(name="torch", kind="baseline")]
    results = [dict(seqlen=s, backend="fa1", kind="ours", peak_bytes=s * 2**14,
                    inputs_bytes=s * 2**14, error=None, oom=False) for s in cfg["seqlens"]]
    results += [dict(seqlen=s, backend="torch", kind="baseline", peak_bytes=s * s * 64,
                     inputs_bytes=s * 2**14, error=None, oom=False) for s in (1024, 2048)]
    results.append(dict(seqlen=4096, backend="torch", kind="baseline", error="OOM", oom=True))
    report = dict(meta=META, config=cfg, backends=backends, results=results, complete=True)
    md = BM.render_markdown(report)
    assert "| seqlen | inputs MiB | fa1 | torch |" in md, md
    assert "| 4k | 64 | 64 | OOM |" in md, md
    assert "- torch: runs up to seqlen 2k; OOM from 4k" in md, md
    if BM.plot(report, tmp / "memory.png"):
        assert (tmp / "memory.png").stat().st_size > 10_000


def _oom(*_):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")


def _cpu_run(tmp: Path, tag: str, context_lost: bool = False) -> dict:
    """benchmark_attn.main on tiny CPU shapes with sdpa_efficient made to OOM; optionally every
    failure is reported as a lost CUDA context. Returns the JSON it wrote."""
    saved_fns, saved_alive = dict(C.BASELINE_FNS), C.cuda_alive
    C.BASELINE_FNS["sdpa_efficient"] = _oom
    if context_lost:
        C.cuda_alive = lambda device: False
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            rc = BA.main(["--device", "cpu", "--quick", "--seqlens", "64,128", "--hdims", "32",
                          "--total-tokens", "256", "--hidden", "64", "--reps", "2",
                          "--backends", "ours,fa3,cudnn,sdpa_flash,sdpa_efficient,torch",
                          "--tag", tag, "--out-dir", str(tmp), "--no-plot"])
    finally:
        C.BASELINE_FNS.update(saved_fns)
        C.cuda_alive = saved_alive
    assert rc == 0, quiet.getvalue()
    [path] = tmp.glob(f"attn_CPU_*_quick_{tag}.json")
    assert path.with_suffix(".md").exists()
    return json.loads(path.read_text())


def check_memory_run() -> None:
    """benchmark_memory's loop with the CUDA measurement replaced: records, OOM, refusals."""
    def fake_measure(fn, batch, seqlen, nheads, hdim, causal, dtype, device):
        if fn is C.BASELINE_FNS["torch"] and seqlen >= 4096:
            _oom()
        return dict(peak_bytes=seqlen * 2**12, peak_total_bytes=seqlen * 2**13,
                    inputs_bytes=seqlen * 2**12, ms=1.0)

    args = BM.parse_args(["--seqlens", "1k,2k,4k", "--backends", "fa1,torch,sdpa_flash"])
    backends = C.make_backends(C.expand_backend_names(args.backends, []), None, [], "no GPU")
    results: list[dict] = []
    saved, BM.measure = BM.measure, fake_measure
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            BM.run(args, torch.device("cpu"), backends, results, lambda: None)
    finally:
        BM.measure = saved
    cells = {(r["seqlen"], r["backend"]): r for r in results}
    assert len(cells) == 9
    assert cells[(1024, "fa1")]["error"] == "no GPU" and cells[(4096, "torch")]["oom"]
    assert cells[(4096, "sdpa_flash")]["peak_bytes"] == 4096 * 2**12
    report = dict(meta=META, config=dict(dtype="bf16", batch=1, nheads=16, hdim=128, causal=False,
                                         seqlens=args.seqlens, method=BM.METHOD),
                  backends=[dict(name=b.name, kind=b.kind) for b in backends], results=results)
    md = BM.render_markdown(report)
    assert "| 4k | 16 |  | OOM | 16 |" in md, md
    assert "- fa1: no GPU" in md, md


def check_cpu_run(tmp: Path) -> None:
    """The whole attention pipeline on tiny CPU shapes, with an injected OOM and refusals."""
    report = _cpu_run(tmp, "selfcheck")
    assert report["complete"] and report["meta"]["torch"] == torch.__version__
    cells = {(r["mode"], r["causal"], r["seqlen"], r["backend"]): r for r in report["results"]}
    assert len(cells) == 3 * 2 * 2 * len(report["backends"])
    for key, r in cells.items():
        if key[3] in ("sdpa_flash", "torch"):
            assert r["tflops"] > 0 and r["reps"] == 2 and r["n_input_sets"] >= 1, r
            assert r["check"]["ref"] == "sdpa_flash" and not r["check"]["suspicious"], r
        elif key[3] == "sdpa_efficient":
            assert r["oom"] and r["tflops"] is None, r
        else:
            assert r["error"] and r["tflops"] is None, r
    md = BA.render_markdown(report)
    assert md.count("| OOM |") == 12, md


def check_context_lost(tmp: Path) -> None:
    """After a failure that loses the CUDA context every later cell is skipped, files written."""
    report = _cpu_run(tmp, "lost", context_lost=True)
    assert report["complete"] and report["results"]
    for r in report["results"]:
        assert r["tflops"] is None and r["error"], r
        assert r["backend"] == "fa3" or r["error"].startswith("skipped: CUDA context lost"), r


def check_train_run(tmp: Path) -> None:
    """benchmark_train.main on a tiny CPU model: plain attention trains (MHA, and GQA with K / V
    repeated for it) from a first loss near ln(vocab); an SDPA kernel the CPU lacks is an error
    row."""
    losses = []
    for kv in ("2", "1"):
        with contextlib.redirect_stdout(io.StringIO()):
            code = BT.main(["--device", "cpu", "--quick", "--backends", "torch,cudnn", "--layers",
                            "1", "--hidden", "64", "--heads", "2", "--kv_heads", kv,
                            "--intermediate", "64", "--vocab", "50", "--seqlen", "32", "--steps",
                            "2", "--out-dir", str(tmp), "--tag", f"kv{kv}"])
        assert code == 0
        report = json.loads((tmp / f"train_CPU_bf16_quick_kv{kv}.json").read_text())
        rows = {r["backend"]: r for r in report["results"]}
        assert rows["torch"]["ms"] > 0 and len(rows["torch"]["times_ms"]) == 2, rows
        assert rows["cudnn"]["error"] and "ms" not in rows["cudnn"], rows
        losses.append(rows["torch"]["first_loss"])
        md = (tmp / f"train_CPU_bf16_quick_kv{kv}.md").read_text()
        assert "| torch |" in md and "1.000x" in md, md
    assert all(abs(x - 3.9) < 0.5 for x in losses), losses  # ~ln(50) at initialisation


def main() -> int:
    check_args()
    check_helpers()
    check_memory_run()
    with tempfile.TemporaryDirectory() as d:
        check_attn_output(Path(d))
        check_memory_output(Path(d))
        check_cpu_run(Path(d))
        check_context_lost(Path(d))
        check_train_run(Path(d))
    print("benchmarks selfcheck: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
