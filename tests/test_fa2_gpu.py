"""FA2 on the GPU, through the public API, held to the error-versus-error rule (_gpu_common.py
states it): every case runs ``flash_attn_func(..., backend='fa2')`` forward and backward against
attention_ref in float64 and in plain PyTorch at the input precision.

What is covered: the shape grid (awkward seqlen pairs, head dims that are not powers of two,
MHA / GQA 6:2 / MQA 7:1, causal or not, fp16 / bf16); sliding windows, rows with no key; softcap;
ALiBi; dropout (the kernels' mask against the reference, its statistics, seeding, CUDA graphs);
the deterministic backward; agreement with fa1; grids past 65535 heads and tensors past 2^31
elements; bad input; torch.library.opcheck and torch.compile.

Attention options are written as flash_attn_func's keyword arguments (``attn`` dicts), handed
unchanged to the references; ALiBi appears in parametrisations as ``alibi='per-head'`` /
``'per-batch'`` and becomes random slopes in the test (``attn_args``).

Timing: everything but ``test_*_past_2_31_elements`` (about 26 GB of GPU memory each, skipped
where there is less) is meant to run in about a minute on an H100.
"""

import math
import re
import zlib

import pytest
import torch

import flash_attn
from conftest import requires_backend
from _gpu_common import (
    DEVICE, GIB, Result, Rule, alibi_slopes, assert_agree, assert_lse, assert_result,
    assert_rule, attn_args, check, dtype_params, keep_mask, leaves, qkv, randn, reference,
    reference_attn, require_free_memory, run_ours, skip_unless_built, unpacked, visibility,
)

pytestmark = requires_backend("fa2")

BACKEND = "fa2"
DTYPES = dtype_params()   # fa2 needs sm80+, so bf16 always runs where fa2 does
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]

SEQLENS = [(1, 1), (1, 239), (113, 203), (128, 217), (239, 1), (256, 512), (799, 3),
           (1023, 1024), (2048, 2048)]
# Head dims besides 64 / 128 (their own grid): 40, 59, 111, 224 are padded by the frontend (to
# 40, 64, 112, 224) and run by the 64 / 64 / 128 / 256 kernels.
OTHER_HEAD_DIMS = [32, 40, 59, 96, 111, 160, 192, 224, 256]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data per test (dropout draws included), reproducible from the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# ---- helpers ----------------------------------------------------------------------------------

def fa2(attn, backend=BACKEND, deterministic=False, tuning=None):
    """flash_attn_func with attn; tuning: the private overrides of the launchers' choices."""
    def call(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, deterministic=deterministic,
                                          return_attn_probs=True, backend=backend, **attn,
                                          _tuning=tuning)
    return call


def run_case(b, sq, sk, h, hk, d, dtype, spec=None, deterministic=False, tuning=None):
    skip_unless_built(BACKEND, dtype, d)
    attn = attn_args(spec or {}, b, h)
    return check(qkv(b, sq, sk, h, hk, d, dtype), "qkv", dtype,
                 fa2(attn, BACKEND, deterministic, tuning), attn)


def op_args(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, dropout_p=0.0, deterministic=False):
    """flash_attn::fwd's arguments in schema order (the one place that knows it):
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
    dropout_p, deterministic, backend). Head dim a multiple of 8."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return (q, k, v, softmax_scale, causal, window_size[0], window_size[1], softcap,
            alibi_slopes, dropout_p, deterministic, BACKEND)


def bwd_args(dout, q, k, v, out, lse, rng_state, fwd_args):
    """flash_attn::bwd's arguments for the forward called with ``fwd_args`` (op_args)."""
    return (dout, q, k, v, out, lse, rng_state, *fwd_args[3:])


def dropout_mask(rng_state, b, h, sq, sk, p):
    """The keep-mask of the forward that returned ``rng_state`` (the kernels' Philox draws)."""
    return torch.ops.flash_attn.dropout_mask(rng_state, b, h, sq, sk, p)


def _sigma_tol(prob, n, sigmas=6.0):
    """How far a frequency over n Bernoulli(prob) draws may stray; the 2^-14 covers the 16-bit
    keep threshold the kernels compare against."""
    return sigmas * math.sqrt(prob * (1 - prob) / n) + 2.0 ** -14


def assert_agreement(a, b, p, what):
    """Two independent masks of keep probability 1 - p agree on p^2 + (1-p)^2 of the entries."""
    expect = p * p + (1 - p) * (1 - p)
    agree = (a == b).float().mean().item()
    assert abs(agree - expect) <= _sigma_tol(expect, a.numel()), (
        f"{what}: masks agree on {agree:.4f} of the entries; independent ones would on "
        f"{expect:.4f}")


# ---- 1. the shape grid --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_seqlens(sq, sk, d, causal, dtype):
    run_case(2, sq, sk, 4, 4, d, dtype, dict(causal=causal))


