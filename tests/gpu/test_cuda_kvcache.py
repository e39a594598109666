"""flare's KV-cache pass (flash_attn_with_kvcache, flare.ops.fwd_kvcache) on CUDA tensors against the fp32
reference (attention_reference.py) by the same-dtype-error rule of STYLE.md #10: dense and paged caches (page
sizes 1, 3, 16, 256), ragged cache_seqlens with empty and full sequences, appends (across page boundaries),
rotary on q and the new keys, cache_leftpad, cache_batch_idx, GQA/MQA, causal/window/softcap/ALiBi/sinks,
every split count, and the LSE.

  pytest tests/gpu/test_cuda_kvcache.py                 on the GPU machine (skips when no CUDA device is present)
  pytest tests/gpu/test_cuda_kvcache.py --device cpu    the same cases at small sizes against the CPU backend

Every cache slot that no sequence may read (past its keys, before its cache_leftpad, unused blocks) holds NaN,
and the outputs are allocated where a NaN-filled block was just freed: a kernel that reads outside a sequence's
keys, or leaves an output element unwritten, fails the finite check of check_close.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import pytest
import torch

import flare
from flare import ops
from attention_reference import UNIT_ROUNDOFF, AttnOptions, check_close, check_lse, dense_attention
from cases import DEVICE, SMALL, alibi_slopes, randn, require_cuda_backend, skip_module_without_device

skip_module_without_device()

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def _backend():
    require_cuda_backend()


@dataclass
class KvCase:
    dtype: torch.dtype = torch.bfloat16
    batch: int = 4
    seqlen_q: int = 1
    nheads: int = 8
    nheads_k: int = 2
    headdim: int = 64
    headdim_v: Optional[int] = None
    capacity: int = 100               # keys a sequence can hold
    page: Optional[int] = None        # None: dense cache
    cache_seqlens: Optional[list] = None  # None: random, the first 0 and the last full
    seqlen_new: int = 0
    leftpad: bool = False
    batch_idx: bool = False           # dense only: sequences map to shuffled cache rows
    rotary: Optional[str] = None      # None, "halves" or "interleaved"
    rotary_dim: Optional[int] = None  # None: headdim
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    num_splits: int = 0
    via_op: bool = False              # flare.ops.fwd_kvcache instead of flash_attn_with_kvcache
    lengths: list = field(default_factory=list)  # filled by make_inputs: cache_seqlens as used

    @property
    def dv(self):
        return self.headdim if self.headdim_v is None else self.headdim_v

    def describe(self):
        parts = [{torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype], f"b{self.batch} sq{self.seqlen_q}",
                 f"h{self.nheads}/{self.nheads_k} d{self.headdim}" + (f"/{self.headdim_v}" if self.headdim_v else ""),
                 f"cap{self.capacity}", "dense" if self.page is None else f"page{self.page}",
                 f"lens{self.lengths}"]
        for name in ("seqlen_new", "leftpad", "batch_idx", "rotary", "rotary_dim", "causal", "softcap", "alibi",
                     "sinks", "num_splits", "via_op"):
            value = getattr(self, name)
            if value:
                parts.append(f"{name}={value}")
        if self.window != (-1, -1):
            parts.append(f"window{self.window}")
        return " ".join(parts)


def _lengths(case, gen):
    if case.cache_seqlens is not None:
        return list(case.cache_seqlens)
    room = case.capacity - case.seqlen_new
    lengths = [int(torch.randint(0, room + 1, (1,), generator=gen)) for _ in range(case.batch)]
    lengths[0] = 0
    if case.batch > 1:
        lengths[-1] = room  # full after the append
    return lengths


def _rotate(x, cos, sin, interleaved):
    """x (..., d) fp32 rotated by cos/sin (..., rd/2) fp32 on its first rd dims: pairs (2i, 2i+1) when
    interleaved, else (i, i + rd/2); the rest unchanged."""
    rd = 2 * cos.shape[-1]
    xr, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, rest], dim=-1)


def make_inputs(case):
    dev, dt = DEVICE, case.dtype
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))
    lengths = _lengths(case, gen)
    case.lengths = lengths
    b, hk, d, dv = case.batch, case.nheads_k, case.headdim, case.dv
    nan = float("nan")
    if case.page is None:
        rows = b + 2 if case.batch_idx else b
        k_cache = torch.full((rows, case.capacity, hk, d), nan, dtype=dt, device=dev)
        v_cache = torch.full((rows, case.capacity, hk, dv), nan, dtype=dt, device=dev)
        row_of = torch.randperm(rows, generator=gen)[:b] if case.batch_idx else torch.arange(b)
        block_table = None
    else:
        per_seq = -(-case.capacity // case.page)
        blocks = b * per_seq + 3
        k_cache = torch.full((blocks, case.page, hk, d), nan, dtype=dt, device=dev)
        v_cache = torch.full((blocks, case.page, hk, dv), nan, dtype=dt, device=dev)
        block_table = torch.randperm(blocks, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)
        row_of = None
    leftpad = [int(torch.randint(0, n + 1, (1,), generator=gen)) if case.leftpad else 0 for n in lengths]
    # The keys each sequence holds before the call: slots [leftpad, len) random, the rest NaN.
    keys, values = [], []
    for s in range(b):
        kk = randn(case.capacity, hk, d, dtype=dt, device=dev)
        vv = randn(case.capacity, hk, dv, dtype=dt, device=dev)
        kk[: leftpad[s]] = nan
        vv[: leftpad[s]] = nan
        kk[lengths[s]:] = nan
        vv[lengths[s]:] = nan
        keys.append(kk)
        values.append(vv)
        _write_sequence(k_cache, v_cache, case, s, row_of, block_table, kk, vv)
    inputs = dict(q=randn(b, case.seqlen_q, case.nheads, d, dtype=dt, device=dev), k_cache=k_cache,
                  v_cache=v_cache, keys=keys, values=values, row_of=row_of, leftpad=leftpad,
                  cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=dev),
                  cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=dev) if case.leftpad else None,
                  cache_batch_idx=row_of.to(torch.int32).to(dev) if case.batch_idx else None,
                  block_table=None if block_table is None else block_table.to(dev),
                  slopes=alibi_slopes("batch", b, case.nheads, dev) if case.alibi else None,
                  sinks=(torch.randn(case.nheads, device=dev) * 2) if case.sinks else None,
                  k_new=None, v_new=None, cos=None, sin=None)
    if case.seqlen_new:
        inputs["k_new"] = randn(b, case.seqlen_new, hk, d, dtype=dt, device=dev)
        inputs["v_new"] = randn(b, case.seqlen_new, hk, dv, dtype=dt, device=dev)
    if case.rotary:
        rd = case.rotary_dim or d
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        angles = torch.arange(case.capacity + case.seqlen_q, dtype=torch.float32).view(-1, 1) * inv_freq
        inputs["cos"], inputs["sin"] = angles.cos().to(dt).to(dev), angles.sin().to(dt).to(dev)
    return inputs


def _write_sequence(k_cache, v_cache, case, s, row_of, block_table, kk, vv):
    if case.page is None:
        k_cache[int(row_of[s])] = kk
        v_cache[int(row_of[s])] = vv
        return
    # Whole blocks at once: the sequence's rows padded to its blocks (the padding lands past the capacity, in
    # rows no call may read).
    blocks = block_table[s].long().to(k_cache.device)
    rows = blocks.numel() * case.page
    for cache, src in ((k_cache, kk), (v_cache, vv)):
        padded = torch.full((rows, *src.shape[1:]), float("nan"), dtype=src.dtype, device=src.device)
        padded[: case.capacity] = src
        cache[blocks] = padded.view(blocks.numel(), case.page, *src.shape[1:])


def _read_sequence(k_cache, case, s, inputs):
    """Sequence s's cache rows (capacity, nheads_k, d) as the cache now holds them."""
    if case.page is None:
        return k_cache[int(inputs["row_of"][s])]
    table = inputs["block_table"][s].long()
    return k_cache[table].reshape(-1, *k_cache.shape[2:])[: case.capacity]


