"""A/B of one of the kernels' tuning overrides (csrc/common/tuning.h, the private _tuning of
flash_attn_func), in one process: each cell is timed with the override at each of its values
and with SDPA's flash backend, in rounds that alternate between them (so a clock drift falls
on all alike), on benchmark_attn.py's shapes.

    python3 benchmarks/ab_tuning.py --tuning fa2_dq_bulk=-1,0 --modes bwd \\
        --hdims 64,128 --seqlens 1k,2k,4k,16k --causal both

Prints one row per cell: TFLOP/s of each variant and of sdpa_flash, each variant over
sdpa_flash, and the last variant over the first. -1 is every override's automatic choice.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import benchmark_attn as B  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tuning", required=True, help="NAME=v1,v2,... (csrc/common/tuning.h)")
    ap.add_argument("--backend", default="fa2")
    ap.add_argument("--modes", default="bwd")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="1k,2k,4k,16k")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--total-tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--target-ms", type=float, default=100.0)
    ap.add_argument("--min-reps", type=int, default=8)
    ap.add_argument("--max-reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=0)
    args = ap.parse_args(argv)

    name, values = args.tuning.split("=", 1)
    values = [int(v) for v in values.split(",")]
    fa, error = C.load_flash_attn()
    if fa is None:
        sys.exit(f"ab_tuning: flash_attn did not import: {error}")
    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    causals = B._bools(args.causal)
    # time_cell times one round per call; the rounds are this script's loop.
    round_args = argparse.Namespace(**{**vars(args), "rounds": 1,
                                       "target_ms": args.target_ms / args.rounds,
                                       "min_reps": max(1, args.min_reps // args.rounds),
                                       "max_reps": max(1, args.max_reps // args.rounds),
                                       "reps": args.reps // args.rounds if args.reps else 0})
    variants = ([(f"{name}={v}", C._ours_fn(fa, args.backend, {name: v})) for v in values]
                + [("sdpa_flash", C.BASELINE_FNS["sdpa_flash"])])
    header = ["mode", "causal", "hdim", "seqlen", *[v for v, _ in variants],
              *[f"{v} / sdpa" for v, _ in variants[:-1]], "last / first"]
    rows = []
    for mode in C.parse_name_list(args.modes, ("fwd", "bwd", "fwd_bwd")):
        for causal in causals:
            for hdim in C.parse_int_list(args.hdims):
                for seqlen in C.parse_int_list(args.seqlens):
                    batch, nheads = args.total_tokens // seqlen, args.hidden // hdim
                    sets = B.make_input_sets(batch, seqlen, nheads, hdim, dtype, device)
                    flops = B.attn_flops(batch, nheads, seqlen, seqlen, hdim, causal, mode)
                    times = {label: [] for label, _ in variants}
                    for _ in range(args.rounds):
                        for label, fn in variants:
                            times[label] += B.time_cell(fn, sets, causal, mode, round_args,
                                                        device)
                    tf = {label: flops / statistics.median(t) / 1e9 for label, t in times.items()}
                    first, last = tf[variants[0][0]], tf[variants[-2][0]]
                    rows.append([mode, "yes" if causal else "no", str(hdim), C.fmt_seqlen(seqlen),
                                 *[f"{tf[v]:.1f}" for v, _ in variants],
                                 *[f"{tf[v] / tf['sdpa_flash']:.3f}" for v, _ in variants[:-1]],
                                 f"{last / first:.3f}"])
                    C.log(" | ".join(rows[-1]))
                    del sets
                    C.release_memory()
    print(C.markdown_table(header, rows, right_from=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
