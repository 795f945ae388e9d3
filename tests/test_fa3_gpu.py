"""FA3 (the Hopper forward and backward) on the GPU, through the public API, held to the
error-versus-error rule (_gpu_common.py states it): every case runs
``flash_attn_func(..., backend='fa3')`` and its gradient against attention_ref in float64 and
in plain PyTorch at the input precision. The gradient is fa3's backward where it takes the call
(head dims up to 128, deterministic or not) and fa2's backward on fa3's O and LSE
elsewhere (build_matrix.backward_family). So the forward is checked by the rule on out
and lse, and whichever backward runs by the rule on dq, dk, dv. Here fa3's backward takes the
short calls too (fewer than SHORT_Q_ROWS query rows per KV head, which run fa2's backward by
default for speed), so that its awkward shapes are its own.

What is covered: every head-dim kernel (64, 96, 128, 192, 256, and the dims they serve), both
dtypes, full / causal / sliding windows / softcap / ALiBi, MHA / GQA / MQA, seqlen pairs that
are not multiples of the tiles (128 or 192 query rows, 80-192 keys), rows that see no key; fa3
and fa2 agree on the same inputs, forward and backward; logits that jump late in the key walk
(the lazy softmax step's two fallbacks); grids past 65535 (batch x heads); inputs whose extent-1
dims have strides a TMA descriptor would refuse; the automatic choice on sm90 and its fallback for
dropout.
"""

import math
import warnings
import zlib

import pytest
import torch

import flash_attn
from flash_attn import _dispatch, _ops, build_matrix
from conftest import requires_backend
from _gpu_common import (
    DEVICE, DTYPE_NAMES, assert_agree, attn_args, check, dtype_params, qkv, randn, reference,
    reference_attn, run_ours, visibility,
)

pytestmark = requires_backend("fa3")

BACKEND = "fa3"
DTYPES = dtype_params()
# The cluster kernel on every full-attention call (stream-K, which takes calls with few items
# first, off).
CLUSTER = dict(fa3_cluster=1, fa3_stream_k=0)
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]
# The tile choice: automatic, or fa3_narrow=0 (the wide tile unless it pads more; fa3_plan.h,
# narrow_pays), through the private _tuning overrides.
TILE_RULES = [pytest.param({}, id="auto"), pytest.param(dict(fa3_narrow=0), id="wide")]

# Around the tiles (fa3_plan.h): hdim 64-128 run 192 query rows per CTA, or 128 where 192
# would leave a lone busy consumer warpgroup (narrow_pads_less: here 193, 239 and 256; the rest
# wide, with one or two consumers idle in the last tile: 1, 113, 128, 129, 1023) or where the
# 128-row items are few enough to fill the GPU (narrow_fills: every shape below at 2 x 4 heads,
# full attention, or causal with seqlen_k <= 2k); 128 rows at hdim 192 / 256. kBlockN 128
# (hdim 64-128), 112 (192), 80 (256). fa3_narrow=0 keeps only the padding rule, so
# the "wide" cases run the three-consumer tile on these small shapes.
SEQLENS = [(1, 1), (1, 239), (113, 203), (128, 217), (129, 80), (239, 1), (256, 512),
           (191, 385), (193, 383), (384, 129), (799, 3), (1023, 1024), (2048, 2048)]
# Head dims besides 64 / 128: padded by the frontend to a multiple of 8 and run by the kernel
# of the next instantiated dim (32, 40, 59 -> 64; 96; 111 -> 128; 160, 192 -> 192; 224, 256).
OTHER_HEAD_DIMS = [32, 40, 59, 96, 111, 160, 192, 224, 256]


