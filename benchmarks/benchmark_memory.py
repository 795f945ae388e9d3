#!/usr/bin/env python
"""Peak GPU memory of attention forward+backward against seqlen: our kernels, whose extra memory
grows linearly with seqlen, against plain PyTorch attention, which materialises the
seqlen x seqlen scores and runs out of memory (SDPA's flash kernel for reference).

    python benchmarks/benchmark_memory.py          # batch 1, 16 heads, head dim 128, 1k..64k

Writes benchmarks/results/memory_<GPU>_<date>.{md,json,png}; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402

FULL_SEQLENS = "1k,2k,4k,8k,16k,32k,64k"
QUICK_SEQLENS = "1k,4k,16k"
METHOD = ("one forward+backward (out = attn(q, k, v); torch.autograd.grad(out, (q, k, v), dout)) "
          "after one untimed warm-up of the same call (so one-time allocations such as the cuBLAS "
          "workspace are not counted); peak = torch.cuda.max_memory_allocated() after "
          "reset_peak_memory_stats(), minus memory_allocated() before the call, which holds q, k, "
          "v, dout and nothing else. The peak therefore includes the output, what autograd saves, "
          "workspaces and the returned dq, dk, dv.")


def measure(fn, batch, seqlen, nheads, hdim, causal, dtype, device) -> dict:
    shape = (batch, seqlen, nheads, hdim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device=device, dtype=dtype)

    def fwd_bwd():
        out = fn(q, k, v, causal)
        torch.autograd.grad(out, (q, k, v), dout)

    fwd_bwd()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fwd_bwd()
    end.record()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return dict(peak_bytes=peak - base, peak_total_bytes=peak, inputs_bytes=base,
                ms=start.elapsed_time(end))


def run(args, device, backends: list[C.Backend], results: list[dict], checkpoint) -> None:
    dtype = C.DTYPES[args.dtype]
    t0 = time.time()
    dead = None
    for seqlen in args.seqlens:
        for b in backends:
            error = dead or b.unavailable
            C.release_memory()
            rec, error = (None, error) if error else C.attempt(
                measure, b.fn, args.batch, seqlen, args.nheads, args.hdim, args.causal, dtype,
                device)
            if error and not dead and not C.cuda_alive(device):
                dead = f"skipped: CUDA context lost after {b.name} failed ({error})"
            results.append(dict(seqlen=seqlen, backend=b.name, kind=b.kind, **(rec or {}),
                                error=error, oom=error == "OOM"))
            what = (f"{rec['peak_bytes'] / 2**20:10.1f} MiB above inputs ({rec['ms']:.1f} ms)"
                    if rec else f"-- {error}")
            C.log(f"{time.time() - t0:5.0f}s  seqlen={seqlen:<6d} {b.name:14s} {what}")
        checkpoint()


# ---- output -----------------------------------------------------------------------------------

def render_markdown(report: dict) -> str:
    cfg, meta = report["config"], report["meta"]
    names = [b["name"] for b in report["backends"]]
    by_key = {(r["seqlen"], r["backend"]): r for r in report["results"]}
    rows = []
    for s in cfg["seqlens"]:
        cells = [by_key.get((s, n)) for n in names]
        if not any(cells):
            continue
        inputs = next((c["inputs_bytes"] for c in cells if c and c.get("inputs_bytes")), None)
        rows.append([C.fmt_seqlen(s), f"{inputs / 2**20:.0f}" if inputs else "",
                     *(f"{c['peak_bytes'] / 2**20:.0f}" if c and c.get("peak_bytes") is not None
                       else ("OOM" if c and c.get("oom") else "") for c in cells)])
    lines = [f"# Peak memory of attention forward+backward: {meta['device']}, {cfg['dtype']}", "",
             *C.meta_lines(meta),
             f"- batch {cfg['batch']}, nheads {cfg['nheads']}, head dim {cfg['hdim']}, "
             f"{'causal' if cfg['causal'] else 'non-causal'}",
             f"- method: {cfg['method']}", "",
             "MiB above the inputs (q, k, v, dout; their size in the second column). "
             "OOM: out of GPU memory; empty: the backend does not run it (reasons below).", "",
             C.markdown_table(["seqlen", "inputs MiB", *names], rows, right_from=1), ""]
    for n in names:
        ran = [r["seqlen"] for r in report["results"] if r["backend"] == n and r.get("peak_bytes")
               is not None]
        oom = [r["seqlen"] for r in report["results"] if r["backend"] == n and r.get("oom")]
        if ran:
            lines.append(f"- {n}: runs up to seqlen {C.fmt_seqlen(max(ran))}"
                         + (f"; OOM from {C.fmt_seqlen(min(oom))}" if oom else ""))
        elif oom:
            lines.append(f"- {n}: OOM from seqlen {C.fmt_seqlen(min(oom))}")
    reasons = {}
    for r in report["results"]:
        if r.get("error") and r["error"] != "OOM":
            reasons.setdefault(r["backend"], set()).add(r["error"])
    if reasons:
        lines += ["", "Why cells are empty:", ""]
        lines += [f"- {n}: {why}" for n, whys in reasons.items() for why in sorted(whys)]
    if not report.get("complete", True):
        lines += ["", "**Incomplete run: interrupted.**"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    plt = C.pyplot()
    if plt is None:
        return False
    cfg, meta = report["config"], report["meta"]
    kinds = {b["name"]: b["kind"] for b in report["backends"]}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gib = 2.0 ** 30
    limit = meta.get("memory_bytes")
    for i, n in enumerate(kinds):
        color = plt.get_cmap("tab10")(i % 10)
        rs = [r for r in report["results"] if r["backend"] == n]
        pts = sorted((r["seqlen"], r["peak_bytes"] / gib) for r in rs
                     if r.get("peak_bytes") is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=n,
                    linestyle="-" if kinds[n] == "ours" else "--",
                    linewidth=2.2 if kinds[n] == "ours" else 1.2)
        oom = [r["seqlen"] for r in rs if r.get("oom")]
        if oom and limit:
            ax.plot(oom, [limit / gib] * len(oom), marker="x", linestyle="none", color=color,
                    markersize=9, label=f"{n}: OOM")
    if limit:
        ax.axhline(limit / gib, color="gray", linestyle=":", linewidth=1)
        ax.annotate("GPU memory", (cfg["seqlens"][0], limit / gib), textcoords="offset points",
                    xytext=(0, 4), fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cfg["seqlens"], [C.fmt_seqlen(s) for s in cfg["seqlens"]])
    ax.set_xlabel("seqlen")
    ax.set_ylabel("peak GiB above inputs (fwd+bwd)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"{meta['device']}, {cfg['dtype']}: batch {cfg['batch']}, {cfg['nheads']} heads, "
                 f"head dim {cfg['hdim']}{', causal' if cfg['causal'] else ''}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- command line -----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Output: <out-dir>/memory_<GPU>[_fp16]_<YYYY-MM-DD>[_quick]"
                                       "[_<tag>].{md,json,png}; table also on stdout.")
    p.add_argument("--seqlens", type=C.parse_int_list,
                   help=f"comma list, '1k' allowed (default {FULL_SEQLENS})")
    p.add_argument("--batch", type=int, default=1, help="(default 1)")
    p.add_argument("--nheads", type=int, default=16, help="(default 16)")
    p.add_argument("--hdim", type=int, default=128, help="(default 128)")
    p.add_argument("--causal", action="store_true", help="causal attention (default non-causal)")
    p.add_argument("--dtype", choices=sorted(C.DTYPES), default="bf16", help="(default bf16)")
    p.add_argument("--backends", default="ours,torch,sdpa_flash",
                   help="comma list of our families (fa1, fa2, fa3; 'ours' = all available) and "
                        f"baselines ({', '.join(C.BASELINES)}) (default: %(default)s)")
    p.add_argument("--out-dir", type=Path, default=C.DEFAULT_OUT_DIR,
                   help="(default benchmarks/results)")
    p.add_argument("--tag", help="suffix for the output file names")
    p.add_argument("--quick", action="store_true", help=f"seqlens {QUICK_SEQLENS}: a smoke test")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = C.parse_int_list(QUICK_SEQLENS if args.quick else FULL_SEQLENS)
    try:
        args.backends = C.parse_name_list(args.backends, ("ours", *C.OUR_FAMILIES, *C.BASELINES))
    except ValueError as e:
        p.error(str(e))
    if not (args.seqlens and args.backends):
        p.error("empty grid")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        C.log("benchmark_memory: no CUDA GPU visible; this benchmark needs one")
        return 2
    device = torch.device("cuda")
    config = dict(dtype=args.dtype, batch=args.batch, nheads=args.nheads, hdim=args.hdim,
                  causal=args.causal, seqlens=args.seqlens, backends_requested=args.backends,
                  seed=args.seed, method=METHOD)
    return C.run_and_report(
        "memory", args, device, config,
        lambda backends, results, checkpoint: run(args, device, backends, results, checkpoint),
        render_markdown, plot)


if __name__ == "__main__":
    sys.exit(main())