@pytest.mark.parametrize("causal", CAUSAL)
def test_tile_order_partial_last_group(causal):
    """Blocks take (tile, head) items in groups of heads sized to fill the GPU once
    (common/tile_order.h). At 4k with 2 x 11 = 22 (batch, head) pairs, on a 132-SM H100, the
    forward's groups are 9 heads (264 resident blocks / 32 query tiles) and the backward's 5
    (132 / 32 key tiles): neither divides 22, so the last group is partial and every item
    decodes through both divisors."""
    run_case(2, 4096, 4096, 11, 11, 64, torch.bfloat16, dict(causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("h,hk,d", [(6, 2, 64), (7, 1, 128)], ids=["gqa6-2-d64", "mqa7-1-d128"])
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_gqa_mqa(sq, sk, h, hk, d, causal, dtype):
    # check() asserts dk / dv come back with nheads_k heads, summed over their query heads.
    run_case(2, sq, sk, h, hk, d, dtype, dict(causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk,h,hk", [(113, 203, 4, 4), (239, 1, 7, 1), (1023, 1024, 6, 2)],
                         ids=["113x203-mha", "239x1-mqa7-1", "1023x1024-gqa6-2"])
@pytest.mark.parametrize("d", OTHER_HEAD_DIMS)
def test_head_dims(d, sq, sk, h, hk, causal, dtype):
    run_case(2, sq, sk, h, hk, d, dtype, dict(causal=causal))


# ---- 2. sliding windows -----------------------------------------------------------------------

WINDOWS = [
    pytest.param((0, 0), False, id="w0-0"),
    pytest.param((3, 5), False, id="w3-5"),
    pytest.param((-1, 7), False, id="w-1-7"),
    pytest.param((17, -1), False, id="w17--1"),
    pytest.param((17, -1), True, id="w17-causal"),      # causal forces right = 0
    pytest.param((0, -1), False, id="w0--1"),
    pytest.param((-1, 0), False, id="w-1-0"),           # plain causal
    pytest.param((40, 300), False, id="w40-300"),       # a side >= seqlen_k is unbounded
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,causal", WINDOWS)
@pytest.mark.parametrize("sq,sk,h,hk,d", [
    (113, 203, 6, 2, 64),
    (239, 17, 4, 4, 128),     # seqlen_q > seqlen_k: a small right side leaves rows with no key
    (1023, 1024, 7, 1, 96),
], ids=["113x203-gqa-d64", "239x17-mha-d128", "1023x1024-mqa-d96"])
def test_window(sq, sk, h, hk, d, window, causal, dtype):
    run_case(2, sq, sk, h, hk, d, dtype, dict(window_size=window, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,spec,rows_empty,keys_unseen", [
    (300, 64, dict(window_size=(4, 2)), True, False),    # early rows' windows end before key 0
    (64, 300, dict(window_size=(2, 3)), False, True),    # most keys are seen by no row
    (200, 200, dict(window_size=(0, 0)), False, False),  # every row sees its diagonal key only
    (150, 40, dict(causal=True), True, False),           # rows 0..109 see nothing
], ids=["rows-before-key-0", "keys-unseen", "diagonal-only", "causal-sq>sk"])
def test_rows_with_no_key(sq, sk, spec, rows_empty, keys_unseen, dtype):
    """out, dq (and dk, dv of keys no row sees) exactly 0 and lse +inf (check() asserts both),
    on cases built to have such rows / keys."""
    visible = visibility(sq, sk, spec)
    assert (not visible.any(1).all()) == rows_empty and (not visible.any(0).all()) == keys_unseen
    ours = run_case(2, sq, sk, 6, 2, 64, dtype, spec)
    empty = ~visible.any(1)
    assert torch.isposinf(ours.lse[:, :, empty]).all()
    assert torch.isfinite(ours.lse[:, :, ~empty]).all()


def test_window_minus_one_zero_is_causal():
    """(-1, 0) is the causal mask, bit for bit, through the public function and the op; and a
    causal call with a left side is the window (left, 0)."""
    dtype = torch.bfloat16
    b, sq, sk, h, hk, d = 2, 300, 420, 6, 2, 64
    skip_unless_built(BACKEND, dtype, d)
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype)
    f = flash_attn.flash_attn_func
    a = f(q, k, v, window_size=(-1, 0), backend=BACKEND)
    assert torch.equal(a, f(q, k, v, causal=True, backend=BACKEND))
    op = torch.ops.flash_attn.fwd
    out_w, lse_w, _ = op(*op_args(q, k, v, window_size=(-1, 0)))
    out_c, lse_c, _ = op(*op_args(q, k, v, causal=True))
    assert torch.equal(out_w, out_c) and torch.equal(lse_w, lse_c)
    assert torch.equal(out_c, a)
    left = f(q, k, v, causal=True, window_size=(17, -1), backend=BACKEND)
    assert torch.equal(left, f(q, k, v, window_size=(17, 0), backend=BACKEND))


# ---- 3. softcap -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("softcap", [30.0, 5.0])
@pytest.mark.parametrize("sq,sk,h,hk,d", [(113, 203, 6, 2, 64), (1023, 1024, 4, 4, 128)],
                         ids=["113x203-gqa-d64", "1023x1024-mha-d128"])
def test_softcap(sq, sk, h, hk, d, softcap, causal, dtype):
    # A scale of 3 / sqrt(d) makes the logits ~N(0, 9), so a cap of 5 saturates many of them.
    run_case(2, sq, sk, h, hk, d, dtype,
             dict(causal=causal, softcap=softcap, softmax_scale=3.0 / math.sqrt(d)))


# ---- 4. ALiBi ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", [{}, dict(causal=True), dict(window_size=(64, 16))],
                         ids=["full", "causal", "w64-16"])
@pytest.mark.parametrize("alibi", ["per-head", "per-batch"])
@pytest.mark.parametrize("sq,sk,d", [(113, 203, 64), (1023, 1024, 128)],
                         ids=["113x203-d64", "1023x1024-d128"])
def test_alibi(sq, sk, d, alibi, mask, dtype):
    """Bias -slope * |i + seqlen_k - seqlen_q - j| in every case (the lse included), GQA 6:2."""
    run_case(2, sq, sk, 6, 2, d, dtype, dict(mask, alibi=alibi))


# ---- 5. dropout -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("sq,sk,h,hk,d", [(113, 203, 6, 2, 64), (1023, 1024, 4, 4, 128)],
                         ids=["113x203-gqa-d64", "1023x1024-mha-d128"])
def test_dropout(sq, sk, h, hk, d, p, causal, dtype):
    """The forward's output and the backward's gradients against the reference with the mask
    from S_dmask: both passes must draw that mask."""
    run_case(2, sq, sk, h, hk, d, dtype, dict(causal=causal, dropout_p=p))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,sq,sk,h,hk,d,spec", [
    pytest.param(2, 239, 300, 6, 2, 64, dict(causal=True, softcap=20.0, dropout_p=0.17),
                 id="causal-gqa-softcap"),
    pytest.param(2, 200, 150, 7, 1, 96, dict(window_size=(32, 8), alibi="per-batch",
                                             dropout_p=0.5), id="window-alibi-mqa"),
    pytest.param(1, 300, 128, 6, 3, 128, dict(causal=True, window_size=(50, -1), softcap=10.0,
                                              alibi="per-head", dropout_p=0.3),
                 id="everything-rows-without-key"),
])
def test_dropout_combined(b, sq, sk, h, hk, d, spec, dtype):
    run_case(b, sq, sk, h, hk, d, dtype, spec)