def expected(case, inputs, round_dtype):
    """Per sequence: the appended keys (rotated, stored in the dtype), q (rotated, in the dtype), then dense
    attention over keys [leftpad, len + seqlen_new). Returns (out (b, sq, h, dv), lse (b, h, sq), new keys per
    sequence as the cache must hold them)."""
    dt, dev = case.dtype, DEVICE
    f32 = torch.float32
    rotary_q = case.rotary is not None
    per_query = case.causal or case.window != (-1, -1)
    interleaved = case.rotary == "interleaved"
    outs, lses, appended = [], [], []
    for s in range(case.batch):
        n, lp = case.lengths[s], inputs["leftpad"][s]
        kk, vv = inputs["keys"][s].clone(), inputs["values"][s].clone()
        if case.seqlen_new:
            kn = inputs["k_new"][s].to(f32)
            if rotary_q:
                pos = torch.arange(n, n + case.seqlen_new, device=dev)
                cos, sin = inputs["cos"][pos].to(f32).unsqueeze(1), inputs["sin"][pos].to(f32).unsqueeze(1)
                kn = _rotate(kn, cos, sin, interleaved)
            kk[n: n + case.seqlen_new] = kn.to(dt)
            vv[n: n + case.seqlen_new] = inputs["v_new"][s]
            appended.append(kk[n: n + case.seqlen_new].clone())
        q = inputs["q"][s].to(f32)
        if rotary_q:
            pos = torch.arange(case.seqlen_q, device=dev) * int(per_query) + n
            cos, sin = inputs["cos"][pos].to(f32).unsqueeze(1), inputs["sin"][pos].to(f32).unsqueeze(1)
            q = _rotate(q, cos, sin, interleaved)
        q = q.to(dt)
        end = n + case.seqlen_new
        slopes = None if inputs["slopes"] is None else inputs["slopes"][s]
        opts = AttnOptions(None, case.causal, case.window, case.softcap, slopes, inputs["sinks"])
        if end == lp:  # no keys: out 0, lse -inf (or the sink)
            outs.append(torch.zeros(case.seqlen_q, case.nheads, case.dv, device=dev))
            lse = torch.full((case.nheads, case.seqlen_q), float("-inf"), device=dev)
            if inputs["sinks"] is not None:
                lse[:] = inputs["sinks"].view(-1, 1)
            lses.append(lse)
            continue
        r = dense_attention(q.unsqueeze(0), kk[lp:end].unsqueeze(0), vv[lp:end].unsqueeze(0), opts,
                            round_dtype=round_dtype, round_scores=round_dtype is not None and case.softcap > 0)
        outs.append(r["out"][0])
        lses.append(r["lse"][0])
    return torch.stack(outs), torch.stack(lses), appended


