"""flare on CUDA tensors as a runtime citizen: outputs fully written (NaN-poisoned buffers through the C ABI),
the deterministic backward bitwise stable over 50 runs, opcheck, torch.compile(fullgraph=True), CUDA-graph
capture and replay, the caller's stream, device placement errors, and clear errors for what the CUDA path
does not take. Values are checked with attention_reference.py's rule.
"""

import math
import os

import pytest
import torch

import flare
from flare import _capi, ops
from attention_reference import check_close, check_lse
from cases import (DEVICE, SMALL, Case, check_case, make_inputs, reference, require_cuda_backend, run_flare,
                   skip_module_without_device)

skip_module_without_device()

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")


@pytest.fixture(autouse=True)
def _sm90_where_claimed(monkeypatch):
    """These tests mix varlen, odd head dims and dense calls in one test: with the sm90 path forced they run on
    auto, which takes sm90 for every call it claims and sm80 for the rest (a forced sm90 would refuse those)."""
    if os.environ.get("FLARE_CUDA_ARCH_PATH") == "sm90":
        monkeypatch.setenv("FLARE_CUDA_ARCH_PATH", "auto")


@pytest.fixture(scope="module", autouse=True)
def _backend():
    require_cuda_backend()


def _scalars(case, inputs):
    """The arguments of ops.fwd / ops.bwd after the tensors, in order."""
    varlen = case.varlen
    return ((inputs["cu_seqlens_q"] if varlen else None), (inputs["cu_seqlens_k"] if varlen else None),
            (inputs["seqused_k"] if varlen else None),
            max(max(case.seqlens_q), 1) if varlen else 0, max(max(case.seqlens_k), 1) if varlen else 0,
            inputs["slopes"], case.softmax_scale or 0.0, case.causal,
            case.window[0], case.window[1], case.softcap, case.deterministic)


# ---- outputs fully written: the C ABI on NaN-poisoned, padded buffers ----------------------------------------

PAD, GUARD = 8, 64  # padding after each row of an output view, and poison before and after the whole buffer


def poisoned(shape, dtype):
    """A view of `shape` (last dim contiguous, rows padded by PAD) inside a NaN buffer with GUARD elements on
    either side. Returns (view, buffer)."""
    rows = math.prod(shape[:-1])
    buf = torch.full((2 * GUARD + rows * (shape[-1] + PAD),), float("nan"), dtype=dtype, device=DEVICE)
    view = buf[GUARD:GUARD + rows * (shape[-1] + PAD)].view(*shape[:-1], shape[-1] + PAD)[..., :shape[-1]]
    return view, buf


def assert_fully_written(name, view, buf, allow_neginf=False):
    """Every element of the view written (no NaN left), nothing else in the buffer touched."""
    not_written = int(torch.isnan(view).sum())
    assert not_written == 0, f"{name}: {not_written} of {view.numel()} elements still NaN (not written)"
    if not allow_neginf:
        assert bool(torch.isfinite(view).all()), f"{name}: inf values"
    touched = (buf.numel() - int(torch.isnan(buf).sum())) - view.numel()
    assert touched == 0, f"{name}: {touched} elements outside the view were written (padding or guards)"


def abi_fwd(case, inputs, out, lse):
    lib = _capi.library()
    tv = _capi.tensor_view
    cu_q, cu_k, used, max_q, max_k, slopes, scale, causal, left, right, softcap, _ = _scalars(case, inputs)
    p = lib.fwd_params()
    p.q, p.k, p.v = (tv(inputs[n].detach()) for n in ("q", "k", "v"))
    p.out, p.softmax_lse = tv(out), tv(lse)
    p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k = tv(cu_q), tv(cu_k), tv(used)
    p.max_seqlen_q, p.max_seqlen_k = max_q, max_k
    p.attn, keep = ops._attn_options(inputs["q"], scale, causal, left, right, softcap, slopes)
    entry = lib.fwd_varlen if case.varlen else lib.fwd
    nbytes = ops._validate(inputs["q"], entry, lambda p: lib.fwd_workspace_size(p, case.varlen), p)
    ops._run(inputs["q"], entry, nbytes, p)
    del keep