@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_mask_statistics(p):
    """The keep-mask of a forward: a keep frequency of 1 - p overall, per (batch, head) and per
    row; and no copies: shifted by a row, a column, a head or a batch (or by the tile and Philox
    block widths) it agrees with itself only as often as two independent masks would."""
    dtype = torch.float16
    b, s, h, hk, d = 2, 1024, 6, 2, 64
    skip_unless_built(BACKEND, dtype, d, ("fwd",))
    q, k, v = qkv(b, s - 1, s, h, hk, d, dtype)
    _, _, probs = flash_attn.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True,
                                             backend=BACKEND)
    keep = keep_mask(probs)                                  # (b, h, sq, sk)
    assert keep.shape == (b, h, s - 1, s)
    freq = keep.float()
    overall = freq.mean().item()
    assert abs(overall - (1 - p)) <= _sigma_tol(1 - p, keep.numel()), overall
    per_head = freq.mean((-1, -2))
    assert ((per_head - (1 - p)).abs() <= _sigma_tol(1 - p, keep[0, 0].numel())).all(), per_head
    per_row = freq.mean(-1)
    worst = (per_row - (1 - p)).abs().max().item()
    assert worst <= _sigma_tol(1 - p, s, sigmas=7.0), f"a row keeps {worst:+.3f} off 1 - p"
    for dim, shifts in ((-1, (1, 2, 4, 8, 16, 32, 64, 128)), (-2, (1, 2, 4, 8, 16, 32, 64, 128)),
                        (1, (1, 2)), (0, (1,))):
        for shift in shifts:
            n = keep.shape[dim] - shift
            assert_agreement(keep.narrow(dim, 0, n), keep.narrow(dim, shift, n), p,
                             f"shift {shift} along dim {dim}")