def _poison_allocator(case):
    """Frees a NaN-filled block the size of the outputs, so that (on CUDA's caching allocator) the call's outputs
    are likely to land on NaNs: an element the kernels leave unwritten then fails the finite check."""
    n = case.batch * case.seqlen_q * case.nheads * max(case.dv, case.headdim)
    for dtype in (case.dtype, torch.float32):
        torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)


def run_flare(case, inputs):
    _poison_allocator(case)
    args = dict(cache_seqlens=inputs["cache_seqlens"], cache_batch_idx=inputs["cache_batch_idx"],
                cache_leftpad=inputs["cache_leftpad"], block_table=inputs["block_table"])
    left, right = case.window
    if case.via_op:
        return ops.fwd_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["k_new"], inputs["v_new"],
                               args["cache_seqlens"], args["cache_batch_idx"], args["cache_leftpad"],
                               args["block_table"], inputs["cos"], inputs["sin"], case.rotary == "interleaved",
                               case.num_splits, inputs["slopes"], 0.0, case.causal, left, right, case.softcap,
                               inputs["sinks"])
    return flare.flash_attn_with_kvcache(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["k_new"], inputs["v_new"],
        rotary_cos=inputs["cos"], rotary_sin=inputs["sin"], rotary_interleaved=case.rotary == "interleaved",
        causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=inputs["slopes"],
        num_splits=case.num_splits, return_softmax_lse=True, s_aux=inputs["sinks"], **args)


def check_kv_case(case):
    inputs = make_inputs(case)
    k_before, v_before = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    out, lse = run_flare(case, inputs)
    context = f"[{case.describe()}]"
    ref_out, ref_lse, appended = expected(case, inputs, None)
    naive_out, naive_lse, _ = expected(case, inputs, case.dtype)
    assert out.shape == ref_out.shape and out.dtype == case.dtype, f"out: {tuple(out.shape)} {out.dtype} {context}"
    check_close("out", out, ref_out, naive_out, case.dtype, context)
    check_lse(lse, ref_lse, naive_lse if case.softcap > 0 else None, context)
    _check_cache(case, inputs, k_before, v_before, appended, context)