@pytest.fixture(autouse=True)
def _fa3_backward_on_short_calls(every_call_long):
    """fa3's own backward on every shape (conftest.every_call_long)."""


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def skip_unless_built(dtype, head_dim):
    """Skip unless this build has fa3's forward and the backwards of fa3's gradient for it:
    fa2's, and fa3's own where it has the head dim."""
    padded = -(-head_dim // 8) * 8
    built = {(c[0], c[1], c[2]) for c in flash_attn._C.built_configs() if c[3] >= padded}
    needed = [("fa3", "fwd"), ("fa2", "bwd")]
    if build_matrix.own_backward("fa3", head_dim):
        needed.append(("fa3", "bwd"))
    for family, direction in needed:
        if (family, direction, DTYPE_NAMES[dtype]) not in built:
            pytest.skip(f"this build has no {family} {direction} {DTYPE_NAMES[dtype]} kernel "
                        f"for head dim {head_dim}")


def fa(attn, backend=BACKEND, tuning=None):
    """flash_attn_func with attn; tuning: the private overrides of the launcher's choices."""
    def call(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, return_attn_probs=True, backend=backend,
                                          **attn, _tuning=tuning)
    return call


def run_case(b, sq, sk, h, hk, d, dtype, spec=None, tuning=None):
    skip_unless_built(dtype, d)
    attn = attn_args(spec or {}, b, h)
    return check(qkv(b, sq, sk, h, hk, d, dtype), "qkv", dtype, fa(attn, tuning=tuning), attn)


# ---- 1. shapes --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("tiles", TILE_RULES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_seqlens(sq, sk, d, tiles, causal, dtype):
    run_case(2, sq, sk, 4, 4, d, dtype, dict(causal=causal), tuning=tiles)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk,h,hk", [(113, 203, 4, 4), (239, 1, 7, 1), (1023, 1024, 6, 2),
                                        (300, 700, 3, 3)],
                         ids=["113x203-mha", "239x1-mqa7-1", "1023x1024-gqa6-2", "300x700-mha"])
@pytest.mark.parametrize("d,tiles", [pytest.param(d, t.values[0], id=f"{d}-{t.id}")
                                     for d in OTHER_HEAD_DIMS
                                     for t in (TILE_RULES if d <= 128 else TILE_RULES[:1])])
def test_head_dims(d, tiles, sq, sk, h, hk, causal, dtype):
    run_case(2, sq, sk, h, hk, d, dtype, dict(causal=causal), tuning=tiles)


# Full attention at hdim 256 runs in clusters of two CTAs on neighbouring query tiles that
# share their K / V loads, where the items are long and fill the GPU (fa3_plan.h, cluster_pays:
# seqlen_k >= 2048 and two (query tile, head, batch) items per SM). fa3_cluster=1 runs them on
# every full-attention call, so the awkward shapes cover the cluster kernel; an
# odd number of query tiles leaves the last cluster's second CTA without rows, which still
# loads its half of every K / V tile.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_cluster_seqlens(sq, sk, dtype):
    # (fa3_stream_k=0: stream-K takes calls with few items first)
    run_case(2, sq, sk, 4, 2, 256, dtype, tuning=CLUSTER)