def test_dropout_seeding():
    """The same torch.manual_seed gives the same output, mask and gradients; another seed, or
    the next call, another mask; and the op's rng_state regenerates the mask S_dmask shows."""
    dtype, p = torch.bfloat16, 0.3
    b, sq, sk, h, hk, d = 2, 113, 203, 6, 2, 64
    skip_unless_built(BACKEND, dtype, d)
    inputs = qkv(b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    call = fa2(dict(dropout_p=p), deterministic=True)

    def seeded(seed):
        torch.manual_seed(seed)
        return run_ours(inputs, call, dout)

    first, again = seeded(1234), seeded(1234)
    assert torch.equal(first.out, again.out) and torch.equal(first.lse, again.lse)
    assert torch.equal(keep_mask(first.probs), keep_mask(again.probs))
    for name, g, g2 in zip("qkv", first.grads, again.grads):
        assert torch.equal(g, g2), f"d{name}: same seed, different gradient"
    other = seeded(4321)
    assert_agreement(keep_mask(first.probs), keep_mask(other.probs), p, "seeds 1234 and 4321")
    assert not torch.equal(first.out, other.out)
    following = run_ours(inputs, call, dout)   # the generator has moved on
    assert_agreement(keep_mask(other.probs), keep_mask(following.probs), p, "consecutive calls")

    torch.manual_seed(1234)
    _, _, rng_state = torch.ops.flash_attn.fwd(*op_args(*inputs, dropout_p=p))
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    assert torch.equal(dropout_mask(rng_state, b, h, sq, sk, p), keep_mask(first.probs))


def test_dropout_backward_uses_the_forwards_draws():
    """Other forwards with dropout between a forward and its backward (the generator moves on)
    do not change the backward's mask."""
    dtype, p = torch.float16, 0.5
    b, sq, sk, h, hk, d = 2, 130, 257, 6, 2, 64
    skip_unless_built(BACKEND, dtype, d)
    inputs = qkv(b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    attn = dict(dropout_p=p, causal=True)
    lv = leaves(inputs)
    out, lse, probs = fa2(attn)(*lv)
    for _ in range(3):
        fa2(attn)(*inputs)
    grads = torch.autograd.grad(out, lv, dout)
    ours = Result(out.detach(), lse, grads, probs)
    ref = reference_attn(attn, lv[0].shape, sk, probs)
    assert_result(ours, reference(inputs, unpacked, dout, False, ref),
                  reference(inputs, unpacked, dout, True, ref), "qkv", dtype)


@pytest.mark.parametrize("causal", CAUSAL)
def test_dropout_cuda_graph(causal):
    """Forward + backward with dropout captured in a CUDA graph: each replay draws a new mask
    (its rng_state says which) and forward and backward agree on it."""
    dtype, p = torch.bfloat16, 0.3
    b, sq, sk, h, hk, d = 2, 113, 203, 6, 2, 64
    skip_unless_built(BACKEND, dtype, d)
    inputs = qkv(b, sq, sk, h, hk, d, dtype)
    q, k, v = leaves(inputs)
    dout = randn(b, sq, h, d, dtype=dtype)
    args = op_args(q, k, v, causal=causal, dropout_p=p)

    def step():
        out, lse, rng_state = torch.ops.flash_attn.fwd(*args)
        return (out, lse, rng_state, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append([t.detach().clone() for t in static])
    torch.cuda.synchronize()

    (out1, _, rng1, *_), (out2, _, rng2, *_) = replays
    assert not torch.equal(rng1, rng2), f"both replays used rng_state {rng1.tolist()}"
    assert not torch.equal(out1, out2)
    attn = dict(causal=causal, dropout_p=p)
    masks = []
    for out, lse, rng_state, *grads in replays:
        mask = dropout_mask(rng_state, b, h, sq, sk, p)
        masks.append(mask)
        ref = dict(attn, dropout_mask=mask)
        assert_result(Result(out, lse, tuple(grads)),
                      reference(inputs, unpacked, dout, False, ref),
                      reference(inputs, unpacked, dout, True, ref), "qkv", dtype)
    assert_agreement(masks[0], masks[1], p, "the two replays")


# ---- 6. the deterministic backward ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("seqlen", [1023, 2049])
def test_deterministic_backward(seqlen, d, dtype):
    b, h, hk = 2, 6, 2
    skip_unless_built(BACKEND, dtype, d)
    attn = dict(causal=True)
    inputs = qkv(b, seqlen, seqlen, h, hk, d, dtype)
    dout = randn(b, seqlen, h, d, dtype=dtype)
    call = fa2(attn, deterministic=True)
    first = check(inputs, "qkv", dtype, call, attn, dout=dout)
    for run in range(1, 10):
        out, lse, grads, _ = run_ours(inputs, call, dout)
        assert torch.equal(out, first.out) and torch.equal(lse, first.lse), f"run {run}: forward"
        for name, g, g0 in zip("qkv", grads, first.grads):
            assert torch.equal(g, g0), f"run {run}: d{name} differs bitwise from run 0"


def test_deterministic_backward_with_dropout():
    """With the seed fixed, dropout + window + softcap + ALiBi + GQA repeat bit for bit."""
    dtype = torch.float16
    b, sq, sk, h, hk, d = 2, 1023, 1100, 6, 2, 128
    skip_unless_built(BACKEND, dtype, d)
    attn = attn_args(dict(window_size=(200, 33), softcap=15.0, alibi="per-batch",
                          dropout_p=0.2), b, h)
    inputs = qkv(b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    call = fa2(attn, deterministic=True)
    torch.manual_seed(7)
    first = check(inputs, "qkv", dtype, call, attn, dout=dout)
    for run in range(1, 10):
        torch.manual_seed(7)
        out, lse, grads, _ = run_ours(inputs, call, dout)
        assert torch.equal(out, first.out), f"run {run}: forward"
        for name, g, g0 in zip("qkv", grads, first.grads):
            assert torch.equal(g, g0), f"run {run}: d{name} differs bitwise from run 0"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk,h,hk,d", [(1023, 1024, 6, 2, 64), (239, 517, 4, 4, 128),
                                          (300, 300, 2, 2, 192)])
def test_dq_reds_path(sq, sk, h, hk, d, causal, dtype):
    """On sm90 the non-deterministic backward adds dQ tiles with bulk reductions; with
    fa2_dq_bulk=0 it takes the per-fragment reds (the path of sm80 and of deterministic=True).
    Both paths must pass the rule."""
    run_case(2, sq, sk, h, hk, d, dtype, dict(causal=causal), tuning=dict(fa2_dq_bulk=0))


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk,h,hk,d", [(1023, 1024, 6, 2, 128), (239, 517, 4, 4, 256),
                                          (300, 300, 2, 2, 96)])
