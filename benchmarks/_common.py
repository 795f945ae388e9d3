"""What the two benchmark scripts share: the backends under test, error bookkeeping, metadata,
file names, markdown, and main()'s run-and-write body (``run_and_report``). Imports only torch
(and flash_attn, guarded), so it loads anywhere.

Every backend is a function ``fn(q, k, v, causal) -> out`` on tensors in flash_attn's layout
``(batch, seqlen, nheads, headdim)``, so all of them get the same input and gradient tensors.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_OUT_DIR = BENCH_DIR / "results"

OUR_FAMILIES = ("fa1", "fa2", "fa3")
# "<family>+det": that family with deterministic=True (the backward's bitwise-reproducible mode).
DET_SUFFIX = "+det"
OUR_NAMES = OUR_FAMILIES + tuple(f + DET_SUFFIX for f in OUR_FAMILIES)
BASELINES = ("cudnn", "sdpa_flash", "sdpa_efficient", "torch")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


@dataclasses.dataclass
class Backend:
    name: str
    kind: str                  # "ours" or "baseline"
    fn: AttnFn | None
    unavailable: str | None    # why fn is None


# ---- flash_attn, which may be missing or built without its extension ------------------------

def load_flash_attn():
    """(module, None) or (None, reason). Never raises: without our build the baselines still run.

    The importable flash_attn is the one benchmarked (an installed wheel, or an in-place build
    of this checkout, which is preferred when its extension is present). When that import fails
    or finds a flash_attn without ``available_backends`` (another implementation), this
    checkout is tried. The JSON records which file was imported."""
    source = REPO_ROOT / "src" / "flash_attn"
    if any(source.glob("_C*.so")) and str(source.parent) not in sys.path:
        sys.path.insert(0, str(source.parent))
    fa, error = _import_flash_attn()
    if fa is not None and not hasattr(fa, "available_backends"):
        fa, error = None, f"{fa.__file__} is not this project's flash_attn (no available_backends)"
    if fa is None and (source / "__init__.py").exists() and sys.path[0] != str(source.parent):
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
        sys.path.insert(0, str(source.parent))
        fa, checkout_error = _import_flash_attn()
        error = None if fa is not None else f"{error}; checkout: {checkout_error}"
    return fa, error


def _import_flash_attn():
    try:
        import flash_attn
        return flash_attn, None
    except Exception as e:  # a broken extension can raise anything at import
        return None, describe_error(e)


def our_backend_names(fa, fa_error: str | None,
                      device: torch.device) -> tuple[list[str], str | None]:
    """What flash_attn.available_backends says this device runs, or ([], why not)."""
    if fa is None:
        return [], f"flash_attn did not import: {fa_error}"
    if not hasattr(fa, "available_backends"):
        return [], "flash_attn has no available_backends()"
    try:
        names = list(fa.available_backends(device))
    except Exception as e:
        return [], describe_error(e)
    if names:
        return names, None
    why = "available_backends() is empty"
    if device.type != "cuda":
        return [], why + f" on {device.type}"
    try:  # the usual cause is a missing or unloadable extension; its error says how to fix it
        from flash_attn import _ops
        _ops.extension()
    except Exception as e:
        why += f": {describe_error(e)}"
    return [], why


def expand_backend_names(requested: list[str], ours: list[str]) -> list[str]:
    """'ours' stands for every family the device runs, best first; order kept, duplicates gone."""
    names: list[str] = []
    for name in requested:
        for n in (ours if name == "ours" else [name]):
            if n not in names:
                names.append(n)
    return names


def make_backends(names: list[str], fa, ours: list[str],
                  ours_error: str | None) -> list[Backend]:
    """ours, ours_error: what our_backend_names returned."""
    backends = []
    for name in names:
        if name in BASELINES:
            backends.append(Backend(name, "baseline", BASELINE_FNS[name], None))
        elif name.removesuffix(DET_SUFFIX) in ours:
            family = name.removesuffix(DET_SUFFIX)
            backends.append(Backend(name, "ours", _ours_fn(fa, family,
                                                           deterministic=family != name), None))
        else:
            why = ours_error or f"not run by this device/build (available_backends() = {ours})"
            backends.append(Backend(name, "ours", None, why))
    return backends


def _ours_fn(fa, name: str, tuning: dict | None = None, deterministic: bool = False) -> AttnFn:
    """flash_attn_func on family name; tuning: its private overrides of the kernels' automatic
    choices (csrc/common/tuning.h), for A/B runs; deterministic: its backward's mode."""
    extra = {"_tuning": tuning} if tuning else {}
    if deterministic:
        extra["deterministic"] = True

    def fn(q, k, v, causal):
        return fa.flash_attn_func(q, k, v, causal=causal, backend=name, **extra)
    return fn


