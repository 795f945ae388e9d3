"""Forward throughput where seqlen_q differs from seqlen_k: decode steps, chunked prefill and
cross-attention, where a call has few (query tile, head, batch) items and long keys, unlike
benchmark_attn.py's grid (seqlen_q = seqlen_k, 16k tokens). One table from one run: our
forward as dispatched, our forward with a tuning override (default fa3_stream_k=0, the FA3
forward without stream-K; csrc/common/tuning.h), SDPA's cuDNN and flash backends.

    python3 benchmarks/benchmark_cross.py --out-dir benchmarks/results --tag fa3sk

Timing as benchmark_attn.py's (its time_cell: CUDA events, fresh inputs past 2x L2, rounds that
alternate between the columns, the median); FLOPs 4 * batch * heads * hdim * the (query, key)
pairs computed: seqlen_q * seqlen_k, or under --causal (bottom-right aligned, as the API) the
pairs on or below the diagonal.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import benchmark_attn as B  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads), head dim from --hdims: a decode step, chunked prefill,
# short queries on long keys.
SHAPES = [(1, 1, 4096, 16), (4, 1, 8192, 8), (1, 128, 8192, 8), (2, 256, 16384, 8),
          (1, 512, 2048, 16), (1, 512, 4096, 8), (1, 512, 4096, 16), (1, 1024, 8192, 8),
          (1, 2048, 2048, 8)]


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) != 4:
            raise argparse.ArgumentTypeError(
                f"shape {item!r}: want batchxseqlen_qxseqlen_kxheads")
        shapes.append(tuple(int(x) for x in parts))
    return shapes


def attended_pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs a call computes: query i sees keys j <= i + sk - sq under a causal
    mask (bottom-right aligned)."""
    if not causal:
        return sq * sk
    return sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq))


def make_inputs(b, sq, sk, h, d, dtype, device) -> list[B.Inputs]:
    set_bytes = (2 * b * sq + 2 * b * sk) * h * d * torch.finfo(dtype).bits // 8
    n = B.n_input_sets(set_bytes, device)
    return [B.Inputs(torch.randn(b, sq, h, d, device=device, dtype=dtype),
                     torch.randn(b, sk, h, d, device=device, dtype=dtype),
                     torch.randn(b, sk, h, d, device=device, dtype=dtype),
                     torch.randn(b, sq, h, d, device=device, dtype=dtype)) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                    help="batchxseqlen_qxseqlen_kxheads,... (default: decode, chunked prefill)")
    ap.add_argument("--hdims", default="128,256")
    ap.add_argument("--backend", default="fa3")
    ap.add_argument("--tuning", default="fa3_stream_k=0",
                    help="NAME=value for the second column of ours (csrc/common/tuning.h)")
    ap.add_argument("--causal", action="store_true", help="causal mask (bottom-right)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(C.DTYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target-ms", type=float, default=150.0)
    ap.add_argument("--min-reps", type=int, default=6)
    ap.add_argument("--max-reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--tag")
    args = ap.parse_args(argv)

    fa, error = C.load_flash_attn()
    if fa is None:
        sys.exit(f"benchmark_cross: flash_attn did not import: {error}")
    device = torch.device("cuda")
    dtype = C.DTYPES[args.dtype]
    name, value = args.tuning.split("=", 1)
    columns = [(args.backend, C._ours_fn(fa, args.backend)),
               (f"{args.backend} {name}={value}",
                C._ours_fn(fa, args.backend, {name: int(value)})),
               ("cudnn", C.BASELINE_FNS["cudnn"]),
               ("sdpa_flash", C.BASELINE_FNS["sdpa_flash"])]
    round_args = argparse.Namespace(
        reps=0, warmup=args.warmup, rounds=1, target_ms=args.target_ms / args.rounds,
        min_reps=max(1, args.min_reps // args.rounds),
        max_reps=max(1, args.max_reps // args.rounds))
    header = ["hdim", "batch", "seqlen_q", "seqlen_k", "heads",
              *[f"{c} TFLOP/s" for c, _ in columns], f"{args.backend} / cudnn",
              f"{args.backend} / {name}={value}"]
    rows, records = [], []
    for d in C.parse_int_list(args.hdims):
        for b, sq, sk, h in args.shapes:
            sets = make_inputs(b, sq, sk, h, d, dtype, device)
            flops = 4 * b * h * d * attended_pairs(sq, sk, args.causal)
            times = {c: [] for c, _ in columns}
            errors = {}
            for _ in range(args.rounds):
                for label, fn in columns:
                    if label in errors:
                        continue
                    try:
                        times[label] += B.time_cell(fn, sets, args.causal, "fwd", round_args,
                                                    device)
                    except Exception as e:  # a baseline that does not take the shape
                        errors[label] = C.describe_error(e)
            tf = {c: flops / statistics.median(t) / 1e9 if t and c not in errors else None
                  for c, t in times.items()}
            fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
            rows.append([str(d), str(b), str(sq), str(sk), str(h),
                         *[fmt(tf[c]) for c, _ in columns],
                         ratio(tf[args.backend], tf["cudnn"]),
                         ratio(tf[args.backend], tf[columns[1][0]])])
            records.append({"hdim": d, "batch": b, "seqlen_q": sq, "seqlen_k": sk, "heads": h,
                            "tflops": tf, "ms": {c: t for c, t in times.items()},
                            "errors": errors})
            C.log(" | ".join(rows[-1]))
            del sets
            C.release_memory()
    table = C.markdown_table(header, rows, right_from=1)
    print(table)
    if args.out_dir is not None:
        meta = C.metadata(device, fa, [args.backend], None)
        tag = "_".join(t for t in ("causal" if args.causal else "", args.tag or "") if t)
        stem = C.output_stem("cross", meta, args.dtype, False, tag or None)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        lines = C.meta_lines(meta)
        (args.out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n\n" + table + "\n")
        C.write_json({"meta": meta, "dtype": args.dtype, "tuning": args.tuning,
                      "causal": args.causal,
                      "results": records}, args.out_dir / f"{stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