def cluster_heads(sq, b, hk):
    """Query heads (a multiple of hk) that give at least two 128-row items per SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_head = b * -(-sq // 128)
    return hk * -(-2 * sms // (per_head * hk))


# The automatic choice (unset) and the one-CTA kernel (0) on shapes where the rule picks clusters.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tuning", [{}, dict(fa3_cluster=0)], ids=["auto", "off"])
@pytest.mark.parametrize("sq,sk", [(300, 2048), (1000, 4097)])
def test_cluster_rule(sq, sk, tuning, dtype):
    run_case(2, sq, sk, cluster_heads(sq, 2, 2), 2, 256, dtype, tuning=tuning)


# Full attention with few items runs stream-K (fa3_plan.h, stream_k_workers; every head dim's
# kernel): the items cut into pieces of key tiles on more CTAs, each cut item's pieces merged by
# the one that finishes last. fa3_stream_k=1 runs it on every full-attention call, so the
# awkward shapes cover it (also the many-item ones, whose items past the static stride's
# lattice are cut, and the tiny ones, where nothing is cut).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_stream_k_seqlens(sq, sk, d, dtype):
    run_case(2, sq, sk, 4, 2, d, dtype, tuning=dict(fa3_stream_k=1))


# Shapes the rule sends to stream-K (unset) or not (0): decode steps (one query row: the second
# consumer has no rows), GQA / MQA, head dims the 128 / 256 kernels serve, an item in eight
# pieces (2 items x 63 key tiles), keys that end inside a tile; and a decode step the rule
# leaves to the plain kernel (12 items x 10 key tiles: pieces of fewer than six).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tuning", [{}, dict(fa3_stream_k=0)], ids=["auto", "off"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", [(1, 1, 4096, 16, 4, 256), (1, 64, 5000, 2, 2, 256),
                                            (2, 200, 3000, 3, 1, 224), (1, 512, 4100, 8, 8, 256),
                                            (3, 1, 777, 4, 2, 256), (1, 1, 4096, 32, 8, 128),
                                            (1, 128, 8192, 16, 16, 128),
                                            (2, 200, 3000, 3, 1, 112), (1, 1, 4096, 16, 4, 64),
                                            (1, 200, 5000, 3, 1, 40), (1, 1, 3000, 8, 8, 96),
                                            (1, 1, 4096, 16, 4, 192), (1, 300, 6000, 2, 2, 160)],
                         ids=["decode-gqa", "2-items", "mqa-d224", "512x4100", "decode-777",
                              "decode-gqa-d128", "128x8192-d128", "mqa-d112", "decode-gqa-d64",
                              "mqa-d40", "decode-d96", "decode-gqa-d192", "300x6000-d160"])
def test_stream_k_rule(b, sq, sk, h, hk, d, tuning, dtype):
    run_case(b, sq, sk, h, hk, d, dtype, tuning=tuning)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("h,hk,d", [(6, 2, 64), (7, 1, 128), (8, 2, 256)],
                         ids=["gqa6-2-d64", "mqa7-1-d128", "gqa8-2-d256"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (239, 1), (1023, 1024), (700, 300)])
def test_gqa_mqa(sq, sk, h, hk, d, causal, dtype):
    run_case(2, sq, sk, h, hk, d, dtype, dict(causal=causal))


def test_tile_order_partial_last_group():
    """CTAs take (query tile, head) items in FA2's order (groups of heads that fill the GPU
    once); 2 x 11 heads at 4k leave a partial last group."""
    run_case(2, 4096, 4096, 11, 11, 128, torch.bfloat16, dict(causal=True))


# ---- 2. windows, rows without keys ------------------------------------------------------------

WINDOWS = [
    pytest.param((0, 0), False, id="w0-0"),
    pytest.param((3, 5), False, id="w3-5"),
    pytest.param((-1, 7), False, id="w-1-7"),
    pytest.param((17, -1), False, id="w17--1"),
    pytest.param((17, -1), True, id="w17-causal"),
    pytest.param((0, -1), False, id="w0--1"),
    pytest.param((130, 200), False, id="w130-200"),     # wider than a key tile on both sides
    pytest.param((40, 300), False, id="w40-300"),       # a side >= seqlen_k is unbounded
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,causal", WINDOWS)
@pytest.mark.parametrize("sq,sk,h,hk,d", [
    (113, 203, 6, 2, 64),
    (239, 17, 4, 4, 128),
    (1023, 1024, 7, 1, 96),
    (500, 900, 4, 2, 256),
], ids=["113x203-gqa-d64", "239x17-mha-d128", "1023x1024-mqa-d96", "500x900-gqa-d256"])
def test_window(sq, sk, h, hk, d, window, causal, dtype):
    run_case(2, sq, sk, h, hk, d, dtype, dict(window_size=window, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk,spec,rows_empty", [
    (300, 64, dict(window_size=(4, 2)), True),     # early rows' windows end before key 0
    (64, 300, dict(window_size=(2, 3)), False),    # most keys are seen by no row
    (150, 40, dict(causal=True), True),            # rows 0..109 see nothing: whole CTAs idle
    (700, 100, dict(causal=True), True),           # the first four query tiles see no key
], ids=["rows-before-key-0", "keys-unseen", "causal-sq>sk", "causal-empty-tiles"])
def test_rows_with_no_key(sq, sk, spec, rows_empty, d, dtype):
    """out 0 and lse +inf on rows that see no key (check() asserts both, and out 0 / dk, dv 0
    where no key / row reaches), including CTAs whose whole query tile sees nothing (their
    producer loads nothing)."""
    ours = run_case(2, sq, sk, 6, 2, d, dtype, spec)
    empty = ~visibility(sq, sk, spec).any(1)
    assert bool(empty.any()) == rows_empty
    assert torch.isposinf(ours.lse[:, :, empty]).all()
    assert torch.isfinite(ours.lse[:, :, ~empty]).all()


# ---- 3. score mods ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("softcap", [30.0, 5.0])
@pytest.mark.parametrize("sq,sk,h,hk,d", [(113, 203, 6, 2, 64), (1023, 1024, 4, 4, 128),
                                          (300, 500, 2, 1, 192)],
                         ids=["113x203-gqa-d64", "1023x1024-mha-d128", "300x500-mqa-d192"])
def test_softcap(sq, sk, h, hk, d, softcap, causal, dtype):
    run_case(2, sq, sk, h, hk, d, dtype,
             dict(causal=causal, softcap=softcap, softmax_scale=3.0 / math.sqrt(d)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", [{}, dict(causal=True), dict(window_size=(64, 16))],
                         ids=["full", "causal", "w64-16"])
@pytest.mark.parametrize("alibi", ["per-head", "per-batch"])
@pytest.mark.parametrize("sq,sk,d", [(113, 203, 64), (1023, 1024, 128), (257, 300, 256)],
                         ids=["113x203-d64", "1023x1024-d128", "257x300-d256"])
def test_alibi(sq, sk, d, alibi, mask, dtype):
    run_case(2, sq, sk, 6, 2, d, dtype, dict(mask, alibi=alibi))


# Unmasked key tiles after an item's first take the lazy softmax step at hdim 192 / 256
# (fa3_softmax.h): exponentials against the running max, checked afterwards. Keys are walked
# from the last to the first, so scaling the first 100 keys' K makes the logits jump after the
# max is set: by tens of log2 units at x8 (settle rescales P, the sums and O) and by hundreds
# at x60 (P overflows: settle recomputes the scores). 379 - 300 keys: the first row's diagonal
# ends the unmasked tiles (80 wide), so it has no max before them (the walk's first unmasked
# tile then takes the masked step).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("jump", [8.0, 60.0], ids=["rescale", "rescore"])
@pytest.mark.parametrize("sq,sk,d", [(300, 700, 192), (1023, 1024, 256), (200, 2100, 256),
                                     (300, 379, 256)])
def test_logit_jumps(sq, sk, d, jump, causal, dtype):
    skip_unless_built(dtype, d)
    q, k, v = qkv(2, sq, sk, 4, 2, d, dtype)
    k[:, :100] *= jump
    check((q, k, v), "qkv", dtype, fa(dict(causal=causal)), dict(causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
def test_logit_jumps_cluster(dtype):
    """The same in the 2-CTA cluster kernel (hdim 256 full attention)."""
    skip_unless_built(dtype, 256)
    for jump in (8.0, 60.0):
        q, k, v = qkv(2, 1023, 1500, 4, 2, 256, dtype)
        k[:, :100] *= jump
        check((q, k, v), "qkv", dtype, fa({}, tuning=CLUSTER), {})


# ---- 4. fa3 against fa2 -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [{}, dict(causal=True), dict(window_size=(100, 30)),
                                  dict(causal=True, softcap=20.0)],
                         ids=["full", "causal", "w100-30", "causal-softcap"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_agrees_with_fa2(d, spec, dtype):
    """Same inputs, both families: out within 2 x PyTorch's error (+ ulp) of each other, and
    the lse within the lse tolerance."""
    skip_unless_built(dtype, d)
    b, sq, sk, h, hk = 2, 517, 1031, 6, 2
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype)
    out3, lse3, _ = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True, backend="fa3",
                                               **spec)
    out2, lse2, _ = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True, backend="fa2",
                                               **spec)
    dout = torch.zeros_like(q)
    truth = reference((q, k, v), lambda *t: t, dout, True, spec)
    lowp = reference((q, k, v), lambda *t: t, dout, False, spec)
    assert_agree("out", out3, out2, truth.out, lowp.out, dtype)
    finite = torch.isfinite(lse2)
    assert torch.equal(finite, torch.isfinite(lse3))
    assert (lse3[finite] - lse2[finite]).abs().max().item() <= 4e-4 * (1 + lse2[finite].abs().max().item())


# Issue 35's awkward shapes for the backward: seqlen pairs, GQA ratios 6 and 7.
BWD_CASES = [(2, 1, 239, 6, 1), (1, 113, 203, 7, 1), (1, 1023, 1024, 6, 6), (2, 239, 1, 4, 4),
             (1, 777, 1999, 8, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("mods", [{}, dict(window=(33, 7), softcap=5.0)],
                         ids=["plain", "window-softcap"])
@pytest.mark.parametrize("d", [40, 64, 80, 96, 120, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("b,sq,sk,h,hk", BWD_CASES)
def test_backward_agrees_with_fa2(b, sq, sk, h, hk, d, mods, causal, dtype):
    """fa3's backward (the gradient of an fa3 forward; 160 / 224 pad to the 192 / 256 tiles) and
    fa2's on the same inputs and the same O / LSE. fa3's own check against the references is
    the other tests'."""
    skip_unless_built(dtype, d)
    assert build_matrix.backward_family("fa3", d, {"causal"} if causal else ()) == "fa3"
    _backward_agrees_with_fa2(b, sq, sk, h, hk, d, dtype, causal, mods.get("window"),
                              mods.get("softcap", 0.0))


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_backward_more_items_than_sms(d, causal, dtype, deterministic):
    """More (key tile, KV head, batch) items than twice the SMs: where bwd_persistent says so
    (fa3_plan.h) a CTA an SM takes them in turn, the next item's K / V loading while this one's
    dK / dV go out; elsewhere a CTA takes one. Against fa2's backward as above; GQA 2, keys
    that end inside a tile."""
    skip_unless_built(dtype, d)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sk, h, hk = 1999, 6, 3  # 16 key tiles (32 at head dims 192 and 256)
    _backward_agrees_with_fa2(2 * sms // (16 * hk) + 1, 300, sk, h, hk, d, dtype, causal,
                              deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_long_causal_rows(dtype, deterministic):
    """Causal calls of 4096 query rows or more at head dim 64 walk 96 rows a step (fa3_plan.h:
    kBwdPlainCausalRows), whose diagonal steps straddle two key tiles: 4100 rows (the last
    tile partial), 4133 keys (bottom-right: row i sees keys 0..i + 33), GQA 3.
    Against fa2's backward as above."""
    skip_unless_built(dtype, 64)
    _backward_agrees_with_fa2(1, 4100, 4133, 6, 2, 64, dtype, True,
                              deterministic=deterministic)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("case", ["few-items-2-parts-softcap", "more-items-than-sms-3-parts"])
def test_backward_split_tail(case, d, dtype):
    """Full attention's last partial wave split by query tiles (fa3_plan.h: bwd_split_parts),
    forced to 2 or 3 parts an item (the private fa3_bwd_split): each part adds its dK / dV into
    fp32 sums and the last part stores them. Fewer items than SMs (all of them split; 2 x 1000 x
    6 heads, GQA 3, 1500 keys: a key tile ends inside), or more (the last partial wave's items
    split; 1999 keys, 300 rows: 5 query tiles of 64 in parts of 1, 2, 2). Against the
    reference."""
    skip_unless_built(dtype, d)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if case.startswith("few"):
        b, sq, sk, h, hk, spec, parts = 2, 1000, 1500, 6, 2, dict(softcap=5.0), 2
    else:
        b, sq, sk, h, hk, spec, parts = 2 * sms // (16 * 3) + 1, 300, 1999, 6, 3, {}, 3
    attn = attn_args(spec, b, h)
    check(qkv(b, sq, sk, h, hk, d, dtype), "qkv", dtype,
          fa(attn, tuning=dict(fa3_bwd_split=parts)), attn)


def _backward_agrees_with_fa2(b, sq, sk, h, hk, d, dtype, causal, window=None, softcap=0.0,
                              deterministic=False):
    """fa3's and fa2's backward of an fa3 forward, on the same inputs, O and LSE: dq, dk, dv
    within 2 x PyTorch's error (+ ulp) of each other. window: (left, right), right 0 if causal;
    deterministic: fa3's (fa2's runs its default)."""
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    args = (d ** -0.5, causal, left, right, softcap, None, 0.0, False)
    out, lse, rng = _ops.run_fwd(q, k, v, *args, "fa3")
    grads = {family: _ops.run_bwd(dout, q, k, v, out, lse, rng, *args[:-1],
                                  deterministic and family == "fa3", family)
             for family in ("fa3", "fa2")}
    spec = dict(causal=causal, softcap=softcap)
    if window is not None:
        spec["window_size"] = (left, right)
    spec = reference_attn(spec, q.shape, sk)
    truth = reference((q, k, v), lambda *t: t, dout, True, spec)
    lowp = reference((q, k, v), lambda *t: t, dout, False, spec)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_agree(name, grads["fa3"][i], grads["fa2"][i], truth.grads[i], lowp.grads[i],
                     dtype)
    if deterministic:  # and the same bits again (CTAs of several items, in any order)
        again = _ops.run_bwd(dout, q, k, v, out, lse, rng, *args[:-1], True, "fa3")
        for name, g, g0 in zip(("dq", "dk", "dv"), again, grads["fa3"]):
            assert torch.equal(g, g0), f"{name} differs bitwise between deterministic runs"


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("spec", [{}, dict(causal=True),
                                  dict(window_size=(300, 40), softcap=5.0),
                                  dict(window_size=(200, -1), alibi="per-batch")],
                         ids=["full", "causal", "window-softcap", "left-window-alibi"])
def test_deterministic_backward(spec, d):
    """deterministic=True: the rule, and five runs equal bit for bit. 1500 keys are 12 key
    tiles (24 at head dims 192 / 256), so a dQ tile takes up to 12 (24) fixed-point adds, in
    whatever order the CTAs reach it; GQA 3 adds three heads' rows."""
    dtype = torch.bfloat16
    skip_unless_built(dtype, d)
    inputs = qkv(2, 1000, 1500, 6, 2, d, dtype)
    dout = randn(2, 1000, 6, d, dtype=dtype)
    attn = attn_args(spec, 2, 6)
    call = fa(dict(attn, deterministic=True))
    first = check(inputs, "qkv", dtype, call, attn, dout=dout)
    for _ in range(4):
        again = run_ours(inputs, call, dout)
        for name, g, g0 in zip(("dq", "dk", "dv"), again.grads, first.grads):
            assert torch.equal(g, g0), f"{name} differs bitwise between deterministic runs"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_backward_uneven_rows(d):
    """deterministic=True adds dQ in fixed point, each row on a scale from a bound of its sum
    (fa3_bwd_prep.cuh: its dO's norm, the largest |K| element and |V| row of its KV head), so
    a row's rounding is a fraction of that bound, not of its values. Rows of dO from 1e-4 to
    1e3 times the others, a key 3 times the others' norm and a V row 10 times: the usual rule,
    and row by row dq's error at most 2 x the default mode's on the same row + a bf16 ulp of
    the row's largest value, so that a row on the wrong scale or short of resolution shows
    even where it is small.

    Not row by row against PyTorch's error: rows that put most of their weight on one key fail
    that in both modes (a CPU emulation of the kernels' arithmetic: 1-10 of the 5600 rows, up
    to 8x, and none once D = rowsum(dO o O) came from the float64 O): D from the bf16 O, as every
    FlashAttention backward takes it, leaves an error of O's rounding in the key's dP - D,
    which nearly cancels there, while PyTorch's softmax backward sums P dP itself."""
    dtype = torch.bfloat16
    skip_unless_built(dtype, d)
    b, sq, sk, h, hk = 2, 700, 900, 4, 2
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype)
    k[:, 3] *= 3
    v[:, 7] *= 10
    rows = 10.0 ** torch.empty(b, sq, h, 1, device=DEVICE).uniform_(-4, 3)
    dout = (torch.randn(b, sq, h, d, device=DEVICE) * rows).to(dtype)
    det = check((q, k, v), "qkv", dtype, fa(dict(deterministic=True)), {}, dout=dout)
    default = run_ours((q, k, v), fa({}), dout)
    truth = reference((q, k, v), lambda *t: t, dout, True, reference_attn({}, q.shape, sk))
    truth_dq = truth.grads[0]
    err = (det.grads[0].double() - truth_dq).abs().amax(-1)
    err_default = (default.grads[0].double() - truth_dq).abs().amax(-1)
    ulp = truth_dq.abs().amax(-1) * 2.0 ** -8
    worst = (err / (2 * err_default + ulp)).max().item()
    assert worst <= 1.0, f"dq: a row's error is {worst:.2f} x (2 x the default mode's + ulp)"


