"""flare on CUDA tensors, every feature and combination, against the fp32 reference (attention_reference.py)
by the same-dtype-error rule of STYLE.md #10: forward (out, softmax_lse) and backward (dq, dk, dv) through
the flash_attn-compatible functions, on fresh random inputs with odd lengths.

  pytest tests/gpu                          on the GPU machine (skips when no CUDA device is present)
  pytest tests/gpu --device cpu             the same cases at small sizes against the CPU backend

The CUDA path covers fp16/bf16, head dims that are multiples of 8 up to 576 / 512 (headdim_v may differ), causal,
windows, softcap, ALiBi, GQA/MQA, varlen (+ seqused_k), LSE and a deterministic backward; forwards of few query
rows (the KV-cache kernels under auto), the paged varlen forward and the sm80 forward's split-KV have their own
cases here. The KV-cache pass (flash_attn_with_kvcache) has its own module, test_cuda_kvcache.py.
"""

import pytest
import torch

import flare
from cases import (DEVICE, SMALL, Case, check_case, expect_sm90_refusal, heads_cycle, make_inputs, reference,
                   require_cuda_backend, skip_module_without_device, sm90_forced)
from attention_reference import check_close

skip_module_without_device()

DTYPES = [torch.float16, torch.bfloat16]
if SMALL:
    SEQLENS = [(1, 1), (17, 17), (13, 29), (29, 13), (40, 40), (37, 3)]
    HEADDIMS = [8, 40, 64]
    FEATURE_SEQLENS = [(17, 17), (13, 29), (29, 13)]
    FEATURE_HEADDIMS = [16, 64]
else:
    SEQLENS = [(1, 1), (17, 17), (113, 203), (799, 3), (1023, 1024), (2048, 2048), (203, 113)]
    HEADDIMS = [64, 96, 128, 192, 256, 8, 40, 72, 136, 200]
    FEATURE_SEQLENS = [(17, 17), (113, 203), (203, 113), (799, 3), (1023, 1024)]
    FEATURE_HEADDIMS = [64, 128, 256, 72]


def _id(value):
    if isinstance(value, torch.dtype):
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(value, str(value))
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value)


@pytest.fixture(scope="module", autouse=True)
def _backend():
    require_cuda_backend()


def _batch_for(seqlen_q, seqlen_k):
    return 1 if max(seqlen_q, seqlen_k) >= 2048 else 2


# ---- the main matrix: every length pair x head dim x dtype, with and without causal ----------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_dense(dtype, seqlens, headdim, causal):
    sq, sk = seqlens
    nheads, nheads_k = heads_cycle(HEADDIMS.index(headdim) + SEQLENS.index(seqlens))
    check_case(Case(dtype=dtype, batch=_batch_for(sq, sk), seqlen_q=sq, seqlen_k=sk, nheads=nheads,
                    nheads_k=nheads_k, headdim=headdim, causal=causal))


# ---- masks, softcap, ALiBi, scale: each alone and combined -------------------------------------------------

FEATURES = {
    "window-left": dict(window=(37, -1)),
    "window-right": dict(window=(-1, 29)),
    "window-both": dict(window=(64, 16)),
    "window-diagonal": dict(window=(0, 0)),
    "causal-window": dict(causal=True, window=(100, -1)),
    "softcap": dict(softcap=2.0, softmax_scale=0.5),
    "softcap-causal": dict(causal=True, softcap=30.0),
    "alibi-head": dict(alibi="head"),
    "alibi-batch-causal": dict(causal=True, alibi="batch"),
    "scale": dict(softmax_scale=0.37),
    "everything": dict(causal=True, window=(50, -1), softcap=20.0, alibi="batch", softmax_scale=0.2),
}