def _nan_equal(a, b):
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _check_cache(case, inputs, k_before, v_before, appended, context):
    """The appended slots hold the new keys (rotated: within one rounding of the reference's rotation) and values
    (exactly); every other slot of the cache is unchanged, NaNs included."""
    k_after, v_after = inputs["k_cache"], inputs["v_cache"]
    k_expected, v_expected = k_before.clone(), v_before.clone()
    if case.seqlen_new:
        for s in range(case.batch):
            n = case.lengths[s]
            kk, vv = _read_sequence(k_expected, case, s, inputs).clone(), _read_sequence(v_expected, case, s, inputs).clone()
            kk[n: n + case.seqlen_new] = appended[s]
            vv[n: n + case.seqlen_new] = inputs["v_new"][s]
            _write_sequence(k_expected, v_expected, case, s, inputs["row_of"],
                            None if inputs["block_table"] is None else inputs["block_table"].cpu(), kk, vv)
    assert _nan_equal(v_after, v_expected), f"v_cache: appended values or untouched slots differ {context}"
    if case.rotary is None:
        assert _nan_equal(k_after, k_expected), f"k_cache: appended keys or untouched slots differ {context}"
        return
    same_nan = torch.isnan(k_after) == torch.isnan(k_expected)
    assert bool(same_nan.all()), f"k_cache: slots written that should not be, or not written {context}"
    finite = ~torch.isnan(k_expected)
    err = (k_after[finite].float() - k_expected[finite].float()).abs()
    bound = 2 * UNIT_ROUNDOFF[case.dtype] * k_expected[finite].float().abs() + 1e-6
    assert bool((err <= bound).all()), f"k_cache: rotated keys off by {err.max().item():.3e} {context}"


# ---- the cases --------------------------------------------------------------------------------------------

HEADS = [(8, 2), (4, 1)] if SMALL else [(32, 8), (8, 1), (16, 16)]
SEQLEN_Q = [1, 2, 7] if SMALL else [1, 2, 7, 64]
PAGES = [None, 1, 3, 16, 256]
CAPACITY = 60 if SMALL else 700
LONG_CAPACITY = 200 if SMALL else 5000


def _id(v):
    if isinstance(v, torch.dtype):
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}[v]
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    return "dense" if v is None else str(v)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: "dense" if p is None else f"page{p}")
@pytest.mark.parametrize("seqlen_q", SEQLEN_Q, ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_layouts(dtype, seqlen_q, page):
    """Dense and paged caches, ragged lengths (an empty and a full sequence), causal, 3 keys appended."""
    nheads, nheads_k = HEADS[0]
    check_kv_case(KvCase(dtype=dtype, seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads_k, headdim=64 if SMALL else 128,
                         capacity=CAPACITY, page=page, seqlen_new=3, causal=True))


@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("page", [None, 16], ids=lambda p: "dense" if p is None else f"page{p}")
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_splits(mask, page, num_splits):
    """Every split count, explicit and heuristic, against the same reference; long ragged caches."""
    extra = {"full": {}, "causal": dict(causal=True), "window": dict(window=(150, 0) if not SMALL else (30, 0))}[mask]
    check_kv_case(KvCase(batch=3, seqlen_q=2, nheads=8, nheads_k=2, headdim=64, capacity=LONG_CAPACITY, page=page,
                         seqlen_new=1, num_splits=num_splits, **extra))


FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(20, 0)),
    "window-both": dict(window=(9, 3)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True, causal=True),
    "sinks": dict(sinks=True),
    "sinks-causal-empty": dict(sinks=True, causal=True, cache_seqlens=[0, 0, 5, 1]),
    "everything": dict(causal=True, window=(30, 0), softcap=20.0, alibi=True, sinks=True),
}


@pytest.mark.parametrize("heads", HEADS, ids=_id)
@pytest.mark.parametrize("seqlen_q", [1, 7], ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, seqlen_q, heads):
    extra = dict(FEATURES[feature])
    if "cache_seqlens" in extra:
        extra["capacity"] = 10
    else:
        extra["capacity"] = CAPACITY
    check_kv_case(KvCase(seqlen_q=seqlen_q, nheads=heads[0], nheads_k=heads[1], page=16, seqlen_new=2,
                         num_splits=0 if seqlen_q == 1 else 3, **extra))


ROTARY = [("halves", None), ("halves", 32), ("interleaved", None), ("interleaved", 16)]