def test_dq_reds_not_deferred(sq, sk, h, hk, d, causal):
    """The reds of dQ's last chunk are spread over dK's GEMM by default (the other tests);
    fa2_dq_defer=0 issues them together after the dQ GEMM (the deterministic path)."""
    run_case(2, sq, sk, h, hk, d, torch.bfloat16, dict(causal=causal),
             tuning=dict(fa2_dq_defer=0))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("sq,sk,h,hk,d", [(1023, 1024, 6, 2, 64), (239, 517, 4, 4, 128)])
def test_bwd_chain_without_pdl(sq, sk, h, hk, d, deterministic):
    """The backward's kernel chain: on sm90 the main kernel and the dQ conversion are launched
    with programmatic dependent launch (the other tests); fa2_pdl=0 gives the plain launches
    of the other GPUs, which must pass the rule too, on scratch the poisoned allocator filled
    (the preprocess zeroes it either way)."""
    run_case(2, sq, sk, h, hk, d, torch.bfloat16, dict(causal=True), deterministic=deterministic,
             tuning=dict(fa2_pdl=0))


# ---- 7. fa1 and fa2 on the same inputs --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk,d", [(113, 203, 64), (1024, 1023, 64), (239, 1, 96)],
                         ids=["113x203-d64", "1024x1023-d64", "239x1-d96"])