def abi_bwd(case, inputs, out, lse, dq, dk, dv):
    lib = _capi.library()
    tv = _capi.tensor_view
    cu_q, cu_k, used, max_q, max_k, slopes, scale, causal, left, right, softcap, det = _scalars(case, inputs)
    p = lib.bwd_params()
    p.q, p.k, p.v = (tv(inputs[n].detach()) for n in ("q", "k", "v"))
    p.out, p.dout, p.softmax_lse = tv(out), tv(inputs["dout"]), tv(lse)
    p.dq, p.dk, p.dv = tv(dq), tv(dk), tv(dv)
    p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k = tv(cu_q), tv(cu_k), tv(used)
    p.max_seqlen_q, p.max_seqlen_k = max_q, max_k
    p.deterministic = int(det)
    p.attn, keep = ops._attn_options(inputs["q"], scale, causal, left, right, softcap, slopes)
    entry = lib.bwd_varlen if case.varlen else lib.bwd
    nbytes = ops._validate(inputs["q"], entry, lambda p: lib.bwd_workspace_size(p, case.varlen), p)
    ops._run(inputs["q"], entry, nbytes, p)
    del keep


POISON_CASES = {
    # seqlen_q > seqlen_k, causal: the first rows see no key (out 0, lse -inf, dq 0)
    "dense-causal-masked-rows": Case(batch=2, seqlen_q=203 if not SMALL else 29, seqlen_k=113 if not SMALL else 13,
                                     nheads=6, nheads_k=2, headdim=128 if not SMALL else 64, causal=True),
    "dense-window-hd-v": Case(batch=2, seqlen_q=130, seqlen_k=77, nheads=4, nheads_k=1,
                              headdim=192 if not SMALL else 40, headdim_v=128 if not SMALL else 24, window=(9, 3)),
    "dense-odd-hd": Case(dtype=torch.float16, batch=3, seqlen_q=1, seqlen_k=17, nheads=2, nheads_k=2, headdim=40),
    # empty query range, empty key range (fully masked rows), keys past seqused_k (dk = dv = 0)
    "varlen-empty-seqused": Case(seqlens_q=[5, 0, 70, 33, 1], seqlens_k=[9, 4, 0, 65, 40],
                                 seqused_k=[9, 4, 0, 20, 0], nheads=4, nheads_k=2,
                                 headdim=256 if not SMALL else 64, causal=True),
    "varlen-softcap-alibi": Case(dtype=torch.float16, seqlens_q=[17, 113 if not SMALL else 23, 3],
                                 seqlens_k=[17, 203 if not SMALL else 31, 0], nheads=4, nheads_k=4, headdim=64,
                                 softcap=10.0, alibi="batch"),
}


@pytest.mark.parametrize("name", list(POISON_CASES))
def test_poisoned_outputs_are_fully_written(name):
    case = POISON_CASES[name]
    inputs = make_inputs(case)
    out, out_buf = poisoned(tuple(inputs["dout"].shape), case.dtype)
    lse_shape = ((case.nheads, sum(case.seqlens_q)) if case.varlen else (case.batch, case.nheads, case.seqlen_q))
    lse, lse_buf = poisoned(lse_shape, torch.float32)
    abi_fwd(case, inputs, out, lse)
    assert_fully_written("out", out, out_buf)
    assert_fully_written("softmax_lse", lse, lse_buf, allow_neginf=True)
    ref, naive = reference(case, inputs), reference(case, inputs, case.dtype)
    context = f"[{case.describe()}]"
    check_close("out", out, ref["out"], naive["out"], case.dtype, context)
    check_lse(lse, ref["lse"], naive["lse"] if case.softcap else None, context)
    masked = torch.isneginf(ref["lse"])  # rows with no visible key: out exactly 0
    out_rows = out.float().abs().sum(-1)  # (b, sq, h) or (total_q, h)
    out_rows = out_rows.transpose(-1, -2) if not case.varlen else out_rows.t()
    assert bool((out_rows[masked] == 0).all()), f"rows with no visible key must be 0 {context}"

    grads = {n: poisoned(tuple(inputs[n[1]].shape), case.dtype) for n in ("dq", "dk", "dv")}
    abi_bwd(case, inputs, out, lse, grads["dq"][0], grads["dk"][0], grads["dv"][0])
    for n, (view, buf) in grads.items():
        assert_fully_written(n, view, buf)
        check_close(n, view, ref[n], naive[n], case.dtype, context)
    if case.varlen and case.seqused_k is not None:  # keys past seqused_k: gradient exactly 0
        for b, (start, used) in enumerate(zip(inputs["cu_seqlens_k"].tolist()[:-1], case.seqused_k)):
            for n in ("dk", "dv"):
                tail = grads[n][0][start + used:start + case.seqlens_k[b]]
                assert bool((tail == 0).all()), f"{n} of keys past seqused_k[{b}] must be 0 {context}"


