#!/usr/bin/env python
"""Two builds of flash_attn side by side in one run on one GPU: every cell is timed on each
build, in rounds that alternate between them (the order flips every round), so a drift of the
GPU's clocks falls on both alike, and the ratio of two builds is the median over rounds of
each round's ratio (a round's two builds run back to back, so a slow stretch of the GPU's
clocks, which moved whole rounds by up to 10% on an H100, falls on both halves of a pair).
The check that a change made no kernel slower: build the
old commit and the new tree, then

    python benchmarks/benchmark_ab.py --builds old=/tmp/old/src,new=src \\
        --cases fa3:fwd,fa2:fwd,fa2:bwd --hdims 64,128,256 --seqlens 1k,2k,4k,8k,16k

A build is a directory that holds flash_attn/ with its extension built in place (`python
setup.py build_ext --inplace` puts it in src/flash_attn/). Each build runs in a worker process
of its own (two extensions cannot share a process: both register torch.ops.flash_attn), fed
one cell at a time; both make the same inputs from the same seed (benchmark_attn.py's shapes,
sets and timing), so the outputs are compared too. Prints one row per cell (TFLOP/s of each
build, the last build over the first, and whether the outputs agree) and writes
ab_<GPU>_<date>.{md,json} to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import zlib
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))


# ---- the worker: one build, one process ------------------------------------------------------

def worker() -> int:
    import torch

    import _common as C
    import benchmark_attn as B
    import flash_attn

    device = torch.device("cuda")
    sets, sets_key = None, None
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the library prints stays off the protocol
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "quit":
            break
        if req["cmd"] == "info":
            flash_attn.available_backends()  # loads the extension
            reply = {"file": flash_attn.__file__, "version": flash_attn.__version__,
                     "backends": flash_attn.available_backends(),
                     "source_hash": getattr(sys.modules["flash_attn._C"], "source_hash",
                                            lambda: None)()}
        else:  # a cell: one round of timed repetitions
            key = (req["batch"], req["seqlen"], req["nheads"], req["hdim"], req["dtype"])
            if key != sets_key:
                sets = None
                C.release_memory()
                torch.manual_seed(zlib.crc32(repr(key).encode()))
                sets = B.make_input_sets(*key[:4], C.DTYPES[req["dtype"]], device)
                sets_key = key
            fn = C._ours_fn(flash_attn, req["backend"])
            round_args = argparse.Namespace(**req["round_args"])
            ms = B.time_cell(fn, sets, req["causal"], req["mode"], round_args, device)
            with torch.no_grad():
                o = fn(sets[0].q, sets[0].k, sets[0].v, req["causal"]).float()
            reply = {"ms": ms, "sum": o.sum().item(), "norm": o.norm().item()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


# ---- the driver -------------------------------------------------------------------------------

class Build:
    def __init__(self, label: str, path: str):
        self.label, self.path = label, str(Path(path).resolve())
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([self.path, env.get("PYTHONPATH", "")]).rstrip(":")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"build {self.label}: worker exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        self.proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--builds", help="label=path,label=path (the last is compared to the first)")
    ap.add_argument("--cases", default="fa3:fwd,fa2:fwd,fa2:bwd",
                    help="backend:mode,... (modes fwd, bwd, fwd_bwd)")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="1k,2k,4k,8k,16k")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--total-tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--target-ms", type=float, default=100.0)
    ap.add_argument("--min-reps", type=int, default=8)
    ap.add_argument("--max-reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--slower", type=float, default=0.98, help="flag ratios below this")
    ap.add_argument("--out-dir", type=Path)
    args = ap.parse_args(argv)
    if args.worker:
        return worker()

    import _common as C
    import benchmark_attn as B
    import torch

    builds = [Build(*item.split("=", 1)) for item in args.builds.split(",")]
    try:
        infos = {b.label: b.ask({"cmd": "info"}) for b in builds}
        for label, info in infos.items():
            C.log(f"{label}: {info}")
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
        round_args = dict(reps=0, warmup=args.warmup, rounds=1,
                          target_ms=args.target_ms / args.rounds,
                          min_reps=max(1, args.min_reps // args.rounds),
                          max_reps=max(1, args.max_reps // args.rounds))
        first, last = builds[0].label, builds[-1].label
        header = ["case", "causal", "hdim", "seqlen", *[f"{b.label} TFLOP/s" for b in builds],
                  f"{last} / {first}", "outputs"]
        rows, records = [], []
        for hdim in C.parse_int_list(args.hdims):
            for seqlen in C.parse_int_list(args.seqlens):
                batch = max(1, args.total_tokens // seqlen)
                nheads = max(1, args.hidden // hdim)
                for causal in B._bools(args.causal):
                    for backend, mode in cases:
                        cell = dict(cmd="cell", backend=backend, mode=mode, hdim=hdim,
                                    seqlen=seqlen, causal=causal, batch=batch, nheads=nheads,
                                    dtype=args.dtype, round_args=round_args)
                        times = {b.label: [] for b in builds}
                        pairs = []  # per round: the last build's speed over the first's
                        sums = {}
                        for r in range(args.rounds):
                            medians = {}
                            for b in (builds if r % 2 == 0 else builds[::-1]):
                                reply = b.ask(cell)
                                times[b.label] += reply["ms"]
                                medians[b.label] = statistics.median(reply["ms"])
                                sums[b.label] = (reply["sum"], reply["norm"])
                            pairs.append(medians[first] / medians[last])
                        flops = B.attn_flops(batch, nheads, seqlen, seqlen, hdim, causal, mode)
                        tf = {k: flops / statistics.median(v) / 1e9 for k, v in times.items()}
                        ratio = statistics.median(pairs)
                        (s0, n0), (s1, n1) = sums[first], sums[last]
                        same = "same" if (s0, n0) == (s1, n1) else (
                            f"norm rel {abs(n1 - n0) / max(abs(n0), 1e-30):.1e}")
                        rows.append([f"{backend} {mode}", "yes" if causal else "no", str(hdim),
                                     C.fmt_seqlen(seqlen), *[f"{tf[b.label]:.1f}" for b in builds],
                                     f"{ratio:.3f}" + (" *" if ratio < args.slower else ""),
                                     same])
                        records.append({"backend": backend, "mode": mode, "causal": causal,
                                        "hdim": hdim, "seqlen": seqlen, "batch": batch,
                                        "nheads": nheads, "tflops": tf, "ms": times,
                                        "round_ratios": pairs, "ratio": ratio,
                                        "outputs": sums})
                        C.log(" | ".join(rows[-1]))
    finally:
        for b in builds:
            b.close()
    table = C.markdown_table(header, rows, right_from=2)
    ratios = [r["ratio"] for r in records]
    summary = (f"{last} / {first} (median of per-round ratios): min {min(ratios):.3f}, geomean "
               f"{statistics.geometric_mean(ratios):.3f}, max {max(ratios):.3f} over "
               f"{len(ratios)} cells; below {args.slower}: "
               f"{sum(x < args.slower for x in ratios)} (marked *)")
    print(table + "\n\n" + summary)
    if args.out_dir is not None:
        device = torch.device("cuda")
        meta = C.metadata(device, None, [], "workers")
        meta["builds"] = infos
        stem = C.output_stem("ab", meta, args.dtype, False, None)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        lines = [f"# Two builds side by side (benchmark_ab.py): {meta['device']}, {args.dtype}", ""]
        lines += [line for line in C.meta_lines(meta) if "our backends" not in line]
        lines += [f"- build {label}: {info['file']} (source hash {info['source_hash']})"
                  for label, info in infos.items()]
        (args.out_dir / f"{stem}.md").write_text(
            "\n".join(lines) + "\n\n" + table + "\n\n" + summary + "\n")
        C.write_json({"meta": meta, "args": {k: str(v) for k, v in vars(args).items()},
                      "results": records}, args.out_dir / f"{stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
