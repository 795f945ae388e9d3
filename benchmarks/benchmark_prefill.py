#!/usr/bin/env python
"""Chunked prefill over a KV cache, in one run on one GPU: flash_attn_with_kvcache appending
seqlen_q new tokens at cache_seqlens = length - seqlen_q and attending causally (bottom-right:
new token i sees the cache and new tokens 0..i), on each of our families that runs it, over a
contiguous cache and over paged ones; SDPA's backends on the same attention where they run it.

    python benchmarks/benchmark_prefill.py     # bf16 hdim 128, 32 / 8 heads, batch 4
    python benchmarks/benchmark_prefill.py --quick

Columns: TFLOP/s (4 x batch x heads x hdim x the (query, key) pairs on or below the diagonal)
of each family over the contiguous cache; SDPA: the fastest of its cuDNN / flash / efficient
backends with a lower-right causal mask over the cache's keys, K / V repeated to the query
heads (no append: the K / V it reads are ours after the call), and the fastest family over
it; paged:
each family's speed over pools of shuffled pages of --pages rows, over its own contiguous
call. GPU times per call from CUDA graphs (benchmark_decode.cuda_ms). Writes
prefill_<GPU>_<dtype>[...].{md,json} to --out-dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
import benchmark_decode as D  # noqa: E402


def sdpa_fns(q, k_cache, v_cache):
    """SDPA's fused backends on (q, the caches' keys) with the lower-right causal mask, K / V
    repeated to the query heads: SDPA's lower-right paths (torch.nn.attention.bias.CausalBias)
    call the flash and efficient kernels without GQA, and cuDNN through a materialised mask."""
    from torch.nn.attention.bias import causal_lower_right
    group = q.shape[2] // k_cache.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (c.repeat_interleave(group, dim=2).transpose(1, 2) for c in (k_cache, v_cache))
    mask = causal_lower_right(qt.shape[2], kt.shape[2])
    return C.sdpa_backend_fns(qt, kt, vt, ("cudnn", "flash", "efficient"), attn_mask=mask)


def row(fa, families, batch, length, seqlen_q, hdim, heads, heads_k, dtype, pages, reps):
    dev = torch.device("cuda")
    q = torch.randn(batch, seqlen_q, heads, hdim, device=dev, dtype=dtype)
    k_new, v_new = (torch.randn(batch, seqlen_q, heads_k, hdim, device=dev, dtype=dtype)
                    for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, length, heads_k, hdim, device=dev, dtype=dtype)
                        for _ in range(2))
    lens = torch.full((batch,), length - seqlen_q, dtype=torch.int32, device=dev)
    pairs = seqlen_q * (length - seqlen_q) + seqlen_q * (seqlen_q + 1) // 2
    flops = 4 * batch * heads * hdim * pairs
    r = dict(batch=batch, length=length, seqlen_q=seqlen_q, flops=flops, ms={}, errors={})

    def ours(family, kc, vc, **kw):
        return lambda: fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens,
                                                  causal=True, backend=family, **kw)

    def timed(key, fn):
        ms, error = C.attempt(D.cuda_ms, [fn], reps)
        r["ms"][key] = ms
        if error:
            r["errors"][key] = error

    for family in families:
        timed(family, ours(family, k_cache, v_cache))
    for name, fn in sdpa_fns(q, k_cache, v_cache).items():
        timed(f"sdpa_{name}", fn)
    for page in pages:
        k_pool, v_pool, table = D.paged(k_cache, v_cache, page)
        for family in families:
            timed(f"{family}_p{page}", ours(family, k_pool, v_pool, block_table=table))
        del k_pool, v_pool
        C.release_memory()
    return r


def render(report: dict) -> str:
    c, fams, pages = report["config"], report["families"], report["config"]["pages"]
    lines = [f"# Chunked prefill over a KV cache ({c['dtype']}, hdim {c['hdim']}, {c['heads']} / "
             f"{c['heads_k']} heads, causal)", "", *C.meta_lines(report["meta"]), "",
             "- TFLOP/s over the (query, key) pairs on or below the diagonal; SDPA: its fastest "
             "backend with a lower-right causal mask, K / V repeated to the query heads; paged: "
             "speed over the same family's contiguous call", ""]

    def tflops(r, key):
        ms = r["ms"].get(key)
        return None if ms is None else r["flops"] / ms / 1e9

    def fmt(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    rows = []
    for r in report["results"]:
        sdpa = [(k[5:], v) for k, v in r["ms"].items() if k.startswith("sdpa_") and v is not None]
        best = min(sdpa, key=lambda kv: kv[1]) if sdpa else None
        ours = [r["ms"][f] for f in fams if r["ms"].get(f) is not None]
        cells = [str(r["batch"]), C.fmt_seqlen(r["length"]), str(r["seqlen_q"])]
        cells += [fmt(tflops(r, f)) for f in fams]
        cells.append("-" if best is None else f"{best[0]} {r['flops'] / best[1] / 1e9:.0f}")
        cells.append("-" if best is None or not ours else f"{best[1] / min(ours):.2f}")
        for page in pages:
            for f in fams:
                a, b = r["ms"].get(f), r["ms"].get(f"{f}_p{page}")
                cells.append("-" if a is None or b is None else f"{a / b:.2f}")
        rows.append(cells)
    header = ["batch", "cache", "new", *[f"{f} TFLOP/s" for f in fams], "SDPA best TFLOP/s",
              "ours / SDPA", *[f"{f} page {p}" for p in pages for f in fams]]
    lines.append(C.markdown_table(header, rows, 3))
    errors = {f"{r['batch']}x{r['length']}+{r['seqlen_q']} {k}": v
              for r in report["results"] for k, v in r["errors"].items()}
    if errors:
        lines += ["", "Calls that did not run:", *[f"- {k}: {v}" for k, v in errors.items()]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lengths", type=C.parse_int_list, default=C.parse_int_list("8k,32k"),
                   help="keys after the call (cache and new tokens)")
    p.add_argument("--seqlens-q", type=C.parse_int_list, default=[512, 2048],
                   help="new tokens per call")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-k", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(C.DTYPES), default="bf16")
    p.add_argument("--pages", type=C.parse_int_list, default=[16, 64, 256])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out-dir", type=Path, default=C.DEFAULT_OUT_DIR)
    p.add_argument("--tag")
    p.add_argument("--quick", action="store_true", help="8k cache, 512 new tokens, page 16")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.seqlens_q, args.pages = [8192], [512], [16]
    started = C.start_report("prefill", args)
    if started is None:
        return 2
    fa, ours, report = started
    dtype = C.DTYPES[args.dtype]
    families = report["families"] = [f for f in ("fa3", "fa2") if f in ours]
    for length in args.lengths:
        for seqlen_q in args.seqlens_q:
            if seqlen_q > length:
                continue
            r = row(fa, families, args.batch, length, seqlen_q, args.hdim, args.heads,
                    args.heads_k, dtype, args.pages, args.reps)
            report["results"].append(r)
            C.log(f"cache {length} new {seqlen_q}: {r['ms']}")
            C.release_memory()
    return C.finish_report("prefill", args, report, render)


if __name__ == "__main__":
    sys.exit(main())