def test_forward_without_lse():
    case = Case(batch=2, seqlen_q=97, seqlen_k=97, nheads=4, nheads_k=4, headdim=64, causal=True)
    inputs = make_inputs(case)
    out, out_buf = poisoned(tuple(inputs["dout"].shape), case.dtype)
    abi_fwd(case, inputs, out, None)  # softmax_lse is optional
    assert_fully_written("out", out, out_buf)
    ref, naive = reference(case, inputs, backward=False), reference(case, inputs, case.dtype, backward=False)
    check_close("out", out, ref["out"], naive["out"], case.dtype)


# ---- deterministic backward: 50 runs, bitwise equal ----------------------------------------------------------

DET_CASES = {
    "gqa-causal": Case(batch=2, seqlen_q=1023 if not SMALL else 40, seqlen_k=1024 if not SMALL else 41,
                       nheads=8, nheads_k=2, headdim=128 if not SMALL else 64, causal=True, deterministic=True),
    "mqa-hd256": Case(batch=1, seqlen_q=777 if not SMALL else 33, seqlen_k=1500 if not SMALL else 47, nheads=8,
                      nheads_k=1, headdim=256 if not SMALL else 32, deterministic=True),
    "fp16-window-softcap": Case(dtype=torch.float16, batch=2, seqlen_q=600 if not SMALL else 30,
                                seqlen_k=600 if not SMALL else 30, nheads=4, nheads_k=4, headdim=64,
                                window=(64, 0), softcap=20.0, deterministic=True),
    # Past backward_short's seqlen_q (512) head dim 64's backward computes dQ in column slices (configs.cuh).
    "hd64-long-gqa": Case(batch=1, seqlen_q=1100 if not SMALL else 45, seqlen_k=1100 if not SMALL else 45, nheads=4,
                          nheads_k=2, headdim=64, deterministic=True),
    "varlen": Case(seqlens_q=[300, 0, 1000, 17] if not SMALL else [30, 0, 41, 7],
                   seqlens_k=[900, 5, 1000, 1] if not SMALL else [50, 5, 41, 1], nheads=8, nheads_k=2, headdim=128,
                   causal=True, deterministic=True),
}


@pytest.mark.parametrize("name", list(DET_CASES))
def test_deterministic_backward_is_bitwise_stable(name):
    case = DET_CASES[name]
    inputs, _ = check_case(case)  # correct first (through autograd with deterministic=True)
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    scalars = _scalars(case, inputs)
    out, lse = ops.fwd(q, k, v, *scalars)
    first = ops.bwd(inputs["dout"], q, k, v, out, lse, *scalars)
    runs = 50 if not SMALL else 5
    for run in range(1, runs):
        again = ops.bwd(inputs["dout"], q, k, v, out, lse, *scalars)
        for n, a, b in zip(("dq", "dk", "dv"), first, again):
            if not torch.equal(a, b):
                diff = (a.float() - b.float()).abs()
                raise AssertionError(f"{n} of run {run + 1} differs from run 1 in {int((diff > 0).sum())} elements "
                                     f"(max {diff.max().item():.3e}) [{case.describe()}]")


# ---- opcheck, torch.compile, CUDA graphs ---------------------------------------------------------------------


