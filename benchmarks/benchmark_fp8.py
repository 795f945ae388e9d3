#!/usr/bin/env python
"""FP8 (e4m3) attention forward against the 16-bit forwards, in one run on one GPU (issue 36's
bars).

    python benchmarks/benchmark_fp8.py            # hdim 64 / 128 / 256, causal and not, 1k-16k
    python benchmarks/benchmark_fp8.py --quick

Per (head dim, causal, seqlen) at batch * seqlen = --total-tokens, hidden --hidden, inference
calls (torch.no_grad):
- fp8: fa3's e4m3 forward on inputs quantised beforehand (flash_attn.fp8.quantize);
- quantize + fp8: quantize (Hadamard rotation, per-(batch, KV head) scales) and the forward,
  from bf16 inputs, timed together;
- bf16: fa3's bf16 forward; SDPA cuDNN bf16: torch's cuDNN attention on the same bf16 inputs;
- cuDNN fp8: cuDNN's FP8 attention (the nvidia-cudnn-frontend package's sdpa_fp8, an optional
  benchmark dependency, see _cudnn_fp8.py) on the same e4m3 inputs, with per-tensor descales and
  e4m3 output (what it supports on Hopper). Its output is checked once per cell against ours run
  with the same per-tensor descales; a mismatch is reported in the cell's errors and not timed.

Timing is benchmark_attn.py's time_cell (CUDA events, the GPU kept ahead of the host, inputs
rotated past L2); every backend of a cell runs in each round, the order turning round by round.
TFLOP/s counts 4 * batch * heads * seqlen^2 * hdim (halved when causal). Writes
fp8_<GPU>_bf16[...].{md,json} to --out-dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
import _cudnn_fp8  # noqa: E402
import benchmark_attn as B  # noqa: E402

FULL = dict(seqlens="1k,2k,4k,8k,16k", hdims="64,128,256", target_ms=100.0, min_reps=5,
            max_reps=50, rounds=4)
QUICK = dict(seqlens="2k,8k", hdims="128", target_ms=20.0, min_reps=3, max_reps=10, rounds=2)
COLUMNS = ("fp8", "cuDNN fp8", "quantize + fp8", "bf16", "SDPA cuDNN bf16")


class FP8Inputs:
    """A set of e4m3 inputs with their descales, shaped like B.Inputs for time_cell."""

    def __init__(self, x: B.Inputs, fa):
        with torch.no_grad():
            self.q, self.k, self.v, self.descales = fa.fp8.quantize(x.q, x.k, x.v)
            self.scalar_descales = _cudnn_fp8.per_tensor_descales(self.descales)
        self.dout = None


def check_cudnn_fp8(fa, cudnn_fp8, x: FP8Inputs, causal: bool) -> str | None:
    """Why cuDNN's output is not ours (None when it is): both run on the same e4m3 inputs with
    the same per-tensor descales; cuDNN's e4m3 output rounds to 2^-4 relative."""
    d = x.scalar_descales
    b, hk = x.descales["q_descale"].shape
    with torch.no_grad():
        ours = fa.flash_attn_func(x.q, x.k, x.v, causal=causal, **{
            n: d[n].reshape(1, 1).expand(b, hk).contiguous()
            for n in ("q_descale", "k_descale", "v_descale")}).float()
        theirs = cudnn_fp8(x.q, x.k, x.v, causal, d).float() * d["v_descale"].reshape(())
    rel = ((theirs - ours).norm() / ours.norm()).item()
    return None if rel < 0.1 else f"output differs from ours by {rel:.3f} (relative RMS)"


