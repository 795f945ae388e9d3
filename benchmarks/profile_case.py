"""One attention case, forward and backward, a few times: the program to run under a profiler.

    ncu --kernel-name regex:fwd_kernel --launch-skip 2 --launch-count 1 \\
        python3 benchmarks/profile_case.py --backend fa2 --hdim 128 --seqlen 4096

--backend sdpa_flash / cudnn runs PyTorch's SDPA with that kernel instead, for a side-by-side
profile (its kernels: regex:flash_bwd / regex:cudnn).

Shapes follow benchmark_attn.py (batch = total_tokens // seqlen, nheads = hidden // hdim).
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn import flash_attn_func

SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", default="fa2")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--total-tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-bwd", action="store_true")
    args = ap.parse_args()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    batch, nheads = args.total_tokens // args.seqlen, args.hidden // args.hdim
    shape = (batch, args.seqlen, nheads, args.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=not args.no_bwd)
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dtype)
    def attention():
        if args.backend not in SDPA:
            return flash_attn_func(q, k, v, causal=args.causal, backend=args.backend)
        with sdpa_kernel(SDPA[args.backend]):  # SDPA's layout: (batch, nheads, seqlen, hdim)
            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=args.causal)
        return out.transpose(1, 2)

    for _ in range(args.iters):
        out = attention()
        if not args.no_bwd:
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    print(f"ran {args.iters} x {args.backend} {shape} causal={args.causal}")


if __name__ == "__main__":
    main()