def test_fa1_fa2_agree(sq, sk, d, causal, dtype):
    """Both pass the rule on the same inputs and agree with each other within 2 x PyTorch's
    error + ulp."""
    if "fa1" not in flash_attn.available_backends():
        pytest.skip(f"fa1 does not run here (available: {flash_attn.available_backends()})")
    skip_unless_built("fa1", dtype, d)
    skip_unless_built(BACKEND, dtype, d)
    b, h, hk = 2, 6, 2
    attn = dict(causal=causal)
    inputs = qkv(b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    results = {be: check(inputs, "qkv", dtype, fa2(attn, be), attn, dout=dout)
               for be in ("fa1", BACKEND)}
    truth = reference(inputs, unpacked, dout, True, attn)
    lowp = reference(inputs, unpacked, dout, False, attn)
    a, c = results["fa1"], results[BACKEND]
    for name, x, y, t, e in zip(["out", "dq", "dk", "dv"], (a.out, *a.grads), (c.out, *c.grads),
                                (truth.out, *truth.grads), (lowp.out, *lowp.grads)):
        assert_agree(f"{name} (fa1 vs fa2)", x, y, t, e, dtype)
    finite = torch.isfinite(truth.lse)
    assert torch.equal(torch.isposinf(a.lse), torch.isposinf(c.lse))
    torch.testing.assert_close(a.lse[finite], c.lse[finite], rtol=2e-4, atol=2e-4)


# ---- packed layouts with the fa2 features -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_qkvpacked(dtype):
    b, s, h, d = 2, 257, 4, 64
    skip_unless_built(BACKEND, dtype, d)
    attn = attn_args(dict(window_size=(32, 32), alibi="per-batch", dropout_p=0.2), b, h)

    def call(qkv_):
        return flash_attn.flash_attn_qkvpacked_func(qkv_, return_attn_probs=True,
                                                    backend=BACKEND, **attn)
    check((randn(b, s, 3, h, d, dtype=dtype),), ["qkv"], dtype, call, attn,
          to_qkv=lambda t: t.unbind(2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvpacked(dtype):
    b, sq, sk, h, hk, d = 2, 113, 203, 6, 2, 72
    skip_unless_built(BACKEND, dtype, d)
    attn = dict(causal=True, softcap=20.0)

    def call(q, kv):
        return flash_attn.flash_attn_kvpacked_func(q, kv, return_attn_probs=True,
                                                   backend=BACKEND, **attn)
    check((randn(b, sq, h, d, dtype=dtype), randn(b, sk, 2, hk, d, dtype=dtype)), ["q", "kv"],
          dtype, call, attn, to_qkv=lambda q, kv: (q, *kv.unbind(2)))


# ---- 8. large grids and 64-bit offsets --------------------------------------------------------

def _chunked_rules(dtype):
    return {n: Rule(n, f, dtype) for n, f in (("out", 2), ("dq", 3), ("dk", 3), ("dv", 3))}


def _add_chunk(rules, ours, lowp, truth, select):
    """Feed one chunk of the references (``select`` maps a full tensor of ours to it)."""
    rules["out"].add(select(ours.out, "q"), lowp.out, truth.out)
    for name, g, gl, gt in zip(("dq", "dk", "dv"), ours.grads, lowp.grads, truth.grads):
        rules[name].add(select(g, name[1]), gl, gt)


@pytest.mark.parametrize("spec", [dict(causal=True),
                                  dict(causal=True, alibi="per-batch", dropout_p=0.17)],
                         ids=["causal", "causal-alibi-dropout"])
def test_batch_times_heads_past_65535(spec):
    """batch * heads = 70400 blocks along one grid axis would not fit in gridDim.y / z (65535);
    the reference runs 100 batches at a time."""
    dtype = torch.float16
    b, sq, sk, h, hk, d = 1100, 16, 24, 64, 16, 32
    skip_unless_built(BACKEND, dtype, d)
    require_free_memory(4 * GIB)
    attn = attn_args(spec, b, h)
    inputs = qkv(b, sq, sk, h, hk, d, dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    ours = run_ours(inputs, fa2(attn), dout)
    ref = reference_attn(attn, inputs[0].shape, sk, ours.probs)
    rules = _chunked_rules(dtype)
    for b0 in range(0, b, 100):
        rows = slice(b0, b0 + 100)
        part = dict(ref)
        for key in ("alibi_slopes", "dropout_mask"):
            if key in part and part[key].dim() > 1:
                part[key] = part[key][rows]
        chunk = [t[rows] for t in inputs]
        truth = reference(chunk, unpacked, dout[rows], True, part)
        lowp = reference(chunk, unpacked, dout[rows], False, part)
        _add_chunk(rules, ours, lowp, truth, lambda t, _: t[rows])
        assert_lse(ours.lse[rows], truth.lse)
    for rule in rules.values():
        rule.check()


def test_k_v_past_2_31_elements():
    """k, v, dk, dv of more than 2^31 elements each (the last keys' offsets need 64 bits);
    causal with seqlen_q << seqlen_k, so every row reads nearly all of them. The reference runs
    one head at a time. About 22 GB."""
    dtype = torch.bfloat16
    b, sq, h, d = 1, 200, 32, 256
    sk = (1 << 31) // (h * d) + 1000
    skip_unless_built(BACKEND, dtype, d)
    require_free_memory(4 * sk * h * d * 2 + 6 * GIB)    # k, v, dk, dv + the references
    q, k, v = (randn(b, s, h, d, dtype=dtype).requires_grad_() for s in (sq, sk, sk))
    assert k.numel() > 1 << 31
    dout = randn(b, sq, h, d, dtype=dtype)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                             backend=BACKEND)
    ours = Result(out.detach(), lse, torch.autograd.grad(out, (q, k, v), dout))
    rules = _chunked_rules(dtype)
    for h0 in range(h):
        heads = slice(h0, h0 + 1)
        chunk = [t.detach()[:, :, heads] for t in (q, k, v)]
        truth = reference(chunk, unpacked, dout[:, :, heads], True, dict(causal=True))
        lowp = reference(chunk, unpacked, dout[:, :, heads], False, dict(causal=True))
        _add_chunk(rules, ours, lowp, truth, lambda t, _: t[:, :, heads])
        assert_lse(ours.lse[:, heads], truth.lse)
        del truth, lowp
    for rule in rules.values():
        rule.check()


def test_q_past_2_31_elements():
    """q, out, dout, dq (and the backward's fp32 dq accumulator) of more than 2^31 elements;
    a sliding window keeps the work small and makes rows and keys far apart independent, so the
    reference runs on two slices: the first rows and the last ones, whose offsets need 64 bits.
    About 27 GB."""
    dtype = torch.float16
    b, h, hk, d = 1, 32, 2, 256
    s = (1 << 31) // (h * d) + 1000
    left, right = 40, 7
    skip_unless_built(BACKEND, dtype, d)
    big = s * h * d
    require_free_memory(4 * big * 2 + big * 4 + 3 * GIB)  # q, out, dout, dq; dq accumulator
    q = randn(b, s, h, d, dtype=dtype).requires_grad_()
    k, v = (randn(b, s, hk, d, dtype=dtype).requires_grad_() for _ in range(2))
    assert q.numel() > 1 << 31
    dout = randn(b, s, h, d, dtype=dtype)
    attn = dict(window_size=(left, right))
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True, backend=BACKEND,
                                             **attn)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    out = out.detach()
    for r0, r1 in ((0, 512), (s - 1024, s)):
        # Rows [r0, r1) read keys [r0 - left, r1 + right). The reference takes rows up to that
        # end too, so that its bottom-right alignment is the full problem's; those extra rows
        # miss keys and are not compared. dk / dv are complete for the keys whose every reader
        # (rows j - right .. j + left) lies in [r0, r1).
        k0, k1 = max(0, r0 - left), min(s, r1 + right)
        part = [t.detach()[:, lo:hi] for t, lo, hi in ((q, r0, k1), (k, k0, k1), (v, k0, k1))]
        d_part = dout[:, r0:k1]
        truth = reference(part, unpacked, d_part, True, attn)
        lowp = reference(part, unpacked, d_part, False, attn)
        n = r1 - r0
        what = f"rows {r0}..{r1}"
        assert_rule(f"out, {what}", out[:, r0:r1], lowp.out[:, :n], truth.out[:, :n], 2, dtype)
        assert_lse(lse[:, :, r0:r1], truth.lse[:, :, :n])
        assert_rule(f"dq, {what}", dq[:, r0:r1], lowp.grads[0][:, :n], truth.grads[0][:, :n], 3,
                    dtype)
        j0, j1 = (r0 + right if r0 > 0 else 0), (r1 - left if r1 < s else s)
        for name, g, gl, gt in (("dk", dk, lowp.grads[1], truth.grads[1]),
                                ("dv", dv, lowp.grads[2], truth.grads[2])):
            assert_rule(f"{name}, keys {j0}..{j1}", g[:, j0:j1], gl[:, j0 - k0:j1 - k0],
                        gt[:, j0 - k0:j1 - k0], 3, dtype)
        del truth, lowp


# ---- 9. bad input -----------------------------------------------------------------------------

def _bad_calls():
    h16 = torch.float16
    b, s, nh, d = 2, 64, 4, 64
    q, k, v = qkv(b, s, s, nh, nh, d, h16)

    def f(**kw):
        return flash_attn.flash_attn_func(q, k, v, backend=BACKEND, **kw)

    def op(**kw):
        return torch.ops.flash_attn.fwd(*op_args(q, k, v, **kw))

    def cuda_rand(*shape, **kw):
        return torch.rand(*shape, device=DEVICE, **kw)

    return [
        ("alibi_slopes (nheads + 1,)", lambda: f(alibi_slopes=cuda_rand(nh + 1)),
         ValueError, "alibi_slopes"),
        ("alibi_slopes (batch + 1, nheads)", lambda: f(alibi_slopes=cuda_rand(b + 1, nh)),
         ValueError, "alibi_slopes"),
        ("alibi_slopes 3-d", lambda: f(alibi_slopes=cuda_rand(b, nh, 1)),
         ValueError, "alibi_slopes"),
        ("alibi_slopes fp16", lambda: f(alibi_slopes=cuda_rand(nh, dtype=h16)),
         TypeError, "alibi_slopes"),
        ("alibi_slopes on the CPU", lambda: f(alibi_slopes=torch.rand(nh)),
         ValueError, "alibi_slopes"),
        ("alibi_slopes a list", lambda: f(alibi_slopes=[0.5] * nh), TypeError, "alibi_slopes"),
        ("window_size (-2, 0)", lambda: f(window_size=(-2, 0)), ValueError, "window_size"),
        ("window_size (4,)", lambda: f(window_size=(4,)), ValueError, "window_size"),
        ("window_size (1.5, 2)", lambda: f(window_size=(1.5, 2)), ValueError, "window_size"),
        ("dropout_p 1.0", lambda: f(dropout_p=1.0), ValueError, "dropout_p"),
        ("dropout_p -0.1", lambda: f(dropout_p=-0.1), ValueError, "dropout_p"),
        ("dropout_p nan", lambda: f(dropout_p=float("nan")), ValueError, "dropout_p"),
        ("dropout_p '0.1'", lambda: f(dropout_p="0.1"), TypeError, "dropout_p"),
        ("softcap -1", lambda: f(softcap=-1.0), ValueError, "softcap"),
        ("softcap inf", lambda: f(softcap=math.inf), ValueError, "softcap"),
        ("head dim 264", lambda: flash_attn.flash_attn_func(
            *qkv(1, 16, 16, 2, 2, 264, h16), backend=BACKEND), ValueError, "head dim"),
        # The extension's own checks, for callers of the op (the frontend never sends these).
        ("op: alibi_slopes (nheads + 1,)", lambda: op(alibi_slopes=cuda_rand(nh + 1)),
         RuntimeError, "alibi_slopes"),
        ("op: dropout_p 1.0", lambda: op(dropout_p=1.0), RuntimeError, "dropout_p"),
        ("op: window (-2, 3)", lambda: op(window_size=(-2, 3)), RuntimeError, "window"),
    ]


def test_bad_input_raises_and_gpu_stays_usable():
    skip_unless_built(BACKEND, torch.float16, 64)
    for name, call, error, argument in _bad_calls():
        with pytest.raises(error, match=re.escape(argument)):
            call()
        torch.cuda.synchronize()  # would raise if anything had faulted on the device
    run_case(1, 100, 130, 6, 2, 64, torch.float16,
             dict(window_size=(20, 5), softcap=10.0, alibi="per-head", dropout_p=0.2))


# ---- 10. small cases for compute-sanitizer (.ci/gpu sanitize runs `-k sanitize`) ---------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,sq,sk,h,hk,d,spec", [
    pytest.param(1, 113, 203, 6, 2, 40, dict(causal=True), id="causal-gqa-d40"),
    pytest.param(2, 239, 17, 4, 4, 128, dict(window_size=(3, 2)), id="window-rows-without-key"),
    pytest.param(1, 65, 129, 2, 1, 96, dict(softcap=10.0, alibi="per-head"),
                 id="softcap-alibi-mqa-d96"),
    pytest.param(1, 77, 91, 6, 3, 64, dict(causal=True, softcap=15.0, alibi="per-batch",
                                           dropout_p=0.17), id="causal-softcap-alibi-dropout"),
    pytest.param(2, 33, 300, 4, 2, 256, dict(window_size=(16, 8), dropout_p=0.5),
                 id="window-dropout-d256"),
    pytest.param(1, 130, 70, 3, 3, 192, dict(causal=True, window_size=(9, -1), alibi="per-head"),
                 id="local-sq>sk-d192"),
])
def test_sanitize_small_fa2(b, sq, sk, h, hk, d, spec, dtype):
    run_case(b, sq, sk, h, hk, d, dtype, spec)


