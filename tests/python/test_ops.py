"""The torch custom ops flare::fwd / flare::bwd: values against the fp64 reference, gradcheck, opcheck,
torch.compile(fullgraph=True), and errors from the C ABI as Python exceptions."""

import pytest
import torch

import flare
from flare import ops
from conftest import assert_close_ref, reference_attention


def fwd(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=0.0, deterministic=False):
    return ops.fwd(q, k, v, None, None, None, 0, 0, alibi, scale, causal, window[0], window[1], softcap,
                   deterministic)


def rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window, softcap, alibi)
    (2, 113, 203, 4, 2, 64, True, (-1, -1), 0.0, False),
    (1, 128, 128, 4, 4, 32, False, (-1, -1), 0.0, False),
    (2, 77, 77, 6, 2, 40, True, (16, -1), 0.0, False),
    (1, 33, 61, 2, 1, 64, False, (8, 4), 30.0, False),
    (2, 50, 50, 4, 4, 16, True, (-1, -1), 0.0, True),
    (1, 80, 17, 2, 2, 32, True, (-1, -1), 0.0, False),  # seqlen_q > seqlen_k: first rows see no key
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_forward_backward_match_reference(case, dtype):
    b, sq, sk, h, hk, d, causal, window, softcap, use_alibi = case
    q, k, v = rand(b, sq, h, d, dtype=dtype, grad=True), rand(b, sk, hk, d, dtype=dtype, grad=True), \
        rand(b, sk, hk, d, dtype=dtype, grad=True)
    alibi = torch.rand(h) if use_alibi else None
    out, lse = fwd(q, k, v, causal, window, softcap, alibi)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(q64, k64, v64, causal, window, softcap, alibi)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert_close_ref(out, ref, dtype)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)
    assert torch.all(torch.isneginf(lse[~finite]))  # rows with no visible key: lse = -inf, out = 0
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    scale = 4 if dtype == torch.bfloat16 else 1  # gradients accumulate more rounding than the forward
    for mine, theirs in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        atol = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype] * scale
        torch.testing.assert_close(mine.double(), theirs, atol=atol, rtol=atol)


def test_strided_inputs():
    # q/k/v as slices of one packed tensor (non-contiguous, last dim contiguous): views, no copy needed
    qkv = rand(2, 64, 3, 4, 32)
    q, k, v = qkv.unbind(2)
    out, _ = fwd(q, k, v, causal=True)
    ref, _ = reference_attention(q, k, v, causal=True)
    assert_close_ref(out, ref, torch.float32)
    # last dim not contiguous: the op copies
    qt = rand(2, 64, 32, 4).transpose(-1, -2)
    out, _ = fwd(qt, k, v)
    assert_close_ref(out, reference_attention(qt, k, v)[0], torch.float32)


@pytest.mark.parametrize("causal,window,softcap,alibi", [
    (False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, False), (True, (5, -1), 20.0, True)])
def test_gradcheck_fp64(causal, window, softcap, alibi):
    # fp64 on the CPU is computed in fp64, but softmax_lse is stored in fp32 (the ABI's contract), and the
    # backward recomputes P = exp(s - lse) from it: the analytic gradient carries a relative error of about
    # 1e-7 (fp32's epsilon), far above fp64 rounding. Hence atol=1e-5, rtol=1e-3 rather than gradcheck's
    # defaults (1e-5 / 1e-3 would also flag a wrong mask or scale, which errs by O(1)).
    q, k, v = rand(1, 9, 4, 8, dtype=torch.float64, grad=True), rand(1, 13, 2, 8, dtype=torch.float64, grad=True), \
        rand(1, 13, 2, 8, dtype=torch.float64, grad=True)
    slopes = torch.rand(4) if alibi else None
    f = lambda q, k, v: fwd(q, k, v, causal, window, softcap, slopes)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), atol=1e-5, rtol=1e-3)


def test_gradcheck_varlen_fp64():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (rand(12, 2, 8, dtype=torch.float64, grad=True) for _ in range(3))
    f = lambda q, k, v: ops.fwd(q, k, v, cu, cu, None, 7, 7, None, 0.0, True, -1, -1, 0.0, False)[0]  # noqa
    assert torch.autograd.gradcheck(f, (q, k, v), atol=1e-5, rtol=1e-3)


def test_opcheck():
    q, k, v = rand(2, 17, 4, 16, grad=True), rand(2, 23, 2, 16, grad=True), rand(2, 23, 2, 16, grad=True)
    torch.library.opcheck(ops.fwd, (q, k, v, None, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0, False))
    out, lse = fwd(q, k, v, causal=True)
    dout = torch.randn_like(out)
    q, k, v = q.detach(), k.detach(), v.detach()  # flare::bwd has no derivative of its own
    torch.library.opcheck(ops.bwd, (dout, q, k, v, out.detach(), lse, None, None, None, 0, 0, None, 0.0, True,
                                    -1, -1, 0.0, False))
    cu = torch.tensor([0, 7, 17], dtype=torch.int32)
    qv, kv, vv = rand(17, 4, 16, grad=True), rand(17, 2, 16, grad=True), rand(17, 2, 16, grad=True)
    torch.library.opcheck(ops.fwd, (qv, kv, vv, cu, cu, None, 10, 10, None, 0.0, True, -1, -1, 0.0, False))
    torch.library.opcheck(ops.fwd, (q, k, v, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False, "sm80"))
    kc, vc = rand(2, 32, 2, 16), rand(2, 32, 2, 16)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    torch.library.opcheck(ops.fwd_kvcache, (rand(2, 1, 4, 16), kc, vc, rand(2, 1, 2, 16), rand(2, 1, 2, 16),
                                            seqlens, None, None, None, None, None, True, 0, None, 0.0, True,
                                            -1, -1, 0.0))


