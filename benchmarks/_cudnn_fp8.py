"""cuDNN's FP8 attention forward, through the nvidia-cudnn-frontend package's `sdpa_fp8`: the
baseline of issue 36's "1.05x cuDNN FP8" bar. An optional benchmark dependency: where the package
is missing or cuDNN declines the graph, the caller reports why and times nothing.

What cuDNN's FP8 forward takes differs from ours in two ways that the table states:
- its descales are per tensor (one float each), ours per (batch, KV head); timing does not depend
  on the values, so each call gets the largest of ours;
- on Hopper its output is e4m3 (bf16 output is Blackwell-only), ours bf16, so cuDNN writes half
  the output bytes.
"""

from __future__ import annotations

import math

import torch

# P lies in [0, 1]; cuDNN quantises it to e4m3 with this scale (a power of two keeps it exact).
P_SCALE = 256.0


class CudnnFp8:
    """One cuDNN handle, and one built graph per (shape, strides, causal)."""

    def __init__(self, device: torch.device):
        import cudnn  # noqa: F401  (ImportError goes to the caller, which reports it)

        self.cudnn = cudnn
        self.device = device
        self.handle = cudnn.create_handle()
        self.version = f"cudnn-frontend {getattr(cudnn, '__version__', '?')}, " \
                       f"cuDNN {cudnn.backend_version_string()}"
        self.plans: dict = {}
        one = torch.ones((1, 1, 1, 1), dtype=torch.float32, device=device)
        self.p_scale, self.p_descale = one * P_SCALE, one / P_SCALE

    def _plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), causal)
        if key in self.plans:
            return self.plans[key]
        cudnn = self.cudnn
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32,
                              compute_data_type=fp32, handle=self.handle)

        def bhsd(x: torch.Tensor):
            # Ours are (batch, seqlen, heads, hdim); cuDNN names its dims (batch, heads, seqlen,
            # hdim) and takes any strides.
            b, s, h, d = x.shape
            sb, ss, sh, sd = x.stride()
            return [b, h, s, d], [sb, sh, ss, sd]

        def fp8_tensor(name, x):
            dim, stride = bhsd(x)
            return graph.tensor(name=name, dim=dim, stride=stride, data_type=e4m3)

        def scalar(name):
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)

        tq, tk, tv = fp8_tensor("q", q), fp8_tensor("k", k), fp8_tensor("v", v)
        scalars = {n: scalar(n) for n in ("descale_q", "descale_k", "descale_v", "descale_s",
                                          "scale_s", "scale_o")}
        out, _, amax_s, amax_o = graph.sdpa_fp8(
            q=tq, k=tk, v=tv, **scalars, is_inference=True,
            attn_scale=1.0 / math.sqrt(q.shape[-1]), use_causal_mask=causal, name="sdpa_fp8")
        o_buffer = torch.empty_like(q)
        o_dim, o_stride = bhsd(o_buffer)
        out.set_output(True).set_dim(o_dim).set_stride(o_stride).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]) \
                .set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        buffers = dict(
            out=o_buffer,
            amax_s=torch.empty((1, 1, 1, 1), dtype=torch.float32, device=self.device),
            amax_o=torch.empty((1, 1, 1, 1), dtype=torch.float32, device=self.device),
            workspace=torch.empty(graph.get_workspace_size(), dtype=torch.uint8,
                                  device=self.device))
        plan = (graph, (tq, tk, tv), scalars, (out, amax_s, amax_o), buffers)
        self.plans[key] = plan
        return plan

    def __call__(self, q, k, v, causal: bool, descales: dict) -> torch.Tensor:
        """cuDNN's e4m3 output, O * scale_o; `descales` holds per-tensor (1, 1, 1, 1) float32
        q_descale / k_descale / v_descale (per_tensor_descales below)."""
        graph, (tq, tk, tv), scalars, (out, amax_s, amax_o), buf = self._plan(q, k, v, causal)
        pack = {tq: q, tk: k, tv: v,
                scalars["descale_q"]: descales["q_descale"],
                scalars["descale_k"]: descales["k_descale"],
                scalars["descale_v"]: descales["v_descale"],
                scalars["descale_s"]: self.p_descale, scalars["scale_s"]: self.p_scale,
                # O has V's range: V's own scale quantises it back.
                scalars["scale_o"]: descales["v_scale"],
                out: buf["out"], amax_s: buf["amax_s"], amax_o: buf["amax_o"]}
        self.cudnn.set_stream(handle=self.handle,
                              stream=torch.cuda.current_stream(self.device).cuda_stream)
        graph.execute(pack, buf["workspace"], handle=self.handle)
        return buf["out"]


def per_tensor_descales(descales: dict) -> dict:
    """cuDNN's scalar descales from ours (per (batch, KV head)): the largest of each."""
    d = {name: t.amax().reshape(1, 1, 1, 1).float().contiguous() for name, t in descales.items()}
    d["v_scale"] = d["v_descale"].reciprocal()
    return d