# ---- 11. torch.library's checks and torch.compile ---------------------------------------------

@pytest.mark.parametrize("spec", [dict(causal=True),
                                  dict(window_size=(16, 4), softcap=12.0, alibi="per-head")],
                         ids=["causal", "window-softcap-alibi"])
def test_opcheck_real_kernels(spec):
    dtype = torch.float16
    b, sq, sk, h, hk, d = 2, 77, 93, 4, 2, 64
    skip_unless_built(BACKEND, dtype, d)
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype)
    args = op_args(q, k, v, softmax_scale=0.125, **attn_args(spec, b, h))
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, args)
    out, lse, rng_state = torch.ops.flash_attn.fwd(*args)
    dout = torch.randn_like(out)
    deterministic = (*args[:10], True, args[11])
    torch.library.opcheck(torch.ops.flash_attn.bwd.default,
                          bwd_args(dout, q, k, v, out, lse, rng_state, deterministic))


def test_opcheck_dropout_mask():
    """A pure function of rng_state: opcheck, and the same answer twice."""
    skip_unless_built(BACKEND, torch.float16, 64, ("fwd",))
    rng_state = torch.tensor([20240601, 12], dtype=torch.int64, device=DEVICE)
    args = (rng_state, 2, 3, 45, 67, 0.25)
    torch.library.opcheck(torch.ops.flash_attn.dropout_mask.default, args)
    mask = dropout_mask(*args)
    assert mask.dtype == torch.bool and mask.shape == (2, 3, 45, 67)
    assert torch.equal(mask, dropout_mask(*args))
    assert abs(mask.float().mean().item() - 0.75) <= _sigma_tol(0.75, mask.numel())


