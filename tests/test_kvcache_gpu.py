"""flash_attn_with_kvcache on the GPU, for every family whose build_matrix entry has the
"kvcache" feature: the output against reference.attention_kvcache_ref (float64, and plain
PyTorch at the input precision) under the forward's error rule (_gpu_common.py), and the cache
after the call against the reference's: new values exactly where they belong, rotated keys
within one rounding of the reference's, every other position untouched.

A family without the feature skips, saying so.
"""

import math
import zlib

import pytest
import torch

import flash_attn
from flash_attn import build_matrix, reference
from conftest import requires_gpu
from _gpu_common import DEVICE, assert_lse, assert_rule, poison_allocator, randn, skip_unless_built

pytestmark = requires_gpu

FAMILIES = [pytest.param(f, id=f) for f in ("fa2", "fa3")]


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def skip_unless_kvcache(family, dtype, d, paged=False):
    features = build_matrix.FAMILIES[family].features
    if "kvcache" not in features or (paged and "paged_kv" not in features):
        pytest.skip(f"{family} has no {'paged ' if paged else ''}KV-cache kernels in this version")
    if family not in flash_attn.available_backends():
        pytest.skip(f"this build does not run {family} on this GPU")
    skip_unless_built(family, dtype, d, ("fwd",))


def rotary_tables(positions, rotary_dim, dtype):
    angle = torch.rand(positions, rotary_dim // 2, device=DEVICE) * 2 * math.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


def paged_copy(cache, page, block_table=None):
    """cache (batch, capacity, ...) as a paged pool with shuffled pages (those of block_table,
    or new ones) and NaN in the spares, and its block_table."""
    batch, capacity = cache.shape[:2]
    pages = -(-capacity // page)
    num_blocks = batch * pages + 7
    if block_table is None:
        block_table = torch.randperm(num_blocks, device=DEVICE)[:batch * pages].view(batch, pages)
    block_table = block_table.long()
    pool = torch.full((num_blocks, page) + tuple(cache.shape[2:]), math.nan, dtype=cache.dtype,
                      device=DEVICE)
    j = torch.arange(capacity, device=DEVICE)
    for b in range(batch):
        pool[block_table[b, j // page], j % page] = cache[b]
    return pool, block_table.to(torch.int32)


def check_call(family, q, k_cache, v_cache, dtype, **kw):
    """Ours against the references; the caches after the call against the reference's."""
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    poison_allocator()
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, backend=family,
                                                  return_softmax_lse=True, **kw)
    ref_kw = {key: value for key, value in kw.items() if key not in ("num_splits", "_tuning")}
    truth = reference.attention_kvcache_ref(q, k_ref, v_ref, upcast=True, **ref_kw)
    lowp = reference.attention_kvcache_ref(q, k_ref, v_ref, upcast=False, **ref_kw)
    assert_rule("out", out, lowp[0], truth[0], 2, dtype)
    assert_lse(lse, truth[1])
    # Values are copied exactly; a rotated key may differ from the float64 rotation's rounding
    # by one unit in the last place.
    assert torch.equal(v_cache.nan_to_num(7.0), truth[3].nan_to_num(7.0))
    if kw.get("rotary_cos") is None:
        assert torch.equal(k_cache.nan_to_num(7.0), truth[2].nan_to_num(7.0))
    else:
        diff = (k_cache.double() - truth[2].double()).nan_to_num(0.0).abs()
        assert (diff <= torch.finfo(dtype).eps * truth[2].double().abs().nan_to_num(0.0)).all()
    return out


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_with_append(family, heads, seqlen_q):
    dtype, d, batch, capacity = torch.bfloat16, 128, 5, 3000
    skip_unless_kvcache(family, dtype, d)
    h, hk = heads
    q = randn(batch, seqlen_q, h, d, dtype=dtype)
    k_cache, v_cache = (randn(batch, capacity, hk, d, dtype=dtype) for _ in range(2))
    k, v = (randn(batch, seqlen_q, hk, d, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([0, 1, 127, 1000, capacity - seqlen_q], dtype=torch.int32,
                           device=DEVICE)
    check_call(family, q, k_cache, v_cache, dtype, k=k, v=v, cache_seqlens=lengths, causal=True)


@pytest.mark.parametrize("causal", [True, False])   # not causal: every q row at cache_seqlens
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_rotary(family, interleaved, causal):
    dtype, d, batch, capacity = torch.float16, 128, 3, 700
    skip_unless_kvcache(family, dtype, d)
    q = randn(batch, 3, 16, d, dtype=dtype)
    k_cache, v_cache = (randn(batch, capacity, 4, d, dtype=dtype) for _ in range(2))
    k, v = (randn(batch, 3, 4, d, dtype=dtype) for _ in range(2))
    cos, sin = rotary_tables(capacity, 64, dtype)
    lengths = torch.tensor([5, 300, 690], dtype=torch.int32, device=DEVICE)
    check_call(family, q, k_cache, v_cache, dtype, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
               rotary_interleaved=interleaved, cache_seqlens=lengths, causal=causal)


@pytest.mark.parametrize("family", FAMILIES)
def test_rotary_with_leftpad_and_int_seqlens(family):
    # Rotary positions are absolute cache positions, leftpad or not; an int cache_seqlens is
    # every sequence's, and None means a full cache.
    dtype, d, capacity = torch.bfloat16, 128, 512
    skip_unless_kvcache(family, dtype, d)
    q = randn(2, 2, 8, d, dtype=dtype)
    k_cache, v_cache = (randn(2, capacity, 8, d, dtype=dtype) for _ in range(2))
    k, v = (randn(2, 2, 8, d, dtype=dtype) for _ in range(2))
    cos, sin = rotary_tables(capacity, 128, dtype)
    check_call(family, q, k_cache, v_cache, dtype, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
               cache_seqlens=200, causal=True,
               cache_leftpad=torch.tensor([17, 150], dtype=torch.int32, device=DEVICE))
    check_call(family, q, k_cache, v_cache, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_idx_leftpad_window_softcap(family):
    dtype, d, capacity = torch.bfloat16, 64, 900
    skip_unless_kvcache(family, dtype, d)
    q = randn(3, 2, 8, d, dtype=dtype)
    k_cache, v_cache = (randn(6, capacity, 2, d, dtype=dtype) for _ in range(2))
    k, v = (randn(3, 2, 2, d, dtype=dtype) for _ in range(2))
    check_call(family, q, k_cache, v_cache, dtype, k=k, v=v,
               cache_seqlens=torch.tensor([10, 400, 897], dtype=torch.int32, device=DEVICE),
               cache_batch_idx=torch.tensor([5, 0, 3], dtype=torch.int32, device=DEVICE),
               cache_leftpad=torch.tensor([3, 0, 200], dtype=torch.int32, device=DEVICE),
               window_size=(256, 0), softcap=30.0)


@pytest.mark.parametrize("num_splits", [0, 1, 3, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_kv_agrees(family, num_splits):
    dtype, d = torch.bfloat16, 128
    skip_unless_kvcache(family, dtype, d)
    q = randn(2, 1, 32, d, dtype=dtype)
    k_cache, v_cache = (randn(2, 16384, 8, d, dtype=dtype) for _ in range(2))
    check_call(family, q, k_cache, v_cache, dtype,
               cache_seqlens=torch.tensor([16384, 9000], dtype=torch.int32, device=DEVICE),
               num_splits=num_splits)


@pytest.mark.parametrize("page", [1, 8, 16, 64, 256])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_matches_contiguous(family, page):
    dtype, d, batch, capacity = torch.bfloat16, 128, 3, 1024
    skip_unless_kvcache(family, dtype, d, paged=True)
    q = randn(batch, 1, 32, d, dtype=dtype)
    k_cache, v_cache = (randn(batch, capacity, 8, d, dtype=dtype) for _ in range(2))
    k, v = (randn(batch, 1, 8, d, dtype=dtype) for _ in range(2))
    cos, sin = rotary_tables(-(-capacity // page) * page, 128, dtype)
    lengths = torch.tensor([0, 333, capacity - 1], dtype=torch.int32, device=DEVICE)
    k_pool, block_table = paged_copy(k_cache, page)
    v_pool, _ = paged_copy(v_cache, page, block_table)
    common = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=True,
                  backend=family)
    if family == "fa3" and page % 8:  # fa3's boxes need pages of a multiple of 8 rows
        with pytest.raises(NotImplementedError, match="page_block_size is not a multiple of 8"):
            flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, block_table=block_table,
                                               **common)
        return
    want = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **common)
    got = flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, block_table=block_table, **common)
    assert torch.equal(got, want)
    # The new rows went through block_table to the same values the contiguous call stored.
    for b, n in enumerate(lengths.tolist()):
        slot = block_table[b, n // page].long(), n % page
        assert torch.equal(k_pool[slot], k_cache[b, n]) and torch.equal(v_pool[slot], v_cache[b, n])


# Longer queries over a cache (chunked prefill: fa3's case on sm90, the forward's kKvCache
# kernel on fa2), with NaN in every cache row past the keys (what a cache holds there is never
# read; fa3 zeroes the V rows of the last tile in shared memory), sequences with no key at
# all, fewer keys than queries, cache_batch_idx with leftpad. Paged (shuffled pages, NaN in
# the spares): fa3 reads a tile as boxes of gcd(page, kBlockN) rows, each within a page:
# 16-row boxes of a tile spanning pages (page 16 or 48; hdim 256's tile of 80 keys), 8-row
# boxes in the 64-byte swizzle (hdim 96) and at hdim 192 (112 keys), one box a tile (256); 40
# new keys after an empty cache: query tiles with one key tile (hdim 256, page 16).
@pytest.mark.parametrize("case", [
    dict(d=128, causal=True),
    dict(d=64, window_size=(200, 0), softcap=25.0),
    dict(d=128, causal=True, seqlen_new=0),
    dict(d=256, causal=True, alibi=True),
    dict(d=64, causal=True, batch_idx=True),
    dict(d=128, causal=True, page=16),
    dict(d=256, causal=True, page=48),
    dict(d=256, causal=True, page=16, seqlen_new=40),
    dict(d=96, window_size=(200, 0), page=24),
    dict(d=192, causal=True, page=8),
    dict(d=64, causal=True, seqlen_new=0, page=256),
], ids=lambda c: "-".join(f"{k}{v}".replace(" ", "") for k, v in c.items()))
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_over_cache(family, case):
    dtype, batch, capacity, seqlen_q, h, hk = torch.bfloat16, 4, 1500, 300, 8, 2
    case = dict(case)
    d, seqlen_new, page = case.pop("d"), case.pop("seqlen_new", seqlen_q), case.pop("page", None)
    skip_unless_kvcache(family, dtype, d, paged=page is not None)
    if case.pop("alibi", False):
        case["alibi_slopes"] = torch.rand(batch, h, device=DEVICE) * 0.3
    rows = batch + 2 if case.pop("batch_idx", False) else batch
    if rows > batch:
        case["cache_batch_idx"] = torch.tensor([5, 0, 3, 1], dtype=torch.int32, device=DEVICE)
        case["cache_leftpad"] = torch.tensor([0, 0, 100, 7], dtype=torch.int32, device=DEVICE)
    q = randn(batch, seqlen_q, h, d, dtype=dtype)
    k_cache, v_cache = (randn(rows, capacity, hk, d, dtype=dtype) for _ in range(2))
    # seqlen_new 0: sequence 0 has no key; 1 and 129 keys: fewer than the 300 queries.
    lengths = [0, 1, 129, capacity - seqlen_new]
    row_of = case["cache_batch_idx"].tolist() if rows > batch else list(range(batch))
    for b, n in enumerate(lengths):  # past the keys: garbage that must never be read
        k_cache[row_of[b], n + seqlen_new:] = math.nan
        v_cache[row_of[b], n + seqlen_new:] = math.nan
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE), **case)
    if seqlen_new:
        kw["k"], kw["v"] = (randn(batch, seqlen_new, hk, d, dtype=dtype) for _ in range(2))
    if page is not None:
        k_cache, kw["block_table"] = paged_copy(k_cache, page)
        v_cache, _ = paged_copy(v_cache, page, kw["block_table"])
    check_call(family, q, k_cache, v_cache, dtype, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_cache(family):
    # A cache of capacity 0 holds no key: every row is empty (out 0, lse +inf), and no kernel
    # meets a zero-length tensor map.
    dtype, d = torch.bfloat16, 128
    skip_unless_kvcache(family, dtype, d)
    q = randn(2, 100, 8, d, dtype=dtype)
    k_cache, v_cache = (randn(2, 0, 1, d, dtype=dtype) for _ in range(2))
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0,
                                                  backend=family, return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


# fa2 runs a short query (seqlen_q * heads / heads_k <= 64) through its decode kernel (one warp
# per KV head and 16 query rows, the query heads packed into the MMA's rows;
# fa2_decode_kernel.cuh) and longer ones through the forward's kernel; _tuning fa2_decode=0
# sends the short ones there too. Both against the references, on the same inputs, with NaN in
# every cache row past the keys.
@pytest.mark.parametrize("tuning", [None, {"fa2_decode": 0}], ids=["auto", "forward_kernel"])
@pytest.mark.parametrize("case", [
    dict(seqlen_q=1, heads=(32, 8), d=128),
    dict(seqlen_q=1, heads=(8, 1), d=128, alibi=True),
    dict(seqlen_q=2, heads=(16, 2), d=64, softcap=20.0, window_size=(300, 0)),
    dict(seqlen_q=3, heads=(12, 3), d=96, causal=True),
    dict(seqlen_q=5, heads=(16, 4), d=128, causal=True),  # 20 rows: two groups of 16
    dict(seqlen_q=8, heads=(64, 8), d=128, causal=True, softcap=30.0),  # 64: four groups
    dict(seqlen_q=9, heads=(64, 8), d=64, causal=True),  # 72 rows: the forward's kernel
    dict(seqlen_q=1, heads=(16, 16), d=256, alibi=True, softcap=10.0),
    dict(seqlen_q=4, heads=(8, 2), d=128, causal=True, page=16),
    dict(seqlen_q=1, heads=(32, 8), d=128, page=1, window_size=(100, -1)),
    # sm90: pages of a multiple of 8 rows come as TMA boxes that never cross a page: 8 rows
    # (8 boxes per K / V tile at hdim 64), 16 of a 48-row page (hdim 256), 8 of 24 (hdim 128).
    dict(seqlen_q=1, heads=(8, 1), d=64, page=8),
    dict(seqlen_q=1, heads=(16, 4), d=256, page=48, softcap=15.0),
    dict(seqlen_q=2, heads=(8, 2), d=128, page=24, causal=True),
], ids=lambda c: "-".join(f"{k}{v}".replace(" ", "") for k, v in c.items()))
def test_decode_kernel(case, tuning):
    # capacity: whole pages of every size below, so that the paged call's capacity (a whole
    # number of pages) is the contiguous one's, with the same key tiles and splits: its result
    # must then be bitwise the same.
    dtype, batch, capacity = torch.bfloat16, 4, 2496
    case = dict(case)
    seqlen_q, (h, hk), d = case.pop("seqlen_q"), case.pop("heads"), case.pop("d")
    page = case.pop("page", None)
    skip_unless_kvcache("fa2", dtype, d, paged=page is not None)
    if case.pop("alibi", False):
        case["alibi_slopes"] = torch.rand(batch, h, device=DEVICE) * 0.3
    q = randn(batch, seqlen_q, h, d, dtype=dtype)
    k_cache, v_cache = (randn(batch, capacity, hk, d, dtype=dtype) for _ in range(2))
    k, v = (randn(batch, seqlen_q, hk, d, dtype=dtype) for _ in range(2))
    lengths = [0, 1, 129, capacity - seqlen_q]
    for b, n in enumerate(lengths):  # past the keys: garbage that must never be read
        k_cache[b, n + seqlen_q:] = math.nan
        v_cache[b, n + seqlen_q:] = math.nan
    kw = dict(k=k, v=v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
              _tuning=tuning, **case)
    if page is None:
        check_call("fa2", q, k_cache, v_cache, dtype, **kw)
        return
    k_pool, block_table = paged_copy(k_cache, page)
    v_pool, _ = paged_copy(v_cache, page, block_table)
    for b, n in enumerate(lengths):  # entries past a sequence's pages: never read
        block_table[b, -(-(n + seqlen_q) // page):] = -1
    want = check_call("fa2", q, k_cache, v_cache, dtype, **kw)
    got = flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, block_table=block_table,
                                             backend="fa2", **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page", [8, 16, 24, 48])
def test_decode_kernel_paged_long_splits(page, num_splits):
    # A split spanning hundreds of pages, each box's page looked up in the block table, and
    # splits that start inside a page (pages of 24 or 48 rows: a 32-key tile's boxes in two
    # pages). Bitwise the contiguous call's result.
    dtype, d, batch, capacity = torch.bfloat16, 128, 2, 4800  # 4800: whole pages of each size
    skip_unless_kvcache("fa2", dtype, d, paged=True)
    q = randn(batch, 1, 32, d, dtype=dtype)
    k_cache, v_cache = (randn(batch, capacity, 8, d, dtype=dtype) for _ in range(2))
    k, v = (randn(batch, 1, 8, d, dtype=dtype) for _ in range(2))
    lengths = [capacity - 1, 1531]
    for b, n in enumerate(lengths):
        k_cache[b, n + 1:] = math.nan
        v_cache[b, n + 1:] = math.nan
    kw = dict(k=k, v=v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
              num_splits=num_splits)
    k_pool, block_table = paged_copy(k_cache, page)
    v_pool, _ = paged_copy(v_cache, page, block_table)
    for b, n in enumerate(lengths):
        block_table[b, -(-(n + 1) // page):] = -1
    want = check_call("fa2", q, k_cache, v_cache, dtype, **kw)
    got = flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, block_table=block_table,
                                             backend="fa2", **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_decode_kernel_splits(num_splits):
    # Splits with no key (short sequences, 64 splits), and the forward kernel's split-KV for
    # comparison through the same combine step.
    dtype, d, batch = torch.bfloat16, 128, 3
    skip_unless_kvcache("fa2", dtype, d)
    q = randn(batch, 1, 32, d, dtype=dtype)
    k_cache, v_cache = (randn(batch, 8192, 8, d, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([8192, 40, 5000], dtype=torch.int32, device=DEVICE)
    for tuning in (None, {"fa2_decode": 0}):
        check_call("fa2", q, k_cache, v_cache, dtype, cache_seqlens=lengths,
                   num_splits=num_splits, _tuning=tuning)


def test_cuda_graph_decode_step():
    # A decode step captured once and replayed: new q / k / v copied into the captured
    # buffers and cache_seqlens advanced in place between replays, as a serving loop does.
    dtype, d, batch, capacity = torch.bfloat16, 128, 3, 1024
    skip_unless_kvcache("fa2", dtype, d)
    k_cache, v_cache = (randn(batch, capacity, 4, d, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([5, 100, 700], dtype=torch.int32, device=DEVICE)
    q = randn(batch, 1, 16, d, dtype=dtype)
    k, v = (randn(batch, 1, 4, d, dtype=dtype) for _ in range(2))

    def step():
        return flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                  cache_seqlens=lengths, causal=True,
                                                  backend="fa2")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (it writes k, v as well)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(randn(*t.shape, dtype=dtype))
        kw = dict(k=k, v=v, cache_seqlens=lengths, causal=True)
        truth = reference.attention_kvcache_ref(q, k_cache, v_cache, upcast=True, **kw)
        lowp = reference.attention_kvcache_ref(q, k_cache, v_cache, upcast=False, **kw)
        graph.replay()
        assert_rule("out", out, lowp[0], truth[0], 2, dtype)
        assert torch.equal(k_cache, truth[2]) and torch.equal(v_cache, truth[3])
        lengths += 1


def test_decode_kernel_splits_with_odd_rows():
    # 3 sequences x 1 head x 1 token x 3 splits: an odd number of partial rows, after which
    # the fp32 partial outputs must still start 16-byte aligned (they are stored as float2).
    dtype, d = torch.bfloat16, 64
    skip_unless_kvcache("fa2", dtype, d)
    q = randn(3, 1, 1, d, dtype=dtype)
    k_cache, v_cache = (randn(3, 4096, 1, d, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([4096, 1000, 3], dtype=torch.int32, device=DEVICE)
    check_call("fa2", q, k_cache, v_cache, dtype, cache_seqlens=lengths, num_splits=3)


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("rotary", [False, True])
def test_decode_chain_matches_plain_launches(seqlen_q, rotary):
    # sm90 launches kvcache_prep, the decode kernel and the combine as a programmatic chain
    # (each may start before the one ahead ends); the decode kernel waits for kvcache_prep only
    # before it reads the rotated q or a key tile that holds new keys. fa2_pdl=0 launches them
    # plainly. Same results, bitwise, with splits; the new keys' slots hold NaN before the
    # call, so a tile read before kvcache_prep wrote them would show. Lengths put the new keys
    # at a tile's start, across two tiles (4 tokens at 30..33), in a split's first tile.
    dtype, d = torch.bfloat16, 128
    skip_unless_kvcache("fa2", dtype, d)
    q = randn(4, seqlen_q, 32, d, dtype=dtype)
    k, v = (randn(4, seqlen_q, 8, d, dtype=dtype) for _ in range(2))
    caches = [randn(4, 4096, 8, d, dtype=dtype) for _ in range(2)]
    lengths = [4096 - seqlen_q, 30, 2000, 64]
    for c in caches:
        for b, n in enumerate(lengths):
            c[b, n:n + seqlen_q] = math.nan
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
              causal=True, num_splits=5, backend="fa2")
    if rotary:
        kw["rotary_cos"], kw["rotary_sin"] = rotary_tables(4096, d, dtype)
    for _ in range(3):
        outs = []
        for tuning in (None, {"fa2_pdl": 0}):
            k_cache, v_cache = (c.clone() for c in caches)
            outs.append(flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                           _tuning=tuning, **kw))
        assert torch.isfinite(outs[0]).all()
        assert torch.equal(outs[0], outs[1])
