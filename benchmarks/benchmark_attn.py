#!/usr/bin/env python
"""Attention throughput: every flash_attn backend this GPU runs against PyTorch's attention
(SDPA's cuDNN, flash and efficient kernels, and plain matmul-softmax-matmul), on the
FlashAttention papers' grid, in one run, into one table.

    python benchmarks/benchmark_attn.py            # full grid, all backends (a few minutes)
    python benchmarks/benchmark_attn.py --quick    # smoke test

Writes benchmarks/results/attn_<GPU>_<date>.{md,json,png}; see benchmarks/README.md for what is
measured and how.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402

MODES = ("fwd", "bwd", "fwd_bwd")
# The backward's five matmuls (one recomputes QK^T) against the forward's two: 2.5x.
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
# Forward outputs are compared with the first of these that runs the shape; a relative error
# (Frobenius) above CHECK_REL_TOL flags the cell: fast and wrong is not a result.
REF_ORDER = ("sdpa_efficient", "sdpa_flash", "cudnn", "torch")
CHECK_REL_TOL = 0.05

FULL = dict(seqlens="512,1024,2048,4096,8192,16384", hdims="64,128,256",
            target_ms=150.0, min_reps=6, max_reps=60, rounds=3)
QUICK = dict(seqlens="512,2048", hdims="64,128", target_ms=20.0, min_reps=3, max_reps=10,
             rounds=1)

TIMING = ("CUDA events around each repetition; median over reps; reps chosen so that timed work "
          "is about target_ms per cell (clamped to [min_reps, max_reps]) unless --reps is given; "
          "the reps of a cell come in `rounds` rounds that alternate between the backends "
          "(backend A, B, ..., then A, B, ... again), so a drift of the GPU's clocks during a "
          "shape's cells falls on every backend alike; warm-up calls at the start of each round; "
          "before a round's timed reps, a sleep kernel (1.5x the host's time to enqueue them, "
          "from the last warm-up call) keeps the GPU's queue ahead of the host, so that the "
          "events time the GPU's work, not host latency; repetitions rotate over n_input_sets "
          "sets of fresh torch.randn inputs (enough sets to exceed 2x L2 where memory allows, so "
          "inputs are not L2-resident). fwd: the forward with inputs requiring grad (a training "
          "forward). bwd: forward run untimed, then torch.autograd.grad(out, (q, k, v), dout) "
          "timed (no .grad accumulation). fwd_bwd: forward + the same autograd.grad, timed "
          "together.")
FLOPS = ("fwd = 4*batch*nheads*seqlen_q*seqlen_k*hdim, halved when causal; bwd = 2.5x fwd; "
         "fwd_bwd = 3.5x fwd; TFLOPS = FLOPs / median time")


def attn_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, hdim: int, causal: bool,
               mode: str) -> float:
    fwd = 4 * batch * nheads * seqlen_q * seqlen_k * hdim
    return fwd / (2 if causal else 1) * FLOP_FACTOR[mode]


# ---- inputs and timing ------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    q: torch.Tensor     # (batch, seqlen, nheads, hdim), requires grad
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor  # gradient of the output


def n_input_sets(set_bytes: int, device: torch.device) -> int:
    """Enough sets to exceed 2x L2, at most 64, and together at most a fifth of free memory."""
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20
    want = max(2, math.ceil(2 * l2 / set_bytes))
    fit = int(0.2 * torch.cuda.mem_get_info(device)[0]) // set_bytes
    return max(1, min(want, 64, fit))


def make_input_sets(batch, seqlen, nheads, hdim, dtype, device) -> list[Inputs]:
    shape = (batch, seqlen, nheads, hdim)
    set_bytes = 4 * math.prod(shape) * torch.finfo(dtype).bits // 8
    return [Inputs(*(torch.randn(shape, device=device, dtype=dtype).requires_grad_()
                     for _ in range(3)),
                   torch.randn(shape, device=device, dtype=dtype))
            for _ in range(n_input_sets(set_bytes, device))]


def time_cell(fn, sets: list[Inputs], causal: bool, mode: str, args, device) -> list[float]:
    """Milliseconds of each timed repetition of one round (1 / args.rounds of a cell)."""
    Event = C.event_class(device)

    def step(i, start, end):
        x = sets[i % len(sets)]
        if mode == "bwd":
            out = fn(x.q, x.k, x.v, causal)
            start.record()
            torch.autograd.grad(out, (x.q, x.k, x.v), x.dout)
        else:
            start.record()
            out = fn(x.q, x.k, x.v, causal)
            if mode == "fwd_bwd":
                torch.autograd.grad(out, (x.q, x.k, x.v), x.dout)
        end.record()

    # Warm-up absorbs one-time costs (cuDNN plan building, autotuning, allocator growth); the
    # last warm-up call's time sizes the number of repetitions.
    probe = (Event(enable_timing=True), Event(enable_timing=True))
    for i in range(args.warmup):
        host_start = time.perf_counter()
        step(i, *probe)
        host_ms = (time.perf_counter() - host_start) * 1e3
    C.synchronize(device)
    rounds = max(1, args.rounds)
    reps = (math.ceil(args.reps / rounds) if args.reps else
            min(math.ceil(args.max_reps / rounds), max(math.ceil(args.min_reps / rounds), math.ceil(
                args.target_ms / rounds / max(probe[0].elapsed_time(probe[1]), 1e-3)))))
    events = [(Event(enable_timing=True), Event(enable_timing=True)) for _ in range(reps)]
    # A call can take the host longer to enqueue than the GPU to run (512-token cells: Python,
    # argument checks, allocations against ~0.1 ms kernels); the GPU would then idle between
    # reps, and each start event, recorded before its call, would time the host as well. Work
    # queued first keeps the GPU behind the host for the whole round, so that the events time
    # the GPU's work only.
    C.queue_ahead(device, 1.5 * reps * host_ms)
    for i, (start, end) in enumerate(events):
        step(args.warmup + i, start, end)
    C.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _no_grad_forward(fn, x: Inputs, causal: bool) -> torch.Tensor:
    with torch.no_grad():
        return fn(x.q, x.k, x.v, causal)


def check_output(fn, x: Inputs, causal: bool, ref: torch.Tensor | None, ref_name: str | None):
    out = _no_grad_forward(fn, x, causal)
    if ref is None:
        return {"ref": None}
    diff = out.float() - ref.float()
    rel = (diff.norm() / ref.float().norm().clamp_min(1e-30)).item()
    max_abs = diff.abs().max().item()
    ok = math.isfinite(rel) and rel <= CHECK_REL_TOL
    return {"ref": ref_name, "rel_err": rel if math.isfinite(rel) else None,  # JSON has no NaN
            "max_abs_err": max_abs if math.isfinite(max_abs) else None, "suspicious": not ok}


# ---- the grid ---------------------------------------------------------------------------------

class Grid:
    """Walks the grid, appending one record per (mode, causal, hdim, seqlen, backend) to
    results. Input sets are made once per (hdim, seqlen) and shared by every backend."""

    def __init__(self, args, device, backends: list[C.Backend], results: list[dict]):
        self.args, self.device, self.backends, self.results = args, device, backends, results
        self.total = (len(args.hdims) * len(args.seqlens) * len(args.causal) * len(backends)
                      * len(args.modes))
        self.t0 = time.time()
        self.dead = None  # why nothing more can run, once a kernel fault has lost the context

    def attempt(self, f, *args):
        """C.attempt, noting when the failure was a kernel fault that lost the context."""
        value, error = C.attempt(f, *args)
        if error and not self.dead and not C.cuda_alive(self.device):
            self.dead = f"skipped: CUDA context lost after an error ({error})"
        return value, error

    def run(self, checkpoint) -> None:
        for hdim in self.args.hdims:
            for seqlen in self.args.seqlens:
                self.run_shape(hdim, seqlen)
                C.release_memory()
                checkpoint()

    def run_shape(self, hdim: int, seqlen: int) -> None:
        a = self.args
        shape = dict(hdim=hdim, seqlen=seqlen, batch=max(1, a.total_tokens // seqlen),
                     nheads=max(1, a.hidden // hdim))
        sets, sets_error = (None, self.dead) if self.dead else self.attempt(
            make_input_sets, shape["batch"], seqlen, shape["nheads"], hdim, C.DTYPES[a.dtype],
            self.device)
        for causal in a.causal:
            ref, ref_name = (self.reference_output(sets[0], causal) if sets and not self.dead
                             else (None, None))
            checks = {}
            for b in self.backends:
                check, error = None, self.dead or sets_error or b.unavailable
                if error is None:
                    # One untimed forward: checks the output, and a backend that refuses the
                    # shape is found once rather than once per mode.
                    check, error = self.attempt(check_output, b.fn, sets[0], causal, ref,
                                                ref_name)
                    if check and check.get("suspicious"):
                        C.log(f"WARNING: {b.name} output differs from {check['ref']}: "
                              f"relative error {check['rel_err']}")
                checks[b.name] = (check, error)
            for mode in a.modes:
                self.run_mode(shape, causal, mode, sets, checks)

    def reference_output(self, x: Inputs, causal: bool):
        """(output, backend name) of the first REF_ORDER baseline that runs this shape."""
        for name in REF_ORDER:
            out, _ = self.attempt(_no_grad_forward, C.BASELINE_FNS[name], x, causal)
            if out is not None:
                return out, name
            if self.dead:
                break
        return None, None

    def run_mode(self, shape: dict, causal: bool, mode: str, sets, checks: dict) -> None:
        """One cell per backend, their reps timed in interleaved rounds."""
        times = {b.name: [] for b in self.backends}
        errors = {b.name: checks[b.name][1] for b in self.backends}
        for _ in range(max(1, self.args.rounds)):
            for b in self.backends:
                if errors[b.name] is None and self.dead is None:
                    t, errors[b.name] = self.attempt(time_cell, b.fn, sets, causal, mode,
                                                     self.args, self.device)
                    times[b.name] += t or []
        flops = attn_flops(shape["batch"], shape["nheads"], shape["seqlen"], shape["seqlen"],
                           shape["hdim"], causal, mode)
        for b in self.backends:
            error = errors[b.name] or self.dead
            cell = dict(mode=mode, causal=causal, **shape, backend=b.name, kind=b.kind,
                        dtype=self.args.dtype, flops=flops,
                        **summarize(None if error else times[b.name], flops), error=error,
                        oom=error == "OOM", check=checks[b.name][0],
                        n_input_sets=len(sets or ()))
            self.results.append(cell)
            C.log(progress_line(len(self.results), self.total, time.time() - self.t0, cell))


def summarize(times: list[float] | None, flops: float) -> dict:
    if not times:
        return dict(ms=None, tflops=None)
    ms = statistics.median(times)
    return dict(ms=ms, tflops=flops / ms / 1e9, ms_min=min(times), ms_max=max(times),
                reps=len(times), times_ms=[round(t, 5) for t in times])


def progress_line(done: int, total: int, elapsed: float, c: dict) -> str:
    what = (f"{c['tflops']:7.1f} TFLOPS  {c['ms']:9.3f} ms x{c['reps']}" if c["ms"] is not None
            else f"-- {c['error']}")
    return (f"[{done:4d}/{total}] {elapsed:5.0f}s  {c['mode']:7s} causal={int(c['causal'])} "
            f"hdim={c['hdim']:<3d} seqlen={c['seqlen']:<5d} {c['backend']:14s} {what}")


# ---- output -----------------------------------------------------------------------------------

def cell_text(c: dict | None) -> str:
    if c is None or c.get("tflops") is None:
        return "OOM" if c and c.get("oom") else ""
    flag = "*" if (c.get("check") or {}).get("suspicious") else ""
    t = c["tflops"]
    return (f"{t:.1f}" if t >= 1 else f"{t:.2g}") + flag


def best(cells: list[dict | None], kind: str) -> float | None:
    vals = [c["tflops"] for c in cells if c and c["kind"] == kind and c.get("tflops")
            and not (c.get("check") or {}).get("suspicious")]
    return max(vals) if vals else None


def render_markdown(report: dict) -> str:
    cfg, meta = report["config"], report["meta"]
    names = [b["name"] for b in report["backends"]]
    by_key = {(r["mode"], r["causal"], r["hdim"], r["seqlen"], r["backend"]): r
              for r in report["results"]}
    rows = []
    for mode in cfg["modes"]:
        for causal in cfg["causal"]:
            for hdim in cfg["hdims"]:
                for seqlen in cfg["seqlens"]:
                    cells = [by_key.get((mode, causal, hdim, seqlen, n)) for n in names]
                    if not any(cells):
                        continue
                    ours, base = best(cells, "ours"), best(cells, "baseline")
                    rows.append([mode, "yes" if causal else "no", str(hdim), C.fmt_seqlen(seqlen),
                                 *map(cell_text, cells),
                                 f"{ours / base:.2f}x" if ours and base else ""])
    header = ["mode", "causal", "hdim", "seqlen", *names, "ours / best baseline"]
    lines = [f"# Attention TFLOPS: {meta['device']}, {cfg['dtype']}", "", *C.meta_lines(meta),
             f"- batch = {cfg['total_tokens']} // seqlen, nheads = {cfg['hidden']} // hdim; "
             f"FLOPs: {FLOPS}",
             f"- timing: {cfg['timing']}", ""]
    if not report.get("complete", True):
        lines += ["**Incomplete run: the grid was interrupted.**", ""]
    lines += [C.markdown_table(header, rows, right_from=2), "",
              "Cells: TFLOPS. Empty: the backend does not run that configuration (reasons below). "
              "OOM: out of GPU memory. `*`: forward output disagrees with the reference "
              f"(relative error > {CHECK_REL_TOL}); such cells are left out of the ratio.", ""]
    reasons: dict[str, dict[str, int]] = {}
    for r in report["results"]:
        if r.get("error") and r["error"] != "OOM":
            per = reasons.setdefault(r["backend"], {})
            per[r["error"]] = per.get(r["error"], 0) + 1
    if reasons:
        lines += ["Why cells are empty:", ""]
        lines += [f"- {n} ({count} cells): {why}" for n, per in reasons.items()
                  for why, count in per.items()]
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    plt = C.pyplot()
    if plt is None:
        return False
    cfg = report["config"]
    names = [b["name"] for b in report["backends"]]
    kinds = {b["name"]: b["kind"] for b in report["backends"]}
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    panels = [(m, c) for m in cfg["modes"] for c in cfg["causal"]]
    nrows, ncols = len(panels), len(cfg["hdims"])
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.1 * nrows), squeeze=False)
    for i, (mode, causal) in enumerate(panels):
        for j, hdim in enumerate(cfg["hdims"]):
            ax = axes[i][j]
            for n in names:
                pts = sorted((r["seqlen"], r["tflops"]) for r in report["results"]
                             if r["backend"] == n and r["mode"] == mode and r["causal"] == causal
                             and r["hdim"] == hdim and r.get("tflops"))
                if pts:
                    ours = kinds[n] == "ours"
                    ax.plot(*zip(*pts), label=n, color=colors[n], marker="o", markersize=3,
                            linestyle="-" if ours else "--", linewidth=2.2 if ours else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(cfg["seqlens"], [C.fmt_seqlen(s) for s in cfg["seqlens"]])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}, hdim {hdim}",
                         fontsize=9)
            if i == nrows - 1:
                ax.set_xlabel("seqlen")
            if j == 0:
                ax.set_ylabel("TFLOPS")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    height = fig.get_figheight()  # the title and legend take the top 0.75 inch
    fig.suptitle(f"{report['meta']['device']}, {cfg['dtype']}: attention TFLOPS, batch*seqlen = "
                 f"{cfg['total_tokens']}, hidden {cfg['hidden']}", y=1 - 0.05 / height, va="top")
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=len(handles),
                   bbox_to_anchor=(0.5, 1 - 0.3 / height), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- command line -----------------------------------------------------------------------------

def _bools(text: str) -> list[bool]:
    table = {"false": False, "0": False, "no": False, "true": True, "1": True, "yes": True}
    if text.strip().lower() == "both":
        return [False, True]
    try:
        return [table[t.strip().lower()] for t in text.split(",") if t.strip()]
    except KeyError as e:
        raise argparse.ArgumentTypeError(f"{e.args[0]!r} is not one of false, true, both")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Output: <out-dir>/attn_<GPU>[_fp16]_<YYYY-MM-DD>[_quick]"
                                       "[_<tag>].{md,json,png}; table also on stdout.")
    p.add_argument("--seqlens", type=C.parse_int_list,
                   help=f"comma list, '1k' allowed (default {FULL['seqlens']})")
    p.add_argument("--hdims", type=C.parse_int_list, help=f"head dims (default {FULL['hdims']})")
    p.add_argument("--causal", type=_bools, default=[False, True],
                   help="false, true, or both (default both)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="subset of fwd,bwd,fwd_bwd (default all)")
    p.add_argument("--backends", default="ours," + ",".join(C.BASELINES),
                   help="comma list of our families (fa1, fa2, fa3; 'ours' = every family "
                        "flash_attn.available_backends() lists; 'fa3+det' = fa3 with "
                        "deterministic=True) and baselines "
                        f"({', '.join(C.BASELINES)}) (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(C.DTYPES), default="bf16", help="(default bf16)")
    p.add_argument("--total-tokens", type=int, default=16384,
                   help="batch * seqlen (default 16384)")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * hdim (default 2048)")
    p.add_argument("--reps", type=int, help="fixed timed repetitions per cell (default adaptive)")
    p.add_argument("--target-ms", type=float,
                   help=f"adaptive reps: timed work per cell (default {FULL['target_ms']:g})")
    p.add_argument("--min-reps", type=int, help=f"(default {FULL['min_reps']})")
    p.add_argument("--max-reps", type=int, help=f"(default {FULL['max_reps']})")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls per cell and round (default 2)")
    p.add_argument("--rounds", type=int,
                   help="rounds alternating between backends per cell "
                        f"(default {FULL['rounds']})")
    p.add_argument("--out-dir", type=Path, default=C.DEFAULT_OUT_DIR,
                   help="(default benchmarks/results)")
    p.add_argument("--tag", help="suffix for the output file names")
    p.add_argument("--quick", action="store_true",
                   help=f"small grid (seqlens {QUICK['seqlens']}, hdims {QUICK['hdims']}) and "
                        "few reps: a smoke test")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: pipeline smoke test
    args = p.parse_args(argv)
    C.apply_preset(args, QUICK if args.quick else FULL)
    try:
        args.modes = C.parse_name_list(args.modes, MODES)
        args.backends = C.parse_name_list(args.backends, ("ours", *C.OUR_NAMES, *C.BASELINES))
    except ValueError as e:
        p.error(str(e))
    args.warmup = max(1, args.warmup)
    if not (args.seqlens and args.hdims and args.causal and args.modes and args.backends):
        p.error("empty grid")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        C.log("benchmark_attn: no CUDA GPU visible; this benchmark needs one")
        return 2
    config = dict(dtype=args.dtype, total_tokens=args.total_tokens, hidden=args.hidden,
                  seqlens=args.seqlens, hdims=args.hdims, causal=args.causal, modes=args.modes,
                  backends_requested=args.backends, reps=args.reps or "adaptive",
                  target_ms=args.target_ms, min_reps=args.min_reps, max_reps=args.max_reps,
                  rounds=args.rounds,
                  warmup=args.warmup, seed=args.seed, timing=TIMING, flops=FLOPS,
                  check=f"forward output vs first of {list(REF_ORDER)} that runs; "
                        f"suspicious if relative Frobenius error > {CHECK_REL_TOL}")
    return C.run_and_report(
        "attn", args, device, config,
        lambda backends, results, checkpoint: Grid(args, device, backends, results).run(checkpoint),
        # The .md file and stdout have always had one more newline than the report.
        lambda report: render_markdown(report) + "\n", plot)


if __name__ == "__main__":
    sys.exit(main())