def test_compile_fullgraph_window_softcap_alibi():
    """torch.compile(fullgraph=True) traces forward and backward with no graph break and runs
    the same kernels: the output and (deterministic backward) the gradients equal eager's bit
    for bit; the loss equals it to rounding (inductor may sum in another order)."""
    dtype = torch.bfloat16
    b, sq, sk, h, hk, d = 2, 300, 280, 6, 2, 64
    skip_unless_built(BACKEND, dtype, d)
    torch._dynamo.reset()
    slopes = alibi_slopes((h,), h)

    def step(q, k, v, slopes):
        out = flash_attn.flash_attn_func(q, k, v, window_size=(32, 8), softcap=20.0,
                                         alibi_slopes=slopes, deterministic=True,
                                         backend=BACKEND)
        return out, out.float().square().sum()

    q, k, v = leaves(qkv(b, sq, sk, h, hk, d, dtype))
    eager_out, eager_loss = step(q, k, v, slopes)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    out, loss = torch.compile(step, fullgraph=True)(q, k, v, slopes)
    grads = torch.autograd.grad(loss, (q, k, v))
    assert torch.equal(out, eager_out)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for name, g, ge in zip("qkv", grads, eager_grads):
        assert torch.equal(g, ge), f"d{name}: compiled and eager differ"