@pytest.mark.parametrize("case", ["few-pairs", "more-items-than-sms"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_backward_zeroed_in_kernel(d, causal, case):
    """The dQ accumulator zeroed by the main kernel's idle producer warps, each pair's writer
    waiting for its chunks (fa3_plan.h: bwd_zero_chunks), against the memset (the private
    fa3_bwd_zero=0): deterministic mode, whose integer adds give the same bits in any order,
    so the two must agree bit for bit, over memory poisoned before each pass; the in-kernel
    run against the reference too. A few (KV head, batch) pairs of many chunks (GQA 3, 1500
    keys), or more items than SMs over many pairs (1999 keys, 300 rows)."""
    dtype = torch.bfloat16
    skip_unless_built(dtype, d)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if case == "few-pairs":
        b, sq, sk, h, hk = 2, 1000, 1500, 6, 2
    else:
        b, sq, sk, h, hk = 2 * sms // (16 * 3) + 1, 300, 1999, 6, 3
    inputs = qkv(b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    attn = attn_args(dict(causal=True) if causal else {}, b, h)
    det = dict(attn, deterministic=True)
    in_kernel = check(inputs, "qkv", dtype, fa(det), attn, dout=dout)
    memset = run_ours(inputs, fa(det, tuning=dict(fa3_bwd_zero=0)), dout)
    for name, g, g0 in zip(("dq", "dk", "dv"), in_kernel.grads, memset.grads):
        assert torch.equal(g, g0), f"{name}: zeroed in the kernel and by a memset differ"


# ---- 5. layouts and grids ---------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_grid_past_65535_heads(d):
    """batch x heads = 70400 > 65535 (the limit of a grid's y and z): the grids are 1-D, the
    forward's and (head dim 128) the backward's."""
    run_case(1100, 16, 16, 64, 64, d, torch.bfloat16, dict(causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_and_strided_inputs(dtype):
    """qkv packed (strided views of one tensor), and q of seqlen 1 whose row stride (3
    elements) no TMA descriptor accepts: the launcher replaces strides of extent-1 dims."""
    skip_unless_built(dtype, 64)
    b, s, h, d = 2, 333, 4, 64
    qkv_packed = randn(b, s, 3, h, d, dtype=dtype)
    out = flash_attn.flash_attn_qkvpacked_func(qkv_packed, causal=True, backend=BACKEND)
    q, k, v = qkv_packed.unbind(2)
    want = flash_attn.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(),
                                      causal=True, backend=BACKEND)
    assert torch.equal(out, want)
    base = randn(b * h * d + 8, dtype=dtype)
    q1 = base.as_strided((b, 1, h, d), (h * d, 3, d, 1))
    k1, v1 = randn(b, 50, h, d, dtype=dtype), randn(b, 50, h, d, dtype=dtype)
    got = flash_attn.flash_attn_func(q1, k1, v1, backend=BACKEND)
    want = flash_attn.flash_attn_func(q1.contiguous(), k1, v1, backend=BACKEND)
    assert torch.equal(got, want)


# ---- 6. dispatch on sm90 ----------------------------------------------------------------------

def test_default_on_sm90_is_fa3():
    if _dispatch.device_arch(DEVICE) != 90:
        pytest.skip("the automatic choice of fa3 is for sm90")
    skip_unless_built(torch.bfloat16, 128)
    q, k, v = qkv(1, 64, 64, 2, 2, 128, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _dispatch.BackendFallbackWarning)
        assert flash_attn.select_backend(q, k, v, causal=True) == "fa3"
        q.requires_grad_()
        assert flash_attn.select_backend(q, k, v, causal=True) == "fa3"   # + its backward
    with pytest.warns(_dispatch.BackendFallbackWarning, match=r"fa3 does not support dropout"):
        assert flash_attn.select_backend(q, k, v, dropout_p=0.1) == "fa2"


@pytest.mark.parametrize("family", ["fa3", "fa2"])
def test_rng_state_zeros_without_dropout(family):
    """A call that draws nothing gets rng_state zeros (fa3's kernel writes them, the API zeroes
    it for the others): a freed block of nonzero int64s, which the allocator hands out again,
    must come back zeros."""
    skip_unless_built(torch.bfloat16, 128)
    if family not in flash_attn.available_backends():
        pytest.skip(f"this build has no {family}")
    q, k, v = qkv(1, 100, 300, 2, 2, 128, torch.bfloat16)
    for _ in range(3):
        junk = torch.full((2,), -7, dtype=torch.int64, device=DEVICE)
        del junk
        _, _, rng_state = _ops.run_fwd(q, k, v, 128 ** -0.5, False, -1, -1, 0.0, None, 0.0,
                                       False, family)
        assert rng_state.tolist() == [0, 0]


def test_forced_fa3_with_dropout_is_an_error():
    q, k, v = qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"backend='fa3' cannot run this call .*"
                                                  r"fa3 does not support dropout_p > 0"):
        flash_attn.flash_attn_func(q, k, v, dropout_p=0.1, backend=BACKEND)
    # The GPU is still usable.
    assert torch.isfinite(flash_attn.flash_attn_func(q, k, v, backend=BACKEND)).all()


# ---- 7. small cases for compute-sanitizer (.ci/gpu sanitize runs `-k sanitize`) ---------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,sq,sk,h,hk,d,spec", [
    pytest.param(1, 113, 203, 6, 2, 40, dict(causal=True), id="causal-gqa-d40"),
    pytest.param(2, 239, 17, 4, 4, 128, dict(window_size=(3, 2)), id="window-rows-without-key"),
    pytest.param(1, 65, 129, 2, 1, 96, dict(softcap=10.0, alibi="per-head"),
                 id="softcap-alibi-mqa-d96"),
    pytest.param(2, 33, 300, 4, 2, 256, dict(window_size=(16, 8)), id="window-d256"),
    pytest.param(1, 130, 70, 3, 3, 192, dict(causal=True, window_size=(9, -1), alibi="per-head"),
                 id="local-sq>sk-d192"),
    # The wide (three-consumer) tiles (fa3_narrow=0 below: small shapes run the narrow ones,
    # whose items fill the GPU).
    pytest.param(1, 191, 385, 4, 2, 64, dict(causal=True), id="wide-causal-gqa-d64"),
    pytest.param(1, 384, 129, 2, 2, 96, dict(softcap=5.0), id="wide-softcap-d96"),
    pytest.param(1, 300, 200, 3, 3, 128, dict(causal=True), id="wide-causal-sq>sk-d128"),
    pytest.param(1, 1000, 700, 2, 2, 128, {}, id="wide-full-d128"),
    # hdim 256: O staged in the last K / V stage; rows without keys; the consumers' warps decide
    # the O rescale apart (synccheck flagged the wait while it sat in the rescale's branch).
    pytest.param(1, 1000, 300, 2, 1, 256, dict(causal=True), id="causal-sq>sk-d256"),
])
def test_sanitize_small_fa3(b, sq, sk, h, hk, d, spec, dtype, request):
    wide = request.node.callspec.id.startswith("wide-")
    run_case(b, sq, sk, h, hk, d, dtype, spec, tuning=dict(fa3_narrow=0) if wide else None)


# Full attention at hdim 256 in 2-CTA clusters (K / V multicast), forced on a small shape; 300
# rows are three query tiles, so the second cluster's second CTA has no rows.
@pytest.mark.parametrize("dtype", DTYPES)
def test_sanitize_small_fa3_cluster(dtype):
    run_case(2, 300, 200, 4, 2, 256, dtype, tuning=CLUSTER)


# Stream-K on a small shape the rule picks: at hdim 256 2 items x 19 key tiles on 6 CTAs, three
# pieces an item; at hdim 192 2 x 14 on 4; at hdim 128 2 x 12 on 4; at hdim 64 (3000 keys) 2 x
# 16 on 5; 64 query rows, so the second consumer has none.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_sanitize_small_fa3_stream_k(d, dtype):
    run_case(1, 64, 3000 if d == 64 else 1500, 2, 1, d, dtype)
