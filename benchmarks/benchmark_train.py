#!/usr/bin/env python
"""Training-step throughput: a Llama-style decoder (RMSNorm, rotary, causal attention, SwiGLU)
trained for a few steps (forward, cross-entropy loss, backward, fused AdamW step) with its
attention on each backend, all in one run on one GPU. The rest of the model is the same code, so
differences between backends are their attention's forward and backward.

    python benchmarks/benchmark_train.py                      # 8 layers, hidden 2048, seqlen 4k
    python benchmarks/benchmark_train.py --model hf           # HF transformers' LlamaForCausalLM
    python benchmarks/benchmark_train.py --quick              # smoke test
    python benchmarks/benchmark_train.py --profile            # + the attention's share

--model own (default) is this file's decoder, whose attention is flash_attn_func (ours) or
SDPA with one kernel forced (cudnn, sdpa_flash). --model hf builds transformers'
LlamaForCausalLM (when transformers is installed) with attn_implementation "flash_attention_2"
(transformers calls the installed flash_attn package: "ours" is its automatic choice) against
"sdpa" with SDPA's kernel forced. Each backend gets the same initial weights and token batches;
the loss of its first step is recorded next to the first baseline's, so that a backend that is
fast and wrong shows. --profile then runs two more steps a backend under torch.profiler and
records the GPU time a step of the attention's kernels (by name: ATTENTION_KERNEL) against all
kernels', so that a step's speedup can be read against the attention's share of it.

Writes benchmarks/results/train_<GPU>_<dtype>.{md,json}; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import importlib.util
import math
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as C  # noqa: E402

FULL = dict(layers=8, hidden=2048, heads=16, kv_heads=16, intermediate=5632, vocab=32000,
            seqlen=4096, batch=2, steps=10, warmup=3, rounds=2)
QUICK = dict(layers=2, hidden=512, heads=4, kv_heads=4, intermediate=1024, vocab=1000,
             seqlen=1024, batch=1, steps=3, warmup=1, rounds=1)
TIMING = ("CUDA events around each step (forward, loss, backward, optimizer step, zeroing the "
          "gradients); median over `steps` timed steps after `warmup` untimed ones, in `rounds` "
          "rounds that alternate between the backends; every backend trains its own copy of the "
          "same initial weights on the same token batches.")

# The attention's kernels in a profile, by name: ours (namespace flash::), SDPA's flash
# (pytorch_flash::), cuDNN's (cudnn_generated_...sdpa...), PyTorch's memory-efficient (fmha).
# Memsets count with the rest of the step: ours zeroes the dQ accumulator by one (0.03 ms a
# backward call at 16k tokens, hidden 2048, H200), cuDNN inside its dot(dO, O) kernel.
ATTENTION_KERNEL = re.compile(r"flash|fmha|sdpa|cudnn|attention", re.IGNORECASE)


# ---- the model (--model own) ------------------------------------------------------------------

class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.float().square().mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotary_tables(seqlen: int, hdim: int, device, dtype, base: float = 10000.0):
    inv = 1.0 / base ** (torch.arange(0, hdim, 2, device=device, dtype=torch.float32) / hdim)
    freqs = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)  # (seqlen, hdim / 2)


def rotate(x, cos, sin):
    """Rotary embedding in the half-split form (as HF Llama); x (b, s, h, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(torch.nn.Module):
    def __init__(self, cfg: dict, attn):
        super().__init__()
        h, hk, d = cfg["heads"], cfg["kv_heads"], cfg["hidden"] // cfg["heads"]
        self.h, self.hk, self.d, self.attn = h, hk, d, attn
        self.norm1, self.norm2 = RMSNorm(cfg["hidden"]), RMSNorm(cfg["hidden"])
        self.qkv = torch.nn.Linear(cfg["hidden"], (h + 2 * hk) * d, bias=False)
        self.o = torch.nn.Linear(h * d, cfg["hidden"], bias=False)
        self.gate_up = torch.nn.Linear(cfg["hidden"], 2 * cfg["intermediate"], bias=False)
        self.down = torch.nn.Linear(cfg["intermediate"], cfg["hidden"], bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.h * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q, k = (rotate(t.view(b, s, -1, self.d), cos, sin) for t in (q, k))
        v = v.view(b, s, self.hk, self.d)
        x = x + self.o(self.attn(q, k, v).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(torch.nn.Module):
    def __init__(self, cfg: dict, attn):
        super().__init__()
        self.embed = torch.nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.blocks = torch.nn.ModuleList(Block(cfg, attn) for _ in range(cfg["layers"]))
        self.norm = RMSNorm(cfg["hidden"])
        self.head = torch.nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)
        self.hdim = cfg["hidden"] // cfg["heads"]

    def forward(self, ids, labels):
        x = self.embed(ids)
        cos, sin = rotary_tables(ids.shape[1], self.hdim, ids.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def own_attention(fn, heads: int, kv_heads: int):
    """Causal attention on (b, s, h, d) tensors by a benchmarks/_common AttnFn. The SDPA
    baselines get K / V repeated to the query heads under GQA, as HF's sdpa path does; ours takes
    GQA as it is."""
    def attn(q, k, v):
        if kv_heads != heads and getattr(fn, "wants_mha", False):
            k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
        return fn(q, k, v, True)
    return attn


# ---- the model (--model hf) -------------------------------------------------------------------

def hf_model(cfg: dict, implementation: str):
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seqlen"],
        attn_implementation=implementation)
    return transformers.LlamaForCausalLM(config)


class HFLoss(torch.nn.Module):
    """An HF causal LM as model(ids, labels) -> loss; sdpa_backend: the SDPA kernel its sdpa
    path is held to (None: flash_attention_2)."""

    def __init__(self, model, sdpa_backend):
        super().__init__()
        self.model, self.sdpa_backend = model, sdpa_backend

    def forward(self, ids, labels):
        if self.sdpa_backend is None:
            return self.model(input_ids=ids, labels=labels).loss
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(self.sdpa_backend):
            return self.model(input_ids=ids, labels=labels).loss


# ---- measuring --------------------------------------------------------------------------------

def build(args, cfg: dict, backend: C.Backend, device, dtype):
    torch.manual_seed(args.seed)  # the same initial weights for every backend
    if args.model == "own":
        fn = backend.fn
        if backend.kind == "baseline":
            fn = _mark_mha(fn)
        model = Decoder(cfg, own_attention(fn, cfg["heads"], cfg["kv_heads"]))
    else:
        from torch.nn.attention import SDPBackend
        sdpa = {"cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
        impl = "sdpa" if backend.kind == "baseline" else "flash_attention_2"
        model = HFLoss(hf_model(cfg, impl), sdpa.get(backend.name))
    model = model.to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, opt


def _mark_mha(fn):
    def wrapped(q, k, v, causal):
        return fn(q, k, v, causal)
    wrapped.wants_mha = True
    return wrapped


def batches(args, cfg: dict, device, n: int):
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    for _ in range(n):
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seqlen"] + 1), generator=g)
        ids = ids.to(device)
        yield ids[:, :-1], ids[:, 1:]


def train_steps(model, opt, data, device, timed: bool) -> tuple[list[float], list[float]]:
    """Runs one step per batch; returns (ms per step if timed, loss per step)."""
    Event = C.event_class(device)
    times, losses = [], []
    for ids, labels in data:
        start, end = Event(enable_timing=True), Event(enable_timing=True)
        start.record()
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        C.synchronize(device)
        losses.append(loss.item())
        if timed:
            times.append(start.elapsed_time(end))
    return times, losses


def kernel_summary(kernels: list[tuple[str, float]], steps: int) -> dict:
    """(kernel name, GPU microseconds) of `steps` steps -> ms a step, all kernels and the
    attention's (ATTENTION_KERNEL), with the attention's five largest kernels."""
    attention = collections.Counter()
    total = 0.0
    for name, us in kernels:
        total += us
        if ATTENTION_KERNEL.search(name):
            attention[name] += us
    per_step = 1e-3 / steps
    return dict(gpu_ms=total * per_step, attention_ms=sum(attention.values()) * per_step,
                attention_kernels=[dict(name=n, ms=us * per_step)
                                   for n, us in attention.most_common(5)])


def profile_steps(model, opt, data, device) -> dict:
    """kernel_summary of the given steps, run under torch.profiler (CUDA kernels only)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_steps(model, opt, data, device, False)
    kernels = [(e.name, e.device_time_total) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernel_summary(kernels, len(data))


def run(args, cfg: dict, device, backends: list[C.Backend], results: list[dict],
        checkpoint) -> None:
    dtype = C.DTYPES[args.dtype]
    tokens = cfg["batch"] * cfg["seqlen"]
    state, t0 = {}, time.time()
    for b in backends:
        rec = dict(backend=b.name, kind=b.kind, times_ms=[], error=b.unavailable)
        if b.unavailable:
            results.append(rec)
            continue
        C.release_memory()
        built, error = C.attempt(build, args, cfg, b, device, dtype)
        if not error:
            model, opt = built
            # The first step's loss on the first batch, before any update: compared across
            # backends (same weights, same batch).
            first, error = C.attempt(train_steps, model, opt,
                                     list(batches(args, cfg, device, 1)), device, False)
        if error:
            rec["error"] = error
        else:
            rec["first_loss"] = first[1][0]
            state[b.name] = (model, opt)
        results.append(rec)
    by_name = {r["backend"]: r for r in results}
    for round_ in range(cfg["rounds"]):
        for name, (model, opt) in state.items():
            rec = by_name[name]
            data = list(batches(args, cfg, device, cfg["warmup"] + cfg["steps"]))
            _, error = C.attempt(train_steps, model, opt, data[:cfg["warmup"]], device, False)
            if not error:
                out, error = C.attempt(train_steps, model, opt, data[cfg["warmup"]:], device,
                                       True)
            if error:
                rec["error"] = error
                continue
            rec["times_ms"] += out[0]
            rec["ms"] = statistics.median(rec["times_ms"])
            rec["tokens_per_s"] = tokens / rec["ms"] * 1e3
            C.log(f"{time.time() - t0:5.0f}s  round {round_ + 1} {name:12s} "
                  f"{statistics.median(out[0]):8.2f} ms/step")
        checkpoint()
    if not args.profile:
        return
    if device.type != "cuda":
        C.log("benchmark_train: --profile needs a CUDA GPU; skipped")
        return
    for name, (model, opt) in state.items():
        data = list(batches(args, cfg, device, 3))
        _, error = C.attempt(train_steps, model, opt, data[:1], device, False)
        if not error:
            out, error = C.attempt(profile_steps, model, opt, data[1:], device)
        if error:
            by_name[name]["profile_error"] = f"profile: {error}"
            continue
        by_name[name]["profile"] = out
        C.log(f"profile {name:12s} attention {out['attention_ms']:7.2f} of "
              f"{out['gpu_ms']:7.2f} GPU ms/step")
    checkpoint()


# ---- output -----------------------------------------------------------------------------------

def render_markdown(report: dict) -> str:
    meta, cfg = report["meta"], report["config"]
    rows = report["results"]
    base = next((r for r in rows if r["kind"] == "baseline" and r.get("ms")), None)
    ref_loss = next((r["first_loss"] for r in rows if r["kind"] == "baseline"
                     and "first_loss" in r), None)
    profiled = any("profile" in r for r in rows)
    table = []
    for r in rows:
        if not r.get("ms"):
            table.append([r["backend"], "", "", "", "", r.get("error") or "not run"]
                         + [""] * profiled)
            continue
        loss = r.get("first_loss", math.nan)
        flag = "" if ref_loss is None or abs(loss - ref_loss) <= 1e-2 * abs(ref_loss) else " *"
        ratio = f"{base['ms'] / r['ms']:.3f}x" if base else ""
        row = [r["backend"], f"{r['ms']:.2f}", f"{r['tokens_per_s']:.0f}", ratio,
               f"{loss:.4f}{flag}", r.get("profile_error", "")]
        if profiled:
            p = r.get("profile")
            row.append(f"{p['attention_ms']:.2f} of {p['gpu_ms']:.2f} "
                       f"({p['attention_ms'] / p['gpu_ms']:.0%})" if p and p["gpu_ms"] else "")
        table.append(row)
    lines = [f"# Training step: {meta['device']}, {cfg['dtype']}, model {cfg['model']}", ""]
    lines += C.meta_lines(meta)
    lines += [
        f"- model: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads "
        f"({cfg['kv_heads']} KV heads), intermediate {cfg['intermediate']}, vocab "
        f"{cfg['vocab']}; batch {cfg['batch']} x seqlen {cfg['seqlen']}; weights and optimizer "
        f"state in {cfg['dtype']}, fused AdamW",
        f"- timing: {TIMING}",
        "",
        C.markdown_table(["backend", "ms / step", "tokens / s",
                          f"speed vs {base['backend'] if base else 'baseline'}",
                          "first loss", "note"]
                         + ["attention GPU ms / step (share)"] * profiled, table, right_from=1),
        "",
        "`*`: the first step's loss differs from the first baseline's by more than 1%.",
        "",
    ]
    if profiled:
        lines += ["Attention: the GPU time a step (torch.profiler, two steps after the timed "
                  "ones) of the kernels whose names match "
                  f"`{ATTENTION_KERNEL.pattern}`, of all kernels' GPU time a step (memsets "
                  "count with the rest: ours zeroes the dQ accumulator by one, cuDNN inside a "
                  "kernel). Its largest kernels:", ""]
        for r in rows:
            for k in r.get("profile", {}).get("attention_kernels", []):
                lines.append(f"- {r['backend']}: {k['ms']:.2f} ms `{k['name'][:120]}`")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("own", "hf"), default="own")
    p.add_argument("--backends", default="ours,cudnn,sdpa_flash",
                   help="comma list: ours (every family this device runs; with --model hf, "
                        "transformers' flash_attention_2), fa1 / fa2 / fa3, cudnn, sdpa_flash")
    for key, value in FULL.items():
        p.add_argument(f"--{key}", type=int, help=f"(default {value}; --quick: {QUICK[key]})")
    p.add_argument("--dtype", choices=sorted(C.DTYPES), default="bf16")
    p.add_argument("--quick", action="store_true", help="a small model, a few steps")
    p.add_argument("--out-dir", type=Path, default=C.DEFAULT_OUT_DIR)
    p.add_argument("--tag", help="suffix for the output file names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also the attention kernels' GPU time a step (torch.profiler)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: pipeline smoke test
    args = p.parse_args(argv)
    args.backends = C.parse_name_list(args.backends)
    args.no_plot = True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        C.log("benchmark_train: no CUDA GPU visible; this benchmark needs one")
        return 1
    preset = QUICK if args.quick else FULL
    cfg = {key: getattr(args, key) if getattr(args, key) is not None else preset[key]
           for key in FULL}
    if cfg["hidden"] % cfg["heads"] or cfg["heads"] % cfg["kv_heads"]:
        C.log("benchmark_train: hidden must be a multiple of heads, heads of kv_heads")
        return 2
    if args.model == "hf":
        if importlib.util.find_spec("transformers") is None:
            C.log("benchmark_train: --model hf needs transformers")
            return 1
        if not _flash_attn_distribution():
            C.log("benchmark_train: transformers finds flash_attn by its installed distribution "
                  "(flash-attn's metadata), which this one lacks (an in-place build?); its "
                  "flash_attention_2 will refuse. Install the package (pip install "
                  "--no-build-isolation .), or put a flash_attn-<version>.dist-info with METADATA "
                  "(Name: flash-attn) and top_level.txt (flash_attn) on sys.path.")
        # transformers' flash_attention_2 calls the installed flash_attn itself: one "ours".
        args.backends = ["ours" if n in C.OUR_FAMILIES else n for n in args.backends]
        args.backends = list(dict.fromkeys(args.backends))
    config = dict(cfg, model=args.model, dtype=args.dtype, backends=args.backends)
    return C.run_and_report("train", args, device, config,
                            lambda backends, results, checkpoint:
                            run(args, cfg, device, _hf_backends(args, backends), results,
                                checkpoint),
                            render_markdown, lambda report, path: False)


def _flash_attn_distribution() -> bool:
    """Whether an installed flash-attn distribution provides the flash_attn package, as
    transformers' is_flash_attn_2_available checks it."""
    names = importlib.metadata.packages_distributions().get("flash_attn", [])
    return any(n.replace("_", "-").lower() == "flash-attn" for n in names)


def _hf_backends(args, backends: list[C.Backend]) -> list[C.Backend]:
    """With --model hf our families collapse into one "ours" (transformers picks none of them:
    flash_attn's automatic choice runs)."""
    if args.model != "hf":
        return backends
    out, seen_ours = [], False
    for b in backends:
        if b.kind == "ours":
            if not seen_ours:
                out.append(C.Backend("ours", "ours", None, b.unavailable))
            seen_ours = True
        else:
            out.append(b)
    return out


if __name__ == "__main__":
    sys.exit(main())
