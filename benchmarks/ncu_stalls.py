"""Where a kernel's warps wait, from Nsight Compute's source page: stall samples by reason, by
opcode and by instruction, for one or more kernels side by side (ours vs SDPA's, say).

On the GPU machine (the report needs the SourceCounters section; -lineinfo builds also map
instructions to source lines):

    ncu --kernel-name regex:bwd_kernel --launch-skip 1 --launch-count 1 \\
        --section SourceCounters -o /tmp/ours \\
        python3 benchmarks/profile_case.py --backend fa2 --hdim 256 --seqlen 4096
    ncu -i /tmp/ours.ncu-rep --page source --csv --print-source sass > ours.csv
    python3 benchmarks/ncu_stalls.py ours.csv sdpa.csv --top 15

Prints per file: the share of samples of each stall reason; per opcode, the instructions
executed, shared-memory wavefronts (and the excess over ideal, i.e. bank conflicts from the
access pattern) and the samples with their main reasons; then the instructions with the most
samples, with their neighbourhood index so the SASS around them can be read in the CSV.
"""

import argparse
import collections
import csv
import re
import sys

STALL_PREFIX = "stall_"


def load(path):
    """Rows of the SASS table as dicts; the CSV has a kernel-name line or two before the
    header."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    try:
        header_at = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    except StopIteration:
        sys.exit(f"ncu_stalls: {path}: no 'Address', 'Source' header (was the report taken "
                 "with --section SourceCounters and printed with --page source --csv?)")
    header = rows[header_at]
    return header, [dict(zip(header, r)) for r in rows[header_at + 1:] if len(r) == len(header)]


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(sass):
    """'@!P0 LDSM.16.MT88.4 R4, [R8]' -> 'LDSM.16.MT88.4'."""
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return text.split(" ", 1)[0] if text else ""


def report(path, top):
    header, rows = load(path)
    reasons = [c for c in header if c.startswith(STALL_PREFIX) and "Not Issued" not in c]
    samples = sum(number(r.get("# Samples")) for r in rows) or 1.0
    print(f"== {path}: {len(rows)} instructions, {samples:.0f} samples")

    by_reason = collections.Counter()
    for r in rows:
        for c in reasons:
            by_reason[c] += number(r[c])
    print("stall reasons: " + ", ".join(f"{c[len(STALL_PREFIX):]} {100 * v / samples:.1f}%"
                                        for c, v in by_reason.most_common(10) if v))

    ops = collections.defaultdict(lambda: {"inst": 0.0, "wavefronts": 0.0, "excess": 0.0,
                                           "samples": 0.0, "reasons": collections.Counter()})
    for r in rows:
        o = ops[opcode(r["Source"])]
        o["inst"] += number(r.get("Instructions Executed"))
        o["wavefronts"] += number(r.get("L1 Wavefronts Shared"))
        o["excess"] += number(r.get("L1 Wavefronts Shared Excessive"))
        o["samples"] += number(r.get("# Samples"))
        for c in reasons:
            o["reasons"][c] += number(r[c])
    print(f"{'opcode':<34} {'inst M':>9} {'smem wf M':>10} {'excess M':>9} {'samples':>8}  "
          "main reasons")
    for name, o in sorted(ops.items(), key=lambda kv: -kv[1]["samples"])[:top]:
        main = ", ".join(f"{c[len(STALL_PREFIX):]} {100 * v / samples:.1f}"
                         for c, v in o["reasons"].most_common(3) if v)
        print(f"{name:<34} {o['inst'] / 1e6:9.2f} {o['wavefronts'] / 1e6:10.2f} "
              f"{o['excess'] / 1e6:9.2f} {100 * o['samples'] / samples:7.1f}%  {main}")

    print("instructions with the most samples (#row in the SASS table):")
    ranked = sorted(range(len(rows)), key=lambda i: -number(rows[i].get("# Samples")))[:top]
    for i in sorted(ranked):
        r = rows[i]
        reason = max(reasons, key=lambda c: number(r[c])) if reasons else ""
        print(f"  #{i:<5} {100 * number(r.get('# Samples')) / samples:5.2f}%  "
              f"{reason[len(STALL_PREFIX):]:<14} {r['Source'].strip()[:90]}")
    print()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=12, help="rows per table")
    args = ap.parse_args(argv)
    for path in args.csv:
        report(path, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
