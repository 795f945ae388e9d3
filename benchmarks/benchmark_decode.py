#!/usr/bin/env python
"""Decode against a KV cache, in one run on one GPU (issue 34's decode bars):
flash_attn_with_kvcache (one new token appended, then attention over the cache, contiguous and
paged) against a plain device-to-device copy of the same K / V bytes and against SDPA's backends
on the same cache, plus the host cost of one small call.

    python benchmarks/benchmark_decode.py            # hdim 128, 32 / 8 heads, batch 1-128
    python benchmarks/benchmark_decode.py --quick

GPU times are per call, from CUDA graphs of 10 calls or more (a serving loop's decode step is a
graph replay; the host's cost is its own row below), each call over its own layer's cache as in a
model's step: with caches smaller than the L2 cache, calls over one cache would read it from L2
(batch 1 x 8k is 34 MB, an H100's L2 50 MB), so a row cycles over enough layers' caches to span
four L2s. Rows: (batch, cache length, layout). Columns:
- ours: microseconds per call and the K / V bytes it reads per second (batch x length x
  nheads_k x hdim x 2 bytes x 2 tensors);
- copy: those bytes through `dst.copy_(src)` in the same run, counted read + written as a
  device-to-device copy's bandwidth is (bar: ours >= 80% of it, for caches >= 8k tokens);
- SDPA: the fastest of its cuDNN / flash / efficient / math backends that runs the same
  attention (q (b, 32, 1, d) against the cache's first length keys, GQA), and ours over it
  (bar: >= 1.2x);
- paged rows (page 16): ours paged over ours contiguous (bar: >= 0.9).
Host cost: CPU microseconds per call of a batch-1, 1k-token decode in a loop of 1000 calls
(the GPU's share is a few microseconds, so the host is the limit), ours and SDPA cuDNN's in
alternating rounds, the fastest round of each (bar: ours <= cuDNN's). Writes
decode_<GPU>_<dtype>[...].{md,json} to --out-dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402

HEADS, HEADS_K = 32, 8  # the shape (--heads / --heads-k)


def cuda_ms(fns, reps: int, inner: int = 10) -> float:
    """Median GPU milliseconds of one call: the calls in fns (one per layer) in turn,
    max(inner, len(fns)) of them captured in a CUDA graph (as a serving loop runs its decode
    step, and so that the host's cost per call, measured apart, does not leave the GPU idle
    between small calls), timed with CUDA events over reps replays. Calls that cannot be
    captured run in a plain loop instead."""
    calls = [fns[i % len(fns)] for i in range(max(inner, len(fns)))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture stream, as capture requires
        for fn in calls[:max(3, len(fns))]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - not capturable: time plain calls
        torch.cuda.synchronize()

        def run():
            for fn in calls:
                fn()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) / len(calls)


def host_us(fns: dict, calls: int = 1000, rounds: int = 7) -> dict:
    """CPU microseconds per call of each fn in a loop (the GPU work of each is tiny): rounds
    that alternate between the fns, the fastest round of each (one loop per side swung 20-30%
    between two runs on one machine, and swapped which side was faster). None for a fn that
    raised."""
    best = {}
    for name, fn in fns.items():
        try:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            best[name] = float("inf")
        except Exception as e:  # noqa: BLE001 - reported as a missing number
            C.log(f"host cost, {name}: {C.describe_error(e)}")
            best[name] = None
    for _ in range(rounds):
        for name, fn in fns.items():
            if best[name] is None:
                continue
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - start
            torch.cuda.synchronize()
            best[name] = min(best[name], elapsed / calls * 1e6)
    return best


def layers_for(nbytes: int) -> int:
    """Distinct caches a row cycles over: enough to span four L2 caches (at most 64)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(64, -(-4 * l2 // nbytes)))


def copy_ms(nbytes: int, reps: int) -> float:
    """Milliseconds of a device-to-device copy of nbytes, over as many buffer pairs as the
    decode row has layers (freed after)."""
    pairs = [(torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
              torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
             for _ in range(layers_for(nbytes))]
    return cuda_ms([lambda s=s, d=d: d.copy_(s) for s, d in pairs], reps)


def sdpa_fns(q, k_cache, v_cache, length):
    """SDPA's backends on the cache's first `length` keys, q as (b, h, 1, d)."""
    qt = q.transpose(1, 2)
    kt, vt = (c[:, :length].transpose(1, 2) for c in (k_cache, v_cache))
    return C.sdpa_backend_fns(qt, kt, vt, ("cudnn", "flash", "efficient", "math"),
                              enable_gqa=True)


def paged(k_cache, v_cache, page: int):
    """(k_pool, v_pool, block_table): the caches' rows in shuffled pages of `page` rows."""
    batch, capacity = k_cache.shape[:2]
    pages = -(-capacity // page)
    order = torch.randperm(batch * pages, device=k_cache.device)
    pools = []
    for cache in (k_cache, v_cache):
        padded = cache.new_zeros((batch, pages * page) + tuple(cache.shape[2:]))
        padded[:, :capacity] = cache
        pool = torch.empty_like(padded).view(batch * pages, page, *cache.shape[2:])
        pool[order] = padded.view(batch * pages, page, *cache.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], order.view(batch, pages).to(torch.int32)


def row(fa, batch: int, length: int, hdim: int, heads: int, heads_k: int, dtype, page: int,
        reps: int) -> dict:
    dev = torch.device("cuda")
    q = torch.randn(batch, 1, heads, hdim, device=dev, dtype=dtype)
    k_new, v_new = (torch.randn(batch, 1, heads_k, hdim, device=dev, dtype=dtype)
                    for _ in range(2))
    lens = torch.full((batch,), length - 1, dtype=torch.int32, device=dev)
    kv_bytes = 2 * batch * length * heads_k * hdim * dtype.itemsize
    layers = [tuple(torch.randn(batch, length, heads_k, hdim, device=dev, dtype=dtype)
                    for _ in range(2)) for _ in range(layers_for(kv_bytes))]
    r = dict(batch=batch, length=length, kv_bytes=kv_bytes, layers=len(layers))

    def ours(kc, vc, **kw):
        return lambda: fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens,
                                                  causal=True, **kw)
    r["ours_ms"], r["ours_error"] = C.attempt(cuda_ms, [ours(kc, vc) for kc, vc in layers], reps)
    r["copy_ms"] = copy_ms(kv_bytes, reps)
    best = None
    per_layer = [sdpa_fns(q, kc, vc, length) for kc, vc in layers]
    for name in per_layer[0]:
        ms, error = C.attempt(cuda_ms, [fns[name] for fns in per_layer], reps)
        r[f"sdpa_{name}_ms"] = ms
        if ms is not None and (best is None or ms < best[1]):
            best = (name, ms)
    r["sdpa_best"] = best
    del per_layer
    pools = [paged(kc, vc, page) for kc, vc in layers]
    del layers
    r["paged_ms"], r["paged_error"] = C.attempt(
        cuda_ms, [ours(kp, vp, block_table=t) for kp, vp, t in pools], reps)
    return r


def render(report: dict) -> str:
    c = report["config"]
    lines = [f"# Decode over a KV cache ({c['dtype']}, hdim {c['hdim']}, {c['heads']} / "
             f"{c['heads_k']} heads, page {c['page']})", "", *C.meta_lines(report["meta"]), "",
             "- bandwidth: K / V bytes read per second (ours, SDPA); the copy counts read + "
             "written; bars: ours >= 0.8 x copy from 8k tokens, >= 1.2 x the best SDPA, "
             "paged >= 0.9 x contiguous",
             "- layers: the caches a row's calls cycle over (each call its own, as a model's "
             "layers), enough to span four L2 caches, so that K / V come from memory", ""]
    rows = []
    for r in report["results"]:
        def bw(ms, factor=1):
            return "-" if ms is None else f"{factor * r['kv_bytes'] / ms / 1e9:.2f}"
        best = r["sdpa_best"]
        rows.append([
            str(r["batch"]), C.fmt_seqlen(r["length"]), str(r.get("layers", 1)),
            "-" if r["ours_ms"] is None else f"{r['ours_ms'] * 1e3:.1f}", bw(r["ours_ms"]),
            bw(r["copy_ms"], 2),
            "-" if r["ours_ms"] is None else
            f"{r['kv_bytes'] / r['ours_ms'] / (2 * r['kv_bytes'] / r['copy_ms']):.2f}",
            "-" if best is None else f"{best[0]} {best[1] * 1e3:.1f}",
            "-" if best is None or r["ours_ms"] is None else f"{best[1] / r['ours_ms']:.2f}",
            "-" if r["paged_ms"] is None or r["ours_ms"] is None
            else f"{r['ours_ms'] / r['paged_ms']:.2f}"])
    lines.append(C.markdown_table(
        ["batch", "cache", "layers", "ours us", "ours TB/s", "copy TB/s", "ours / copy",
         "SDPA best us", "SDPA / ours", "paged speed / contiguous"], rows, 2))
    h = report["host"]
    lines += ["", f"Host cost per call (batch 1, 1k cache): ours {h.get('ours_us', '-')} us, "
                  f"SDPA cuDNN {h.get('cudnn_us', '-')} us."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=C.parse_int_list, default=[1, 2, 4, 8, 32, 128])
    p.add_argument("--lengths", type=C.parse_int_list, default=C.parse_int_list("1k,8k,32k,128k"))
    p.add_argument("--max-tokens", type=int, default=1 << 22,
                   help="skip rows with batch x length above this (memory)")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--heads-k", type=int, default=HEADS_K)
    p.add_argument("--dtype", choices=sorted(C.DTYPES), default="bf16")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out-dir", type=Path, default=C.DEFAULT_OUT_DIR)
    p.add_argument("--tag")
    p.add_argument("--quick", action="store_true", help="batch 1, 8; cache 1k, 8k")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.lengths = [1, 8], [1024, 8192]
    started = C.start_report("decode", args)
    if started is None:
        return 2
    fa, _, report = started
    report["host"] = {}
    dtype = C.DTYPES[args.dtype]
    for batch in args.batches:
        for length in args.lengths:
            if batch * length > args.max_tokens:
                continue
            r = row(fa, batch, length, args.hdim, args.heads, args.heads_k, dtype, args.page,
                    args.reps)
            report["results"].append(r)
            C.log(f"batch {batch} cache {length}: ours {r['ours_ms']} ms "
                  f"({r['ours_error'] or 'ok'}), copy {r['copy_ms']} ms, SDPA {r['sdpa_best']}, "
                  f"paged {r['paged_ms']} ms ({r['paged_error'] or 'ok'})")
            C.release_memory()
    # Host cost: one small decode in a loop.
    dev = torch.device("cuda")
    q = torch.randn(1, 1, args.heads, args.hdim, device=dev, dtype=dtype)
    kc, vc = (torch.randn(1, 1024, args.heads_k, args.hdim, device=dev, dtype=dtype)
              for _ in range(2))
    kn, vn = (torch.randn(1, 1, args.heads_k, args.hdim, device=dev, dtype=dtype)
              for _ in range(2))
    lens = torch.full((1,), 1023, dtype=torch.int32, device=dev)

    def ours():
        return fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
    host = host_us({"ours": ours, "cudnn": sdpa_fns(q, kc, vc, 1024)["cudnn"]})
    for name, us in host.items():
        report["host"][f"{name}_us"] = None if us is None else round(us, 1)
    return C.finish_report("decode", args, report, render)


if __name__ == "__main__":
    sys.exit(main())