# ---- baselines --------------------------------------------------------------------------------

def _sdpa_fn(which) -> AttnFn:
    from torch.nn.attention import sdpa_kernel

    # SDPA takes (b, h, s, d). It gets transposed views of the (b, s, h, d) tensors: the layout its
    # flash, efficient and cuDNN kernels work in internally, and how a model calls it after its
    # projections. Transposes are views: no copy in the timed region.
    def fn(q, k, v, causal):
        with sdpa_kernel(which):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)
    return fn


def sdpa_backend_fns(qt, kt, vt, names, **sdpa_kwargs) -> dict:
    """{name: a call of F.scaled_dot_product_attention(qt, kt, vt, **sdpa_kwargs) on that one
    SDPA backend} for names among cudnn / flash / efficient / math; tensors in SDPA's (b, h, s,
    d) layout, as the KV-cache benchmarks build them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

    def call(which):
        def fn():
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(qt, kt, vt, **sdpa_kwargs)
        return fn
    return {name: call(backends[name]) for name in names}


def plain_attention(q, k, v, causal):
    """Attention the way a typical model writes it (nanoGPT style): materialised scores, a mask
    built in the forward, softmax in fp32, cast back. Its matmuls copy the transposed views."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (b, h, s, d)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = scores.shape[-2:]
        # Bottom-right aligned, as flash_attn: row i sees key j iff j <= i + sk - sq.
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(sk - sq + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (p @ v).transpose(1, 2)


def _baseline_fns() -> dict[str, AttnFn]:
    from torch.nn.attention import SDPBackend
    return {
        "cudnn": _sdpa_fn(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": _sdpa_fn(SDPBackend.FLASH_ATTENTION),
        "sdpa_efficient": _sdpa_fn(SDPBackend.EFFICIENT_ATTENTION),
        "torch": plain_attention,
    }


BASELINE_FNS = _baseline_fns()


# ---- errors and memory ------------------------------------------------------------------------

def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def describe_error(e: BaseException, caught: list | None = None) -> str:
    """One line: the exception and, for SDPA, the warnings that say why no kernel fit."""
    if is_oom(e):
        return "OOM"
    msg = " ".join(str(e).split()) or repr(e)
    why = []
    for w in caught or ():
        text = " ".join(str(w.message).split())
        if text and text not in why and "not used because" not in text:
            why.append(text)
    if why:
        msg += " [" + "; ".join(why) + "]"
    msg = f"{type(e).__name__}: {msg}"
    return msg if len(msg) <= 400 else msg[:397] + "..."


def attempt(f, *args):
    """(f(*args), None), or (None, reason) after freeing what a failure (an OOM) left behind.
    Warnings are captured: SDPA says in them why it refused a shape."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return f(*args), None
        except Exception as e:
            reason = describe_error(e, caught)
    release_memory()  # outside the except: the traceback no longer pins the tensors
    return None, reason


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except Exception:  # a lost context: cuda_alive() reports it
            pass


def cuda_alive(device: torch.device) -> bool:
    """False once a kernel fault has poisoned the context: every later call would fail too."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


class HostEvent:
    """torch.cuda.Event's timing interface on the host clock, for the hidden --device cpu mode
    (a development smoke test of the pipeline; CPU numbers mean nothing)."""

    def __init__(self, enable_timing: bool = True):
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.t - self.t) * 1e3


def event_class(device: torch.device):
    return torch.cuda.Event if device.type == "cuda" else HostEvent


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def queue_ahead(device: torch.device, ms: float) -> None:
    """Queue at least `ms` (capped at 500) of GPU work on the current stream: a spin of
    2e6 cycles per ms, which lasts at least that long at SM clocks up to 2 GHz."""
    if device.type == "cuda" and ms > 0:
        torch.cuda._sleep(int(min(ms, 500.0) * 2.0e6))


# ---- metadata and file names ------------------------------------------------------------------

def device_short_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA GeForce RTX 4090' -> 'RTX4090'."""
    words = [w for w in re.split(r"[\s_-]+", name) if w and w not in ("NVIDIA", "GeForce", "Tesla")]
    if not words:
        return "unknown"
    short = words[0]
    if short in ("RTX", "GTX", "Quadro", "TITAN") and len(words) > 1:
        short += words[1]
    return re.sub(r"[^A-Za-z0-9.]", "", short) or "unknown"


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO_ROOT)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def _source_hash() -> str | None:
    """The hash of the csrc/ the loaded extension was built from (``_C.source_hash()``): it names
    the code where git cannot, e.g. in a copied tree whose .git is another commit's."""
    get = getattr(sys.modules.get("flash_attn._C"), "source_hash", None)
    try:
        return get() if get is not None else None
    except Exception:
        return None