def test_opcheck():
    dense = Case(batch=2, seqlen_q=77, seqlen_k=130, nheads=4, nheads_k=2, headdim=64, causal=True, alibi="head")
    varlen = Case(seqlens_q=[7, 0, 30], seqlens_k=[20, 3, 30], seqused_k=[15, 3, 30], nheads=4, nheads_k=1,
                  headdim=128 if not SMALL else 32, window=(8, 8), softcap=5.0)
    for case in (dense, varlen):
        inputs = make_inputs(case)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        scalars = _scalars(case, inputs)
        torch.library.opcheck(ops.fwd, (q, k, v, *scalars))
        out, lse = ops.fwd(q.detach(), k.detach(), v.detach(), *scalars)
        torch.library.opcheck(ops.bwd, (inputs["dout"], q.detach(), k.detach(), v.detach(), out, lse, *scalars))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torch_compile_fullgraph(dynamic):
    # inductor on CUDA; on the CPU (the harness check) aot_eager keeps it to seconds on a small machine
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"

    def step(q, k, v, cu, max_len):
        dense = flare.flash_attn_func(q, k, v, causal=True, window_size=(48, 0), softcap=25.0)
        packed = flare.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                              max_len, max_len, causal=True)
        return dense.float().square().sum() + packed.float().sin().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=backend)
    for seqlen in ((96, 160) if dynamic else (96,)):
        case = Case(batch=2, seqlen_q=seqlen, seqlen_k=seqlen, nheads=4, nheads_k=2, headdim=64)
        inputs = make_inputs(case)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32, device=DEVICE)
        compiled(q, k, v, cu, seqlen).backward()
        mine = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        step(q, k, v, cu, seqlen).backward()
        for n, a, b in zip(("dq", "dk", "dv"), mine, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=lambda m: f"{n}, seqlen {seqlen}: {m}")


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_cuda_graph_capture_and_replay(layout, deterministic):
    if layout == "dense":
        case = Case(batch=2, seqlen_q=257, seqlen_k=513, nheads=8, nheads_k=2, headdim=128, causal=True,
                    deterministic=deterministic)
    else:
        case = Case(seqlens_q=[100, 0, 257], seqlens_k=[300, 9, 257], nheads=8, nheads_k=2, headdim=128,
                    causal=True, deterministic=deterministic)
    inputs = make_inputs(case)  # static buffers: replays read whatever they hold
    leaves = [inputs[n] for n in ("q", "k", "v")]

    def step():
        out, lse, grads = run_flare(case, inputs, backward=False)
        return (out, lse) + torch.autograd.grad(out, leaves, inputs["dout"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    for trial in range(3):
        with torch.no_grad():
            for n in ("q", "k", "v", "dout"):
                inputs[n].copy_(torch.randn(inputs[n].shape, device=DEVICE).to(case.dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref, naive = reference(case, inputs), reference(case, inputs, case.dtype)
        context = f"[graph replay {trial}, {case.describe()}]"
        check_close("out", static[0].detach(), ref["out"], naive["out"], case.dtype, context)
        check_lse(static[1], ref["lse"], None, context)
        for n, got in zip(("dq", "dk", "dv"), static[2:]):
            check_close(n, got, ref[n], naive[n], case.dtype, context)
        if deterministic:  # the replay computes exactly what an eager call does
            eager = step()
            for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), static, eager):
                assert torch.equal(a, b), f"{n}: graph replay differs from the eager call {context}"


# ---- streams and devices -------------------------------------------------------------------------------------


@cuda_only
def test_runs_on_the_callers_stream():
    """Inputs are rewritten on a side stream behind a long sleep; flare called on that stream must see the new
    values (a call on another stream would race ahead and read the old ones)."""
    case = Case(batch=2, seqlen_q=512, seqlen_k=512, nheads=8, nheads_k=2, headdim=128, causal=True)
    inputs = make_inputs(case)
    fresh = {n: torch.randn(inputs[n].shape, device=DEVICE).to(case.dtype) for n in ("q", "k", "v", "dout")}
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream
        with torch.no_grad():
            for n, t in fresh.items():
                inputs[n].copy_(t)
        out, lse, grads = run_flare(case, inputs)
    side.synchronize()
    ref, naive = reference(case, inputs), reference(case, inputs, case.dtype)
    check_close("out", out.detach(), ref["out"], naive["out"], case.dtype, "[side stream]")
    for n, got in zip(("dq", "dk", "dv"), grads):
        check_close(n, got, ref[n], naive[n], case.dtype, "[side stream]")


@cuda_only
def test_device_mix_is_a_clear_error():
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match="(?i)device|cpu|cuda"):
        flare.flash_attn_func(q, kc, kc)
    with pytest.raises((ValueError, RuntimeError), match="(?i)device|cpu|cuda"):
        flare.flash_attn_func(q.cpu(), q, q)
    # varlen index tensors on the host: accepted and correct, or a clear error
    qv = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    try:
        out = flare.flash_attn_varlen_func(qv, qv, qv, cu, cu, 9, 9)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        assert "cu_seqlens" in str(e) or "device" in str(e).lower(), f"unclear error: {e}"
    else:
        expected = flare.flash_attn_varlen_func(qv, qv, qv, cu.cuda(), cu.cuda(), 9, 9)
        torch.testing.assert_close(out, expected)


@cuda_only
@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_device_than_the_current_one():
    case = Case(batch=2, seqlen_q=200, seqlen_k=300, nheads=4, nheads_k=2, headdim=128, causal=True)
    with torch.cuda.device(0):
        check_case(case, device="cuda:1")


# ---- what the CUDA path does not take: a clear error or a correct answer, never garbage -----------------------


@cuda_only
@pytest.mark.parametrize("headdim", [36, 584], ids=["d36", "d584"])
def test_unsupported_head_dims(headdim):
    case = Case(batch=1, seqlen_q=64, seqlen_k=64, nheads=2, nheads_k=2, headdim=headdim, causal=True)
    try:
        check_case(case)
    except (ValueError, NotImplementedError) as e:
        assert "headdim" in str(e) or "head dim" in str(e), f"the error should name the head dim: {e}"


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_other_dtypes(dtype):
    q = torch.randn(1, 33, 2, 64, device="cuda", dtype=dtype)
    try:
        out = flare.flash_attn_func(q, q, q, causal=True)
    except (ValueError, NotImplementedError) as e:
        assert "FLARE_UNSUPPORTED" in str(e) or "dtype" in str(e), f"unclear error: {e}"
    else:
        ref = reference(Case(dtype=dtype, batch=1, seqlen_q=33, seqlen_k=33, nheads=2, headdim=64, causal=True),
                        {"q": q, "k": q, "v": q, "dout": None, "slopes": None}, backward=False)
        torch.testing.assert_close(out.float(), ref["out"].float(), rtol=1e-4, atol=1e-4)



@cuda_only
def test_backward_workspace_rules():
    """The backward's caller workspace: too small -> FLARE_OUT_OF_MEMORY naming both sizes; not 256-byte
    aligned -> FLARE_INVALID_ARGUMENT; NULL -> flare's own stream-ordered allocation, same result. Nothing
    written on failure."""
    case = Case(batch=2, seqlen_q=77, seqlen_k=130, nheads=4, nheads_k=2, headdim=64, causal=True)
    inputs = make_inputs(case)
    out, lse, _ = run_flare(case, inputs, backward=False)
    lib = _capi.library()
    tv = _capi.tensor_view

    def params(dq, dk, dv):
        p = lib.bwd_params()
        p.q, p.k, p.v = (tv(inputs[n].detach()) for n in ("q", "k", "v"))
        p.out, p.dout, p.softmax_lse = tv(out.detach()), tv(inputs["dout"]), tv(lse)
        p.dq, p.dk, p.dv = tv(dq), tv(dk), tv(dv)
        p.attn, keep = ops._attn_options(inputs["q"], 0.0, True, -1, -1, 0.0, None)
        p.exec = ops._exec_options(inputs["q"])
        return p, keep

    grads = [torch.full_like(inputs[n], float("nan")) for n in ("q", "k", "v")]
    p, keep = params(*grads)
    need = lib.bwd_workspace_size(p, False)
    assert need > 0
    ws = torch.empty(need + 512, dtype=torch.uint8, device="cuda")
    p.exec.workspace, p.exec.workspace_size = ws.data_ptr(), need - 1
    with pytest.raises(MemoryError, match=str(need)):
        lib.bwd(p)
    p.exec.workspace, p.exec.workspace_size = ws.data_ptr() + 4, need
    with pytest.raises(ValueError, match="256-byte aligned"):
        lib.bwd(p)
    torch.cuda.synchronize()
    assert all(bool(torch.isnan(g).all()) for g in grads), "a failed call wrote gradients"

    p.exec.workspace, p.exec.workspace_size = ws.data_ptr(), need
    lib.bwd(p)
    with_ws = [g.clone() for g in grads]
    fresh = [torch.full_like(g, float("nan")) for g in grads]
    p2, keep2 = params(*fresh)
    lib.bwd(p2)  # NULL workspace: flare allocates
    torch.cuda.synchronize()
    for a, b in zip(with_ws, fresh):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    del keep, keep2