@pytest.mark.parametrize("page", [None, 3], ids=lambda p: "dense" if p is None else f"page{p}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rotary", ROTARY, ids=lambda r: f"{r[0]}-rd{r[1] or 'd'}")
def test_rotary(rotary, causal, page):
    """Rotary on q and the new keys: halves or interleaved pairs, rotary_dim = headdim or less; per-query
    positions when causal, one position otherwise."""
    check_kv_case(KvCase(seqlen_q=3, nheads=8, nheads_k=2, headdim=64, capacity=CAPACITY, page=page, seqlen_new=4,
                         rotary=rotary[0], rotary_dim=rotary[1], causal=causal, num_splits=2))


def test_append_across_page_boundary():
    """A page of 16 keys: sequences holding 14 and 31 keys append 5, crossing into their next page."""
    check_kv_case(KvCase(batch=2, seqlen_q=5, capacity=64, page=16, cache_seqlens=[14, 31], seqlen_new=5,
                         causal=True))


def test_append_small_pages():
    """Pages of 3 keys: 6 appended keys span three pages; an empty sequence appends from slot 0."""
    check_kv_case(KvCase(batch=3, seqlen_q=1, capacity=40, page=3, cache_seqlens=[0, 7, 30], seqlen_new=6,
                         causal=True))


HEADDIMS = [(64, None), (40, None), (128, 64)] if SMALL else \
    [(64, None), (128, None), (256, None), (40, None), (72, None), (200, None), (128, 64), (64, 256)]


@pytest.mark.parametrize("dims", HEADDIMS, ids=lambda d: f"d{d[0]}" + (f"-{d[1]}" if d[1] else ""))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_head_dims(dtype, dims):
    check_kv_case(KvCase(dtype=dtype, seqlen_q=2, nheads=8, nheads_k=2, headdim=dims[0], headdim_v=dims[1],
                         capacity=CAPACITY, page=16, seqlen_new=1, causal=True))


@pytest.mark.parametrize("page", [None, 16], ids=lambda p: "dense" if p is None else f"page{p}")
def test_leftpad(page):
    check_kv_case(KvCase(seqlen_q=3, capacity=CAPACITY, page=page, seqlen_new=2, leftpad=True, causal=True,
                         num_splits=2))


def test_cache_batch_idx():
    check_kv_case(KvCase(seqlen_q=2, capacity=CAPACITY, batch_idx=True, seqlen_new=2, causal=True))


@pytest.mark.parametrize("page", [None, 16], ids=lambda p: "dense" if p is None else f"page{p}")
def test_through_the_op(page):
    """flare.ops.fwd_kvcache (the torch custom op) takes the same route as flash_attn_with_kvcache."""
    check_kv_case(KvCase(seqlen_q=2, capacity=CAPACITY, page=page, seqlen_new=2, causal=True, via_op=True,
                         num_splits=3))


def test_internal_workspace():
    """The C ABI without a caller's workspace (CUDA: a stream-ordered allocation inside the call) gives what the
    Python layer's call with one gives, bit for bit: the same kernels and split count."""
    from flare import _capi
    case = KvCase(batch=2, seqlen_q=2, capacity=LONG_CAPACITY, page=16, cache_seqlens=[LONG_CAPACITY - 1, 37],
                  seqlen_new=1, rotary="halves", causal=True, num_splits=3)
    inputs = make_inputs(case)
    k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    out, lse = run_flare(case, inputs)
    lib, tv = _capi.library(), _capi.tensor_view
    p = lib.kvcache_params()
    mine, mine_lse = torch.empty_like(out), torch.empty_like(lse)
    p.q, p.k_cache, p.v_cache, p.out, p.softmax_lse = tv(inputs["q"]), tv(k_cache), tv(v_cache), tv(mine), tv(mine_lse)
    p.k_new, p.v_new = tv(inputs["k_new"]), tv(inputs["v_new"])
    p.cache_seqlens, p.block_table = tv(inputs["cache_seqlens"]), tv(inputs["block_table"])
    p.rotary_cos, p.rotary_sin = tv(inputs["cos"]), tv(inputs["sin"])
    p.num_splits = case.num_splits
    p.attn.causal = 1
    if DEVICE == "cuda":
        p.exec.stream = torch.cuda.current_stream().cuda_stream
    lib.fwd_kvcache(p)
    assert torch.equal(mine, out) and torch.equal(mine_lse, lse), "the call without a workspace differs"
    assert _nan_equal(k_cache, inputs["k_cache"]) and _nan_equal(v_cache, inputs["v_cache"]), \
        "the cache appended without a workspace differs"