def metadata(device: torch.device, fa, ours: list[str], ours_error: str | None) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "flash_attn": getattr(fa, "__version__", None),
        "flash_attn_path": getattr(fa, "__file__", None),
        "flash_attn_backends": ours,
        "flash_attn_error": ours_error,
        # FLASH_ATTN_BENCH_COMMIT: the commit a copied tree holds, where its .git is not that
        # commit's (a lent GPU machine's copy); the tree is then taken as that commit, clean.
        "git_commit": os.environ.get("FLASH_ATTN_BENCH_COMMIT") or _run(["git", "rev-parse",
                                                                          "HEAD"]),
        "git_dirty": (False if os.environ.get("FLASH_ATTN_BENCH_COMMIT") else
                      bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))),
        "source_hash": _source_hash(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update({
            "device": p.name,
            "device_short": device_short_name(p.name),
            "compute_capability": f"{p.major}.{p.minor}",
            "sm_count": p.multi_processor_count,
            "memory_bytes": p.total_memory,
            "l2_bytes": getattr(p, "L2_cache_size", None),
            "nvidia_smi": _run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,"
                                "clocks.max.mem,power.limit", "--format=csv,noheader"]),
        })
    else:
        meta.update({"device": f"CPU ({platform.processor() or platform.machine()})",
                     "device_short": "CPU"})
    return meta


def output_stem(prefix: str, meta: dict, dtype: str, quick: bool, tag: str | None) -> str:
    """attn_H100_bf16: device and dtype, so that a run replaces the current table of its GPU
    and dtype (benchmarks/results keeps one; the date and commit are inside, older runs are in
    git history); --quick or --tag are added so those runs never replace the full one."""
    parts = [prefix, meta["device_short"], dtype]
    if quick:
        parts.append("quick")
    if tag:
        parts.append(re.sub(r"[^A-Za-z0-9._-]", "_", tag))
    return "_".join(parts)


def meta_lines(meta: dict) -> list[str]:
    fa = meta.get("flash_attn") or f"unavailable ({meta.get('flash_attn_error')})"
    commit = (meta.get("git_commit") or "unknown")[:12] + ("+dirty" if meta.get("git_dirty")
                                                          else "")
    if meta.get("source_hash"):
        commit += f" (csrc source hash {meta['source_hash']})"
    arch = (f" (sm{meta['compute_capability'].replace('.', '')}, {meta['sm_count']} SMs)"
            if "compute_capability" in meta else "")
    return [
        f"- device: {meta['device']}{arch}",
        f"- torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
        f"Python {meta['python']}",
        f"- flash_attn {fa}, our backends on this device: "
        f"{meta.get('flash_attn_backends') or 'none'}, commit {commit}",
        f"- date (UTC): {meta['date_utc']}",
    ]