@pytest.mark.parametrize("headdim", FEATURE_HEADDIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlens", FEATURE_SEQLENS, ids=_id)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_features(dtype, feature, seqlens, headdim):
    sq, sk = seqlens
    nheads, nheads_k = heads_cycle(list(FEATURES).index(feature) + FEATURE_HEADDIMS.index(headdim))
    check_case(Case(dtype=dtype, batch=2, seqlen_q=sq, seqlen_k=sk, nheads=nheads, nheads_k=nheads_k,
                    headdim=headdim, **FEATURES[feature]))


HEADDIM_PAIRS = [(192, 128), (128, 64), (64, 256), (40, 72), (256, 8)] if not SMALL else [(40, 24), (16, 64)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", HEADDIM_PAIRS, ids=_id)
@pytest.mark.parametrize("seqlens", FEATURE_SEQLENS[1:3], ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_headdim_v(dtype, seqlens, dims, causal):
    sq, sk = seqlens
    check_case(Case(dtype=dtype, batch=2, seqlen_q=sq, seqlen_k=sk, nheads=6, nheads_k=2, headdim=dims[0],
                    headdim_v=dims[1], causal=causal))


# ---- wide heads: head dims above 256 (tiles 384, 512 and 576) ------------------------------------------------
# Their kernels split the output's columns (the forward) and dK's, dV's and dQ's (the backward) into slices,
# one CTA each (heuristics.hpp: sm80_forward_slice), so the pairs below put each head dim on both sides of a
# slice edge. MLA's 576 / 512 among them.

if SMALL:
    WIDE_DIMS = [(264, 264), (512, 512), (576, 512)]
    WIDE_SEQLENS = [(17, 17), (13, 29)]
else:
    WIDE_DIMS = [(264, 264), (320, 320), (384, 384), (448, 448), (512, 512), (576, 512), (512, 320), (320, 512),
                 (384, 136), (136, 384), (576, 64)]
    WIDE_SEQLENS = [(1, 1), (113, 203), (1023, 1024), (203, 113)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", WIDE_DIMS, ids=_id)
@pytest.mark.parametrize("seqlens", WIDE_SEQLENS, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_wide_heads(dtype, seqlens, dims, causal):
    sq, sk = seqlens
    nheads, nheads_k = heads_cycle(WIDE_DIMS.index(dims) + WIDE_SEQLENS.index(seqlens))
    check_case(Case(dtype=dtype, batch=_batch_for(sq, sk), seqlen_q=sq, seqlen_k=sk, nheads=nheads,
                    nheads_k=nheads_k, headdim=dims[0], headdim_v=dims[1], causal=causal))


WIDE_FEATURES = {
    "window-softcap-alibi": dict(batch=2, seqlen_q=177, seqlen_k=900, nheads=4, nheads_k=2, window=(300, 20),
                                 softcap=20.0, alibi="batch"),
    "sinks-mqa-causal": dict(batch=2, seqlen_q=65, seqlen_k=500, nheads=4, nheads_k=1, sinks=True, causal=True),
    "sq>sk-causal": dict(batch=1, seqlen_q=300, seqlen_k=200, nheads=2, nheads_k=2, causal=True),
    "varlen-seqused": dict(seqlens_q=[1, 64, 0, 129], seqlens_k=[300, 64, 5, 700], seqused_k=[250, 64, 0, 699],
                           nheads=4, nheads_k=2, causal=True),
    "decode-gqa": dict(batch=3, seqlen_q=1, seqlen_k=2000, nheads=8, nheads_k=2),
    "deterministic-mqa": dict(batch=1, seqlen_q=777, seqlen_k=1500, nheads=4, nheads_k=1, deterministic=True),
}
if SMALL:
    WIDE_FEATURES = {name: {**c, **({"seqlen_k": min(c["seqlen_k"], 60)} if "seqlen_k" in c else {})}
                     for name, c in WIDE_FEATURES.items() if "varlen" not in name}
WIDE_FEATURE_DIMS = [(512, 512), (576, 512), (384, 320)] if not SMALL else [(512, 512)]


@pytest.mark.parametrize("splits", ["rule", "3"])
@pytest.mark.parametrize("name", list(WIDE_FEATURES))
@pytest.mark.parametrize("dims", WIDE_FEATURE_DIMS, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_wide_head_features(monkeypatch, dtype, dims, name, splits):
    # "rule": the split-KV rule's count (the long decode-like rows split); "3": three splits forced, each merged
    # by the combine kernel across the slices' columns. The backward reads the merged lse.
    if splits != "rule":
        monkeypatch.setenv("FLARE_CUDA_FWD_SPLITS", splits)
    check_case(Case(dtype=dtype, headdim=dims[0], headdim_v=dims[1], **WIDE_FEATURES[name]))


# ---- both forward tile shapes at every head dim, whatever the lengths would pick -----------------------------
# The forward runs 64-row query tiles on short sequences and 128-row ones on long (sm80::forward_shape), so
# the lengths above reach only one shape for some head dims; FLARE_CUDA_FWD_ROWS forces each ("junk": an
# unusable value, ignored).

FORCED_ROWS = ["64", "128", "junk"]
FORCED_SEQLENS = [(113, 203), (1023, 1024)] if not SMALL else [(13, 29)]
FORCED_MASKS = {"full": {}, "causal": dict(causal=True), "window": dict(window=(37, 11))}


@pytest.mark.parametrize("mask", list(FORCED_MASKS))
@pytest.mark.parametrize("headdim", HEADDIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlens", FORCED_SEQLENS, ids=_id)
@pytest.mark.parametrize("rows", FORCED_ROWS)
def test_forward_tiles(monkeypatch, rows, seqlens, headdim, mask):
    monkeypatch.setenv("FLARE_CUDA_ARCH_PATH", "sm80")  # the sm80 forward's two shapes, whatever path is forced
    monkeypatch.setenv("FLARE_CUDA_FWD_ROWS", rows)
    sq, sk = seqlens
    nheads, nheads_k = heads_cycle(HEADDIMS.index(headdim))
    check_case(Case(dtype=torch.bfloat16, batch=2, seqlen_q=sq, seqlen_k=sk, nheads=nheads, nheads_k=nheads_k,
                    headdim=headdim, **FORCED_MASKS[mask]), backward=False)


# ---- split-KV in the sm80 forward: forced split counts (FLARE_CUDA_FWD_SPLITS) on masks, layouts, sinks -------
# The rule (heuristics.hpp: sm80_forward_splits) splits only grids that leave the GPU mostly empty; forcing a
# count checks the split path and the combine on every kind of call, with the backward reading the merged lse.

SPLITS = ["2", "3", "7"]
SPLIT_CASES = {
    "causal-gqa": dict(batch=2, seqlen_q=113, seqlen_k=1037, nheads=8, nheads_k=2, headdim=128, causal=True),
    "sq>sk-causal-mqa": dict(batch=1, seqlen_q=300, seqlen_k=200, nheads=4, nheads_k=1, headdim=64, causal=True),
    "window-softcap-alibi": dict(batch=2, seqlen_q=77, seqlen_k=900, nheads=4, nheads_k=2, headdim=256,
                                 window=(300, 20), softcap=20.0, alibi="batch"),
    "sinks": dict(batch=2, seqlen_q=1, seqlen_k=2000, nheads=8, nheads_k=2, headdim=128, sinks=True),
    "hd40-v72": dict(batch=2, seqlen_q=50, seqlen_k=640, nheads=6, nheads_k=3, headdim=40, headdim_v=72),
    "varlen-seqused": dict(seqlens_q=[1, 64, 0, 129], seqlens_k=[300, 64, 5, 700], seqused_k=[250, 64, 0, 699],
                           nheads=4, nheads_k=2, headdim=128, causal=True),
}
if SMALL:
    SPLIT_CASES = {name: {**c, **({"seqlen_k": min(c["seqlen_k"], 60)} if "seqlen_k" in c else {})}
                   for name, c in SPLIT_CASES.items() if "varlen" not in name}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
@pytest.mark.parametrize("splits", SPLITS)
def test_forward_splits(monkeypatch, splits, name):
    monkeypatch.setenv("FLARE_CUDA_ARCH_PATH", "sm80")  # the split path is the sm80 forward's
    monkeypatch.setenv("FLARE_CUDA_FWD_SPLITS", splits)
    check_case(Case(dtype=torch.bfloat16, **SPLIT_CASES[name]))


# ---- varlen: ragged lengths, empty sequences, seqused_k ------------------------------------------------------

if SMALL:
    VARLEN = {
        "ragged": ([1, 17, 0, 29, 8], [1, 17, 0, 29, 8], None),
        "cross": ([3, 13, 0, 5], [17, 9, 5, 0], None),
        "seqused": ([5, 21, 9, 4], [16, 21, 30, 4], [10, 21, 0, 4]),
    }
    VARLEN_HEADDIMS = [16, 64]
else:
    VARLEN = {
        "ragged": ([1, 17, 113, 0, 799, 64], [1, 17, 113, 0, 799, 64], None),
        "cross": ([3, 113, 0, 50, 203], [17, 203, 5, 0, 113], None),
        "decode": ([1, 1, 1, 1, 2], [33, 1024, 7, 500, 2], None),
        "seqused": ([64, 300, 17, 5, 128], [64, 300, 40, 5, 256], [10, 300, 0, 5, 129]),
        "many": ("random", 23, None),  # 23 sequences of 0..150 tokens, q and k lengths drawn separately
    }
    VARLEN_HEADDIMS = [64, 128, 256, 40]

VARLEN_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(32, 8)),
    "causal-softcap-alibi": dict(causal=True, softcap=15.0, alibi="batch"),
}


def _varlen_lengths(spec, seed):
    seqlens_q, seqlens_k, seqused = spec
    if seqlens_q == "random":
        gen = torch.Generator().manual_seed(seed)
        n = seqlens_k
        seqlens_q = torch.randint(0, 151, (n,), generator=gen).tolist()
        seqlens_k = torch.randint(0, 151, (n,), generator=gen).tolist()
        seqlens_q[3] = seqlens_k[5] = 0  # always an empty query range and an empty key range
    return list(seqlens_q), list(seqlens_k), None if seqused is None else list(seqused)


@pytest.mark.parametrize("headdim", VARLEN_HEADDIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("lengths", list(VARLEN))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_varlen(dtype, lengths, feature, headdim):
    sq, sk, used = _varlen_lengths(VARLEN[lengths], seed=torch.initial_seed())
    nheads, nheads_k = heads_cycle(list(VARLEN).index(lengths) + VARLEN_HEADDIMS.index(headdim))
    check_case(Case(dtype=dtype, seqlens_q=sq, seqlens_k=sk, seqused_k=used, nheads=nheads, nheads_k=nheads_k,
                    headdim=headdim, **VARLEN_FEATURES[feature]))


# ---- few query rows: under auto the KV-cache kernels run them, packing the query heads of a kv head ------------
# where src/cuda/heuristics.hpp's forward_on_decode_kernels says so (the rest of these cases run on the forward
# kernels); forced paths run their own forward kernels on every case.

if SMALL:
    FEW_ROWS = [(1, 1), (1, 37), (3, 29), (7, 5), (2, 16)]
    FEW_ROW_HEADDIMS = [16, 64]
else:
    FEW_ROWS = [(1, 1), (1, 1000), (3, 517), (16, 2048), (7, 5), (2, 64), (8, 4099)]
    FEW_ROW_HEADDIMS = [64, 128, 256, 40, 192]
FEW_ROW_HEADS = [(32, 8), (8, 1), (4, 4), (6, 2)]
FEW_ROW_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(20, 3)),
    "softcap-alibi-causal": dict(causal=True, softcap=15.0, alibi="batch"),
    "sinks": dict(sinks=True, causal=True),
}


@pytest.mark.parametrize("feature", list(FEW_ROW_FEATURES))
@pytest.mark.parametrize("seqlens", FEW_ROWS, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_few_rows(dtype, seqlens, feature):
    sq, sk = seqlens
    i = FEW_ROWS.index(seqlens) + list(FEW_ROW_FEATURES).index(feature)
    nheads, nheads_k = FEW_ROW_HEADS[i % len(FEW_ROW_HEADS)]
    check_case(Case(dtype=dtype, batch=3, seqlen_q=sq, seqlen_k=sk, nheads=nheads, nheads_k=nheads_k,
                    headdim=FEW_ROW_HEADDIMS[i % len(FEW_ROW_HEADDIMS)], **FEW_ROW_FEATURES[feature]))


# ---- paged varlen forward (block_table): the KV-cache kernels read the pages in place ------------------------
# Pages in a random order, every unwritten slot NaN (cases.paged_cache); with seqused_k the call passes it alone
# (vLLM's form), else cu_seqlens_k alone.

if SMALL:
    PAGED = {"decode": ([1, 1, 2, 1], [9, 30, 7, 0], None), "seqused": ([3, 5, 0], [20, 9, 4], [11, 9, 0])}
    PAGES = [1, 3, 16]
else:
    PAGED = {
        "decode": ([1, 1, 1, 2, 1], [33, 1024, 7, 500, 0], None),
        "chunked": ([64, 1, 300, 0, 17], [64, 900, 300, 5, 40], None),
        "seqused": ([1, 5, 9, 2], [40, 300, 64, 5], [10, 300, 0, 5]),
    }
    PAGES = [1, 3, 16, 256]
PAGED_FEATURES = {"plain": {}, "causal": dict(causal=True), "everything": dict(causal=True, window=(50, -1),
                                                                            softcap=20.0, alibi="batch", sinks=True)}


@pytest.mark.parametrize("feature", list(PAGED_FEATURES))
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("lengths", list(PAGED))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_paged_varlen(dtype, lengths, page, feature):
    sq, sk, used = PAGED[lengths]
    i = list(PAGED).index(lengths) + PAGES.index(page)
    nheads, nheads_k = heads_cycle(i)
    check_case(Case(dtype=dtype, seqlens_q=sq, seqlens_k=sk, seqused_k=used, nheads=nheads, nheads_k=nheads_k,
                    headdim=[64, 128, 256, 40][i % 4], page=page, **PAGED_FEATURES[feature]), backward=False)


# ---- one large case ------------------------------------------------------------------------------------------


@pytest.mark.skipif(SMALL, reason="large case: full size only")
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_large_causal(dtype):
    check_case(Case(dtype=dtype, batch=2, seqlen_q=4096, seqlen_k=4096, nheads=16, nheads_k=4, headdim=128,
                    causal=True))


# ---- layouts: strided views, packed tensors, the transformers layout -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_packed_and_strided_inputs(dtype):
    b, s, h, d = 2, (40 if SMALL else 333), 4, 64
    case = Case(dtype=dtype, batch=b, seqlen_q=s, seqlen_k=s, nheads=h, nheads_k=h, headdim=d, causal=True)
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE).to(dtype).requires_grad_()
    out = flare.flash_attn_qkvpacked_func(qkv, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    q, k, v = (t.detach() for t in qkv.unbind(2))
    inputs = {"q": q, "k": k, "v": v, "dout": dout, "slopes": None}
    ref, naive = reference(case, inputs), reference(case, inputs, dtype)
    check_close("out (qkvpacked)", out.detach(), ref["out"], naive["out"], dtype)
    for i, name in enumerate(("dq", "dk", "dv")):
        check_close(f"{name} (qkvpacked)", qkv.grad[:, :, i], ref[name], naive[name], dtype)

    # (batch, heads, seqlen, dim) tensors seen as (batch, seqlen, heads, dim): how transformers passes them
    qt, kt, vt = (torch.randn(b, h, s, d, device=DEVICE).to(dtype).transpose(1, 2) for _ in range(3))
    out = flare.flash_attn_func(qt, kt, vt, causal=True)
    inputs = {"q": qt, "k": kt, "v": vt, "dout": dout, "slopes": None}
    ref, naive = reference(case, inputs, backward=False), reference(case, inputs, dtype, backward=False)
    check_close("out (head-major strides)", out, ref["out"], naive["out"], dtype)

    # kv packed, GQA
    case = case.with_(nheads_k=2, causal=False)
    qq = torch.randn(b, s, h, d, device=DEVICE).to(dtype)
    kv = torch.randn(b, s, 2, 2, d, device=DEVICE).to(dtype)
    out = flare.flash_attn_kvpacked_func(qq, kv)
    inputs = {"q": qq, "k": kv[:, :, 0], "v": kv[:, :, 1], "dout": dout, "slopes": None}
    ref, naive = reference(case, inputs, backward=False), reference(case, inputs, dtype, backward=False)
    check_close("out (kvpacked)", out, ref["out"], naive["out"], dtype)


def test_forward_only_inference_mode():
    case = Case(dtype=torch.bfloat16, batch=2, seqlen_q=113 if not SMALL else 13, seqlen_k=203 if not SMALL else 29,
                nheads=6, nheads_k=2, headdim=128 if not SMALL else 64, causal=True)
    inputs = make_inputs(case)
    with torch.inference_mode():
        out = flare.flash_attn_func(inputs["q"], inputs["k"], inputs["v"], causal=True)
    ref, naive = reference(case, inputs, backward=False), reference(case, inputs, case.dtype, backward=False)
    check_close("out", out, ref["out"], naive["out"], case.dtype)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_sinks(dtype, causal, varlen):
    # Learnable sinks: the forward epilogues fold them in (out, lse); dq/dk/dv come through the lse and dsinks
    # from out and lse (flare.ops.sink_gradient). Rows without keys (29 queries on 13 keys, causal) get the sink.
    for index, (sq, sk) in enumerate(FEATURE_SEQLENS):
        nheads, nheads_k = heads_cycle(index)
        case = Case(dtype=dtype, batch=2, seqlen_q=sq, seqlen_k=sk, nheads=nheads, nheads_k=nheads_k,
                    headdim=FEATURE_HEADDIMS[index % len(FEATURE_HEADDIMS)], causal=causal, sinks=True)
        if varlen:
            case = case.with_(seqlens_q=[sq, 0, max(sq // 2, 1)], seqlens_k=[sk, 5, sk])
        check_case(case)


def _dropout_fwd(q, k, v, causal, p, seed, offset):
    from flare import ops
    return ops.fwd(q, k, v, None, None, None, 0, 0, None, 0.0, causal, -1, -1, 0.0, False, "auto", None, None,
                   p, seed, offset)


# (keys, headdim_v): 70 keys in a head dim of 72; 300 keys in 320 (tile 384: two output slices of 192 columns,
# each CTA drawing the mask of its own columns).
DROPOUT_MASK_SHAPES = [(70, 72), (300, 320)] if not SMALL else [(70, 72), (30, 32)]


@pytest.mark.parametrize("shape", DROPOUT_MASK_SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_dropout_mask_is_the_cpu_mask(dtype, shape):
    # Values = the identity (one column per key): out[i][j] = P_ij z_ij, zero exactly where dropped. The device's
    # zeros must be flare_dropout_mask's (the CPU backend's) bit for bit, for any seed and offset.
    from flare import ops
    b, sq, h, p = 2, 37, 3, 0.3
    sk, dv = shape  # sk columns of the identity, zero-padded to a head dim CUDA takes (a multiple of 8)
    seed, offset = -0x21524110DEADBEEF, 2**33 + 7
    q = torch.randn(b, sq, h, 64, device=DEVICE).to(dtype)
    k = torch.randn(b, sk, 1, 64, device=DEVICE).to(dtype)
    eye = torch.zeros(b, sk, 1, dv, device=DEVICE, dtype=dtype)
    eye[:, :, 0, :sk] = torch.eye(sk, device=DEVICE).to(dtype)
    if sm90_forced():
        expect_sm90_refusal(lambda: _dropout_fwd(q, k, eye, False, p, seed, offset), "[dropout]")
        return
    out, _ = _dropout_fwd(q, k, eye, False, p, seed, offset)
    kept = (out[..., :sk] != 0).permute(0, 2, 1, 3).cpu()
    for i in range(b):
        assert torch.equal(kept[i], ops.dropout_mask(p, seed, offset, i, h, sq, sk))


@pytest.mark.parametrize("d", [64, 320] if not SMALL else [64], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_dropout_matches_the_cpu_backend(dtype, causal, d):
    # Same seed and offset on the device and on the CPU: the same mask, so the same outputs and gradients up to
    # rounding. The reference is the CPU backend in fp32 on the same (rounded) inputs; the same-dtype model of
    # the rule is the CPU backend in the dtype itself (P and the outputs rounded to it). Head dim 320 runs the
    # wide kernels (tile 384): two column slices, each drawing the mask of the same scores.
    b, sq, sk, h, hk, p = 2, 113 if not SMALL else 13, 203 if not SMALL else 29, 6, 2, 0.2
    seed, offset = 1234567, 89
    q, k, v = (torch.randn(b, n, heads, d, device=DEVICE).to(dtype).requires_grad_(True)
               for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d, device=DEVICE).to(dtype)
    if sm90_forced():
        expect_sm90_refusal(lambda: _dropout_fwd(q, k, v, causal, p, seed, offset), "[dropout]")
        return
    out, _ = _dropout_fwd(q, k, v, causal, p, seed, offset)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    results = {}
    for name, compute in (("ref", torch.float32), ("naive", dtype)):
        cq, ck, cv = (t.detach().cpu().to(compute).requires_grad_(True) for t in (q, k, v))
        o, _ = _dropout_fwd(cq, ck, cv, causal, p, seed, offset)
        results[name] = (o,) + torch.autograd.grad(o, (cq, ck, cv), dout.cpu().to(compute))
    for index, name in enumerate(("out", "dq", "dk", "dv")):
        got = (out,) + grads
        check_close(name, got[index].detach().cpu().float(), results["ref"][index].detach().float(),
                    results["naive"][index].detach().float(), dtype, f"[dropout {p}, causal {causal}]")