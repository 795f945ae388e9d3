#!/usr/bin/env python
"""flash_attn_varlen_func against flash_attn_func, in one run on one GPU: what a packed batch
costs over a dense one (issue 34's bars).

    python benchmarks/benchmark_varlen.py              # fa2 and fa3 where they run, bf16
    python benchmarks/benchmark_varlen.py --quick

Two kinds of row, for each of our families that runs variable-length batches, head dim, causal
flag and mode:
- equal: batch * seqlen = --total-tokens in sequences of one length. The packed call reads the
  dense call's own tensors, flattened to (total, nheads, hdim) with cu_seqlens; same FLOPs.
  Bar: packed / dense >= 0.97.
- mixed: --mixed-count sequences with lengths drawn uniformly from --mixed-range (fixed seed),
  packed, against a dense batch of as many sequences at their mean length. Each call's TFLOP/s
  counts its own sequences' FLOPs (a long sequence's quadratic cost included). Bar: >= 0.90.

Timing is benchmark_attn.py's (time_cell: CUDA events, the GPU kept ahead of the host, inputs
rotated past L2); the two calls of a row alternate round by round, the order flipping each
round, and the ratio is the median of the rounds' ratios, so a drift of the clocks falls on
both. Writes varlen_<GPU>_<dtype>[...].{md,json} to --out-dir.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
import benchmark_attn as B  # noqa: E402

FULL = dict(seqlens="1k,2k,4k,8k,16k", hdims="64,128", target_ms=100.0, min_reps=5,
            max_reps=50, rounds=4)
QUICK = dict(seqlens="2k", hdims="128", target_ms=20.0, min_reps=3, max_reps=10, rounds=2)
BARS = {"equal": 0.97, "mixed": 0.90}


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)


def dense_fn(fa, family: str):
    def fn(q, k, v, causal):
        return fa.flash_attn_func(q, k, v, causal=causal, backend=family)
    return fn


def packed_fn(fa, family: str, lengths: list[int], device):
    """The same batch through flash_attn_varlen_func: q, k, v of shape (1 or batch, seqlen, ...)
    are flattened to the packed layout (a view, so gradients reach the same leaves)."""
    cu = cu_seqlens(lengths, device)
    longest = max(lengths)

    def fn(q, k, v, causal):
        out = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu,
                                        cu, longest, longest, causal=causal, backend=family)
        return out.view(q.shape)
    return fn


def flops_of(lengths: list[int], nheads: int, hdim: int, causal: bool, mode: str) -> float:
    return sum(B.attn_flops(1, nheads, n, n, hdim, causal, mode) for n in lengths)


class Rows:
    def __init__(self, args, device, fa, families: list[str], results: list[dict]):
        self.args, self.device, self.fa, self.results = args, device, fa, results
        self.families = families
        self.dtype = C.DTYPES[args.dtype]

    def run(self, checkpoint) -> None:
        a = self.args
        for hdim in a.hdims:
            nheads = max(1, a.hidden // hdim)
            for seqlen in a.seqlens:
                batch = max(1, a.total_tokens // seqlen)
                sets = B.make_input_sets(batch, seqlen, nheads, hdim, self.dtype, self.device)
                for family in self.families:
                    self.row("equal", family, hdim, nheads, f"{C.fmt_seqlen(seqlen)} x {batch}",
                             (dense_fn(self.fa, family), sets, [seqlen] * batch),
                             (packed_fn(self.fa, family, [seqlen] * batch, self.device), sets,
                              [seqlen] * batch))
                del sets
                C.release_memory()
                checkpoint()
            if a.mixed_count:
                self.mixed(hdim, nheads)
                C.release_memory()
                checkpoint()

    def mixed(self, hdim: int, nheads: int) -> None:
        a = self.args
        rng = random.Random(a.seed)
        lengths = [rng.randint(*a.mixed_range) for _ in range(a.mixed_count)]
        mean = round(sum(lengths) / len(lengths))
        packed_sets = B.make_input_sets(1, sum(lengths), nheads, hdim, self.dtype, self.device)
        dense_sets = B.make_input_sets(len(lengths), mean, nheads, hdim, self.dtype,
                                       self.device)
        label = (f"{len(lengths)} from {C.fmt_seqlen(a.mixed_range[0])}.."
                 f"{C.fmt_seqlen(a.mixed_range[1])}, mean {mean}, {sum(lengths)} tokens")
        for family in self.families:
            self.row("mixed", family, hdim, nheads, label,
                     (dense_fn(self.fa, family), dense_sets, [mean] * len(lengths)),
                     (packed_fn(self.fa, family, lengths, self.device), packed_sets, lengths))

    def row(self, kind, family, hdim, nheads, shape, dense, packed) -> None:
        a = self.args
        for causal in a.causal:
            for mode in a.modes:
                ms = {"dense": [], "packed": []}
                ratios, error = [], None
                for r in range(max(1, a.rounds)):
                    order = (("dense", dense), ("packed", packed))
                    round_ms = {}
                    for name, (fn, sets, _) in (order if r % 2 == 0 else order[::-1]):
                        t, error = C.attempt(B.time_cell, fn, sets, causal, mode, a,
                                             self.device)
                        if error:
                            break
                        round_ms[name] = statistics.median(t)
                        ms[name] += t
                    if error:
                        break
                    ratios.append(
                        flops_of(packed[2], nheads, hdim, causal, mode) / round_ms["packed"]
                        / (flops_of(dense[2], nheads, hdim, causal, mode) / round_ms["dense"]))
                cell = dict(kind=kind, family=family, hdim=hdim, nheads=nheads, shape=shape,
                            causal=causal, mode=mode, error=error)
                if not error:
                    for name, (_, _, lengths) in (("dense", dense), ("packed", packed)):
                        f = flops_of(lengths, nheads, hdim, causal, mode)
                        cell[f"{name}_tflops"] = f / statistics.median(ms[name]) / 1e9
                    cell["ratio"] = statistics.median(ratios)
                    cell["meets_bar"] = cell["ratio"] >= BARS[kind]
                self.results.append(cell)
                C.log(f"{kind} {family} hd{hdim} {shape} causal={causal} {mode}: "
                      + (error or f"{cell['dense_tflops']:.0f} / {cell['packed_tflops']:.0f} "
                                  f"TFLOP/s, ratio {cell['ratio']:.3f}"))


def render_markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# flash_attn_varlen_func vs flash_attn_func ({c['dtype']})", "",
             *C.meta_lines(report["meta"]), "",
             f"- hidden {c['hidden']}; equal: {c['total_tokens']} tokens a batch; mixed: "
             f"{c['mixed_count']} lengths uniform in {c['mixed_range']}, seed {c['seed']}; "
             f"bars: {BARS}", f"- timing: {c['timing']}", ""]
    rows = []
    for r in report["results"]:
        nums = (["-", "-", r["error"]] if r["error"] else
                [f"{r['dense_tflops']:.0f}", f"{r['packed_tflops']:.0f}",
                 f"{r['ratio']:.3f}" + ("" if r["meets_bar"] else " (below bar)")])
        rows.append([r["kind"], r["family"], str(r["hdim"]), "yes" if r["causal"] else "no",
                     r["mode"], r["shape"], *nums])
    lines.append(C.markdown_table(["kind", "family", "hdim", "causal", "mode", "shape",
                                   "dense TFLOP/s", "packed TFLOP/s", "packed / dense"],
                                  rows, 6))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=C.parse_int_list, help=f"equal rows (default "
                                                            f"{FULL['seqlens']})")
    p.add_argument("--hdims", type=C.parse_int_list, help=f"(default {FULL['hdims']})")
    p.add_argument("--causal", type=B._bools, default=[False, True],
                   help="false, true, or both (default both)")
    p.add_argument("--modes", default="fwd,fwd_bwd", help="subset of fwd,bwd,fwd_bwd")
    p.add_argument("--backends", default="fa2,fa3", help="our families (default fa2,fa3)")
    p.add_argument("--dtype", choices=sorted(C.DTYPES), default="bf16")
    p.add_argument("--total-tokens", type=int, default=16384, help="equal rows' batch * seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * hdim (default 2048)")
    p.add_argument("--mixed-count", type=int, default=64, help="0: no mixed rows (default 64)")
    p.add_argument("--mixed-range", type=C.parse_int_list, default=[128, 8192],
                   help="lo,hi of the mixed lengths (default 128,8k)")
    p.add_argument("--target-ms", type=float)
    p.add_argument("--min-reps", type=int)
    p.add_argument("--max-reps", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=C.DEFAULT_OUT_DIR)
    p.add_argument("--tag")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)  # no plot yet
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    C.apply_preset(args, QUICK if args.quick else FULL)
    args.reps = None
    try:
        args.modes = C.parse_name_list(args.modes, B.MODES)
        args.backends = C.parse_name_list(args.backends, C.OUR_FAMILIES)
    except ValueError as e:
        p.error(str(e))
    if len(args.mixed_range) != 2 or not 1 <= args.mixed_range[0] <= args.mixed_range[1]:
        p.error(f"--mixed-range wants lo,hi with 1 <= lo <= hi, got {args.mixed_range}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda")
    if not torch.cuda.is_available():
        C.log("benchmark_varlen: no CUDA GPU visible; this benchmark needs one")
        return 2
    config = dict(dtype=args.dtype, total_tokens=args.total_tokens, hidden=args.hidden,
                  seqlens=args.seqlens, hdims=args.hdims, causal=args.causal, modes=args.modes,
                  mixed_count=args.mixed_count, mixed_range=args.mixed_range,
                  target_ms=args.target_ms, min_reps=args.min_reps, max_reps=args.max_reps,
                  rounds=args.rounds, warmup=args.warmup, seed=args.seed, timing=B.TIMING,
                  flops=B.FLOPS)

    def run_cells(backends, results, checkpoint):
        from flash_attn import build_matrix
        fa, _ = C.load_flash_attn()
        families = []
        for b in backends:
            if b.fn is None:
                C.log(f"{b.name}: {b.unavailable}")
            elif "varlen" not in build_matrix.FAMILIES[b.name].features:
                C.log(f"{b.name}: no variable-length kernels in this version")
            else:
                families.append(b.name)
        Rows(args, device, fa, families, results).run(checkpoint)

    return C.run_and_report("varlen", args, device, config, run_cells, render_markdown,
                            lambda report, path: False)


if __name__ == "__main__":
    sys.exit(main())