def fmt_seqlen(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def parse_int_list(text: str) -> list[int]:
    """'512,1k,2048' -> [512, 1024, 2048]."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def apply_preset(args, preset: dict) -> None:
    """The grid and repetition options the command line left unset, from a FULL / QUICK preset
    (seqlens and hdims as comma lists)."""
    for key in ("seqlens", "hdims"):
        if getattr(args, key) is None:
            setattr(args, key, parse_int_list(preset[key]))
    for key in ("target_ms", "min_reps", "max_reps", "rounds"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])


def parse_name_list(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if allowed is not None:
        bad = [n for n in names if n not in allowed]
        if bad:
            raise ValueError(f"unknown {bad}; choose from {list(allowed)}")
    return names


def markdown_table(header: list[str], rows: list[list[str]], right_from: int) -> str:
    """Columns from index right_from on are right-aligned (numbers)."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (logged) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return None
    return plt


# ---- main()'s body ----------------------------------------------------------------------------

def run_and_report(name: str, args, device: torch.device, config: dict,
                   run_cells: Callable[[list[Backend], list[dict], Callable[[], None]], None],
                   render_markdown: Callable[[dict], str],
                   plot: Callable[[dict, Path], bool]) -> int:
    """What benchmark_<name>.py does once its arguments are parsed and its device checked: pick
    the backends, run the cells, write <name>_<GPU>_<date>[...].{json,md,png} under
    args.out_dir and print the markdown. Returns the exit code: 0, or 130 when Ctrl-C cut the
    run short (what ran is still written, with "complete": false).

    args: the parsed command line; seed, backends, dtype, out_dir, quick, tag and no_plot are
    read. run_cells(backends, results, checkpoint) appends one dict per cell to results and
    calls checkpoint() when the JSON is worth saving (a long run keeps what it measured).
    render_markdown(report) is the exact text of the .md file and of stdout.
    plot(report, path) says whether it wrote the PNG."""
    t_start = time.time()
    torch.manual_seed(args.seed)
    fa, fa_error = load_flash_attn()
    ours, ours_error = our_backend_names(fa, fa_error, device)
    backends = make_backends(expand_backend_names(args.backends, ours), fa, ours, ours_error)
    meta = metadata(device, fa, ours, ours_error)
    report = dict(meta=meta, config=config,
                  backends=[dict(name=b.name, kind=b.kind, unavailable=b.unavailable)
                            for b in backends],
                  results=[], complete=False)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / output_stem(name, meta, args.dtype, args.quick, args.tag)
    json_path, md_path, png_path = (stem.with_suffix(s) for s in (".json", ".md", ".png"))
    log(f"benchmark_{name}: {meta['device']}, {args.dtype}, backends "
        f"{[b.name + ('' if b.fn else ' (unavailable)') for b in backends]}")
    if ours_error:
        log(f"flash_attn: {ours_error}; running the baselines only")
    try:
        run_cells(backends, report["results"], lambda: write_json(report, json_path))
        report["complete"] = True
    except KeyboardInterrupt:
        log("interrupted: writing what ran")
    meta["wall_s"] = round(time.time() - t_start, 1)
    write_json(report, json_path)
    md = render_markdown(report)
    md_path.write_text(md)
    print(md, end="")
    wrote = [md_path, json_path]
    if not args.no_plot and plot(report, png_path):
        wrote.append(png_path)
    log("wrote " + ", ".join(str(w) for w in wrote))
    return 0 if report["complete"] else 130


def write_json(report: dict, path: Path) -> None:
    """Through a temporary file, so an interrupted write never leaves a truncated JSON."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def start_report(name: str, args) -> tuple:
    """(flash_attn, our backends on the GPU, report) for a benchmark of our kernels alone that
    needs a CUDA GPU and the package (benchmark_decode / _prefill), or None after saying why
    not. report: meta, config (the command line), results []."""
    if not torch.cuda.is_available():
        log(f"benchmark_{name}: no CUDA GPU visible; this benchmark needs one")
        return None
    fa, fa_error = load_flash_attn()
    if fa is None:
        log(f"flash_attn: {fa_error}")
        return None
    ours, ours_error = our_backend_names(fa, fa_error, torch.device("cuda"))
    report = dict(meta=metadata(torch.device("cuda"), fa, ours, ours_error),
                  config=dict(vars(args), out_dir=str(args.out_dir)), results=[])
    return fa, ours, report


def finish_report(name: str, args, report: dict, render_markdown: Callable[[dict], str]) -> int:
    """Writes <name>_<GPU>_<dtype>[...].{json,md} under args.out_dir, prints the markdown."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / output_stem(name, report["meta"], args.dtype, args.quick, args.tag)
    write_json(report, stem.with_suffix(".json"))
    md = render_markdown(report)
    stem.with_suffix(".md").write_text(md)
    print(md, end="")
    return 0