def cell_fns(fa):
    def fp8(q, k, v, causal, descales):
        with torch.no_grad():
            return fa.flash_attn_func(q, k, v, causal=causal, **descales)

    def quantize_fp8(q, k, v, causal):
        with torch.no_grad():
            q8, k8, v8, descales = fa.fp8.quantize(q, k, v)
            return fa.flash_attn_func(q8, k8, v8, causal=causal, **descales)

    def bf16(q, k, v, causal):
        with torch.no_grad():
            return fa.flash_attn_func(q, k, v, causal=causal, backend="fa3")

    def cudnn(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

    return fp8, quantize_fp8, bf16, cudnn


def run(args, device, config, results, checkpoint) -> None:
    fa, error = C.load_flash_attn()
    if fa is None:
        C.log(f"flash_attn: {error}")
        return
    fp8, quantize_fp8, bf16, cudnn = cell_fns(fa)
    try:
        cudnn_fp8 = _cudnn_fp8.CudnnFp8(device)
        cudnn_fp8_error = None
        C.log(f"cuDNN fp8: {cudnn_fp8.version}")
    except Exception as e:  # noqa: BLE001  (an optional baseline: any failure is reported)
        cudnn_fp8, cudnn_fp8_error = None, f"not measured: {C.describe_error(e)}"
        C.log(f"cuDNN fp8: {cudnn_fp8_error}")
    config["cudnn_fp8"] = cudnn_fp8.version if cudnn_fp8 else cudnn_fp8_error
    for hdim in args.hdims:
        nheads = max(1, args.hidden // hdim)
        for seqlen in args.seqlens:
            batch = max(1, args.total_tokens // seqlen)
            sets = B.make_input_sets(batch, seqlen, nheads, hdim, torch.bfloat16, device)
            sets8 = [FP8Inputs(x, fa) for x in sets]
            for causal in args.causal:
                backends = {
                    "fp8": (lambda q, k, v, c, _s=sets8: fp8(q, k, v, c, _s[0].descales), sets8),
                    "cuDNN fp8": (lambda q, k, v, c, _s=sets8: cudnn_fp8(
                        q, k, v, c, _s[0].scalar_descales), sets8),
                    "quantize + fp8": (quantize_fp8, sets),
                    "bf16": (bf16, sets),
                    "SDPA cuDNN bf16": (cudnn, sets),
                }
                ms = {name: [] for name in backends}
                errors = {}
                if cudnn_fp8 is None:
                    errors["cuDNN fp8"] = cudnn_fp8_error
                else:
                    why, err = C.attempt(check_cudnn_fp8, fa, cudnn_fp8, sets8[0], causal)
                    if why or err:
                        errors["cuDNN fp8"] = why or err
                for r in range(max(1, args.rounds)):
                    names = list(backends)
                    for name in (names if r % 2 == 0 else names[::-1]):
                        if name in errors:
                            continue
                        fn, fn_sets = backends[name]
                        t, err = C.attempt(B.time_cell, fn, fn_sets, causal, "fwd", args, device)
                        if err:
                            errors[name] = err
                        else:
                            ms[name] += t
                flops = B.attn_flops(batch, nheads, seqlen, seqlen, hdim, causal, "fwd")
                cell = dict(hdim=hdim, nheads=nheads, seqlen=seqlen, batch=batch, causal=causal,
                            errors=errors)
                for name in backends:
                    if name not in errors and ms[name]:
                        cell[name] = flops / statistics.median(ms[name]) / 1e9
                results.append(cell)
                C.log(f"hd{hdim} {C.fmt_seqlen(seqlen)} causal={causal}: " + ", ".join(
                    f"{n} {cell[n]:.0f}" if n in cell else f"{n} {errors.get(n)}"
                    for n in backends))
            del sets, sets8
            C.release_memory()
            checkpoint()


def render_markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# FP8 attention forward (e4m3 in, bf16 out) against bf16", "",
             *C.meta_lines(report["meta"]), "",
             f"- batch x seqlen = {c['total_tokens']} tokens, hidden {c['hidden']}; inference "
             f"calls (no_grad); TFLOP/s of the forward", f"- timing: {c['timing']}",
             f"- cuDNN fp8: {c.get('cudnn_fp8', '-')}; per-tensor descales and e4m3 output "
             f"(Hopper's only FP8 output), ours per-(batch, KV head) descales and bf16 output", ""]
    errs = sorted({f"{n}: {e}" for r in report["results"] for n, e in r["errors"].items()})
    if errs:
        lines += ["Not measured:", *[f"- {e}" for e in errs], ""]
    rows = []
    for r in report["results"]:
        nums = [f"{r[n]:.0f}" if n in r else "-" for n in COLUMNS]
        ratio = (lambda a, b: f"{r[a] / r[b]:.2f}" if a in r and b in r else "-")
        rows.append([str(r["hdim"]), "yes" if r["causal"] else "no", C.fmt_seqlen(r["seqlen"]),
                     *nums, ratio("fp8", "cuDNN fp8"), ratio("fp8", "bf16"), ratio("quantize + fp8", "bf16"),
                     ratio("fp8", "SDPA cuDNN bf16")])
    lines.append(C.markdown_table(["hdim", "causal", "seqlen", *[f"{n} TFLOP/s" for n in COLUMNS],
                                   "fp8 / cuDNN fp8", "fp8 / bf16", "quantize + fp8 / bf16", "fp8 / cuDNN bf16"],
                                  rows, 3))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=C.parse_int_list, help=f"(default {FULL['seqlens']})")
    p.add_argument("--hdims", type=C.parse_int_list, help=f"(default {FULL['hdims']})")
    p.add_argument("--causal", type=B._bools, default=[False, True],
                   help="false, true, or both (default both)")
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048, help="nheads * hdim (default 2048)")
    p.add_argument("--target-ms", type=float)
    p.add_argument("--min-reps", type=int)
    p.add_argument("--max-reps", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=C.DEFAULT_OUT_DIR)
    p.add_argument("--tag")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    C.apply_preset(args, QUICK if args.quick else FULL)
    args.reps, args.backends, args.dtype = None, [], "bf16"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda")
    if not torch.cuda.is_available():
        C.log("benchmark_fp8: no CUDA GPU visible; this benchmark needs one")
        return 2
    config = dict(total_tokens=args.total_tokens, hidden=args.hidden, seqlens=args.seqlens,
                  hdims=args.hdims, causal=args.causal, target_ms=args.target_ms,
                  min_reps=args.min_reps, max_reps=args.max_reps, rounds=args.rounds,
                  warmup=args.warmup, seed=args.seed,
                  timing=B.TIMING + " Here every cell is a forward under torch.no_grad.")
    return C.run_and_report("fp8", args, device, config,
                            lambda backends, results, checkpoint: run(args, device, config,
                                                                      results, checkpoint),
                            render_markdown, lambda report, path: False)


if __name__ == "__main__":
    sys.exit(main())