def test_torch_compile_fullgraph():
    def step(q, k, v):
        out = flare.flash_attn_func(q, k, v, causal=True, window_size=(32, 0))
        return (out * out).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q, k, v = rand(2, 40, 4, 32, grad=True), rand(2, 40, 2, 32, grad=True), rand(2, 40, 2, 32, grad=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    step(q, k, v).backward()
    for mine, eager in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, eager)


def test_torch_compile_inductor_forward():
    f = torch.compile(lambda q, k, v: flare.flash_attn_func(q, k, v, causal=True) + 1.0, fullgraph=True)
    q, k, v = rand(1, 24, 2, 16), rand(1, 24, 2, 16), rand(1, 24, 2, 16)
    torch.testing.assert_close(f(q, k, v), flare.flash_attn_func(q, k, v, causal=True) + 1.0)


def test_errors_carry_the_library_message():
    q, k = rand(1, 8, 6, 16), rand(1, 8, 4, 16)
    with pytest.raises(ValueError, match="heads"):
        fwd(q, k, k)
    with pytest.raises(ValueError, match="FLARE_INVALID_ARGUMENT"):
        fwd(rand(1, 8, 2, 16), rand(1, 8, 2, 16), rand(1, 8, 2, 16), window=(-3, -1))
    with pytest.raises(ValueError, match="dtype"):
        fwd(q.half(), k.float(), k.float())
    e4m3 = rand(1, 8, 2, 16).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="FLARE_UNSUPPORTED"):  # valid, but not on the CPU
        fwd(e4m3, e4m3, e4m3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        bad = torch.tensor([0, 9], dtype=torch.int32)
        ops.fwd(q[0], q[0], q[0], bad, bad, None, 9, 9, None, 0.0, False, -1, -1, 0.0, False)


def test_introspection():
    assert flare.version() == "0.1.0"
    assert flare.cpu_isa() in ("amx", "avx512bf16", "avx512", "avx2", "generic")
    assert flare.has_cuda() in (True, False)


def _bwd_params(shape_q, deterministic=False, stream=0):
    """bwd params over fresh tensors of the given query shape (keys like queries)."""
    lib = flare.library()
    tv = _capi_tensor_view
    q, k, v, out, dout = (torch.randn(shape_q) for _ in range(5))
    lse = torch.randn(shape_q[0], shape_q[2], shape_q[1])
    dq, dk, dv = torch.empty(shape_q), torch.empty(shape_q), torch.empty(shape_q)
    p = lib.bwd_params()
    p.q, p.k, p.v, p.out, p.dout, p.softmax_lse = tv(q), tv(k), tv(v), tv(out), tv(dout), tv(lse)
    p.dq, p.dk, p.dv = tv(dq), tv(dk), tv(dv)
    p.deterministic = int(deterministic)
    p.exec.stream = stream
    return p, (q, k, v, out, dout, lse, dq, dk, dv)


def _capi_tensor_view(t):
    from flare import _capi
    return _capi.tensor_view(t)


def test_problem_key_ignores_data_and_stream_only():
    from flare import _capi
    a, keep_a = _bwd_params((2, 16, 4, 32))
    b, keep_b = _bwd_params((2, 16, 4, 32), stream=1234)  # other tensors, another stream: the same problem
    assert a.q.data != b.q.data and _capi.problem_key(a) == _capi.problem_key(b)
    c, keep_c = _bwd_params((2, 17, 4, 32))
    d, keep_d = _bwd_params((2, 16, 4, 32), deterministic=True)
    assert len({_capi.problem_key(p) for p in (a, c, d)}) == 3


def test_workspace_query_once_per_problem(monkeypatch):
    """ops._run asks flare for a CUDA call's workspace size once per problem: the query validates as the call
    does, so asking it every time validated every call twice."""
    monkeypatch.setattr(ops, "_workspace_sizes", {})
    asked = []

    def query(p):
        asked.append(p)
        return 4096

    def entry(p):
        pass

    first, keep1 = _bwd_params((1, 8, 2, 16))
    again, keep2 = _bwd_params((1, 8, 2, 16))
    other, keep3 = _bwd_params((1, 9, 2, 16))
    assert [ops._workspace_bytes(p, entry, query) for p in (first, again, other, again)] == [4096] * 4
    assert asked == [first, other]
