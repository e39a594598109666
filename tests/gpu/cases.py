"""One attention case of the GPU suite, end to end: fresh random inputs on the test device, flare's forward
and backward through the flash_attn-compatible functions (python/flare/flash_attn_interface.py), and every
result (out, softmax_lse, dq, dk, dv) checked against attention_reference.py by its rule.

Shared by the pytest modules and tests/gpu/sanitize.py. The device and the size of the case lists come from
FLARE_TEST_DEVICE / FLARE_TEST_SIZE (conftest.py sets them from --device / --size).
"""

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from attention_reference import AttnOptions, check_close, check_lse, dense_attention, varlen_attention

DEVICE = os.environ.get("FLARE_TEST_DEVICE", "cuda")
SMALL = os.environ.get("FLARE_TEST_SIZE", "full" if DEVICE == "cuda" else "small") == "small"



def arch_path():
    """The CUDA forward path forced now (conftest.py's --arch-path sets it; a test may change it with monkeypatch):
    auto, sm80 or sm90. Read at each call, as the library reads it at each forward."""
    return os.environ.get("FLARE_CUDA_ARCH_PATH", "auto")


def sm90_forced(device=None):
    """Whether the sm90 forward is forced on a CUDA run: then it runs what it claims and refuses the rest."""
    return (device or DEVICE) == "cuda" and arch_path() == "sm90"


def expect_sm90_refusal(run, context=""):
    """With the sm90 path forced, a call it does not claim must be refused with a message that names the sm90 path
    (or, for a head dim no path takes, the head dim)."""
    try:
        run()
    except NotImplementedError as e:
        message = str(e)
        assert "sm90" in message or "head dim" in message or "headdim" in message, \
            f"refused, but the message names neither the sm90 path nor the head dim: {e} {context}"
        return
    raise AssertionError(f"the sm90 path was forced and does not claim this call, yet it ran {context}")

# What the sm90 forward claims (src/cuda/heuristics.cpp's rule, stated here independently): fp16/bf16, dense or
# varlen (with or without seqused_k) but not paged, equal head dims of these sizes or head dims 192 / 128
# (SM90_HEADDIM_PAIRS). Everything else must be refused when sm90 is forced.
SM90_HEADDIMS = (64, 96, 128, 192, 256)
SM90_HEADDIM_PAIRS = ((192, 128),)

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def skip_module_without_device():
    """Module-level: skip the whole module when it is meant for CUDA and there is no CUDA device."""
    import pytest
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (pass --device cpu to run the suite against the CPU backend)",
                    allow_module_level=True)


def require_cuda_backend():
    """On CUDA, a library without a CUDA backend is a failure of the run, not a reason to skip."""
    import flare
    if DEVICE == "cuda" and not flare.has_cuda():
        raise AssertionError(f"{flare.library().path} has no CUDA backend (flare_has_cuda() == 0): build with "
                             "-DFLARE_ENABLE_CUDA=ON (the cuda preset) and point FLARE_LIBRARY at it")


@dataclass
class Case:
    dtype: torch.dtype = torch.bfloat16
    batch: int = 2
    seqlen_q: int = 128
    seqlen_k: int = 128
    nheads: int = 4
    nheads_k: int = 4
    headdim: int = 64
    headdim_v: Optional[int] = None  # None: headdim
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "head" (nheads) or "batch" (batch, nheads)
    softmax_scale: Optional[float] = None
    deterministic: bool = False
    # varlen: per-sequence lengths (then batch/seqlen_q/seqlen_k are ignored) and optional seqused_k
    seqlens_q: Optional[list] = None
    seqlens_k: Optional[list] = None
    seqused_k: Optional[list] = None
    sinks: bool = False  # learnable sinks (s_aux), one fp32 logit per query head, with their gradient
    # varlen only: the keys read from a paged cache of pages of this many slots (block_table; forward only), as
    # vLLM calls it: seqused_k alone when the case has seqused_k, else cu_seqlens_k alone
    page: Optional[int] = None

    @property
    def dv(self):
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def varlen(self):
        return self.seqlens_q is not None

    def describe(self):
        parts = [DTYPE_NAMES.get(self.dtype, str(self.dtype))]
        if self.varlen:
            parts.append(f"varlen q{self.seqlens_q} k{self.seqlens_k}")
            if self.seqused_k is not None:
                parts.append(f"seqused_k{self.seqused_k}")
            if self.page is not None:
                parts.append(f"paged{self.page}")
        else:
            parts.append(f"b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k}")
        parts.append(f"h{self.nheads}/{self.nheads_k} d{self.headdim}" +
                     (f"/{self.headdim_v}" if self.headdim_v else ""))
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"window{self.window}")
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.sinks:
            parts.append("sinks")
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale:g}")
        if self.deterministic:
            parts.append("deterministic")
        return " ".join(parts)

    def with_(self, **changes):
        return replace(self, **changes)


def alibi_slopes(kind, batch, nheads, device):
    """ALiBi slopes, fp32: the usual geometric ones 2^(-8 (h + 1) / nheads), per (batch, head) jittered."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], dtype=torch.float32)
    if kind == "head":
        return base.to(device)
    jitter = 0.5 + torch.rand(batch, nheads)
    return (base.view(1, -1) * jitter).to(device)


def randn(*shape, dtype, device, grad=False):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype).requires_grad_(grad)


def cu_seqlens(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def options_of(case, slopes, sinks=None):
    return AttnOptions(case.softmax_scale, case.causal, tuple(case.window), case.softcap, slopes,
                       None if sinks is None else sinks.detach())


def interface_kwargs(case, slopes, sinks=None):
    return dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=tuple(case.window),
                softcap=case.softcap, alibi_slopes=slopes, deterministic=case.deterministic, s_aux=sinks)


def make_inputs(case, device=None):
    """Fresh N(0, 1) inputs for a case: q, k, v (leaves with grad), dout, slopes, and varlen index tensors."""
    device = device or DEVICE
    c = case
    if c.varlen:
        total_q, total_k = sum(c.seqlens_q), sum(c.seqlens_k)
        q_shape, k_shape, v_shape = (total_q, c.nheads, c.headdim), (total_k, c.nheads_k, c.headdim), \
            (total_k, c.nheads_k, c.dv)
        out_shape = (total_q, c.nheads, c.dv)
        batch = len(c.seqlens_q)
    else:
        q_shape = (c.batch, c.seqlen_q, c.nheads, c.headdim)
        k_shape = (c.batch, c.seqlen_k, c.nheads_k, c.headdim)
        v_shape = (c.batch, c.seqlen_k, c.nheads_k, c.dv)
        out_shape = (c.batch, c.seqlen_q, c.nheads, c.dv)
        batch = c.batch
    inputs = {
        "q": randn(*q_shape, dtype=c.dtype, device=device, grad=True),
        "k": randn(*k_shape, dtype=c.dtype, device=device, grad=True),
        "v": randn(*v_shape, dtype=c.dtype, device=device, grad=True),
        "dout": randn(*out_shape, dtype=c.dtype, device=device),
        "slopes": alibi_slopes(c.alibi, batch, c.nheads, device) if c.alibi else None,
        "sinks": (torch.empty(c.nheads, device=device).uniform_(-1.0, 3.0).requires_grad_(True)
                  if c.sinks else None),
    }
    if c.varlen:
        inputs["cu_seqlens_q"] = cu_seqlens(c.seqlens_q, device)
        inputs["cu_seqlens_k"] = cu_seqlens(c.seqlens_k, device)
        inputs["seqused_k"] = (None if c.seqused_k is None
                               else torch.tensor(c.seqused_k, dtype=torch.int32, device=device))
        if c.seqused_k is not None:
            # Keys past seqused_k are slots no row may read (a serving cache's unwritten ones): NaN, so that any
            # kernel that lets them reach an output, or a gradient, fails the finite check.
            k0 = 0
            with torch.no_grad():
                for n, used in zip(c.seqlens_k, c.seqused_k):
                    inputs["k"][k0 + used:k0 + n] = float("nan")
                    inputs["v"][k0 + used:k0 + n] = float("nan")
                    k0 += n
        if c.page is not None:
            inputs.update(paged_cache(c, inputs["k"].detach(), inputs["v"].detach(), device))
    return inputs


def paged_cache(case, k, v, device):
    """k / v (total_k, nheads_k, d) of a varlen case as a paged cache: each sequence's keys in pages of case.page
    slots, the pages in a random order among a few spare ones; every slot no key fills is NaN (a serving cache's
    unwritten memory, which no row may read), and so is every table entry past a sequence's pages' (never
    read: a random page). Returns k_cache, v_cache (num_blocks, page, nheads_k, d) and block_table int32."""
    page, lengths = case.page, case.seqlens_k
    pages = [(n + page - 1) // page for n in lengths]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks)
    k_cache = torch.full((num_blocks, page, *k.shape[1:]), float("nan"), dtype=k.dtype, device=device)
    v_cache = torch.full((num_blocks, page, *v.shape[1:]), float("nan"), dtype=v.dtype, device=device)
    table = torch.randint(0, num_blocks, (len(lengths), max(max(pages), 1)), dtype=torch.int32)
    k0, used = 0, 0
    for b, n in enumerate(lengths):
        for j in range(pages[b]):
            block = int(order[used])
            used += 1
            table[b, j] = block
            rows = min(page, n - j * page)
            k_cache[block, :rows] = k[k0 + j * page:k0 + j * page + rows]
            v_cache[block, :rows] = v[k0 + j * page:k0 + j * page + rows]
        k0 += n
    return {"k_cache": k_cache, "v_cache": v_cache, "block_table": table.to(device)}


def run_flare(case, inputs, backward=True):
    """flare's forward (and backward) through the flash_attn-compatible functions: (out, lse, (dq, dk, dv))."""
    import flare
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    sinks = inputs.get("sinks")
    for t in (q, k, v) + ((sinks,) if sinks is not None else ()):
        t.grad = None
    kwargs = interface_kwargs(case, inputs["slopes"], sinks)
    if case.page is not None:  # forward only
        assert not backward, "a paged varlen forward has no backward"
        used = inputs["seqused_k"]
        out, lse = flare.flash_attn_varlen_func(
            q.detach(), inputs["k_cache"], inputs["v_cache"], inputs["cu_seqlens_q"],
            None if used is not None else inputs["cu_seqlens_k"], max(max(case.seqlens_q), 1),
            max(max(case.seqlens_k), 1), seqused_k=used, block_table=inputs["block_table"],
            return_softmax_lse=True, **kwargs)
    elif case.varlen:
        out, lse = flare.flash_attn_varlen_func(
            q, k, v, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], max(max(case.seqlens_q), 1),
            max(max(case.seqlens_k), 1), seqused_k=inputs["seqused_k"], return_softmax_lse=True, **kwargs)
    else:
        out, lse, _ = flare.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    grads = None
    if backward:
        out.backward(inputs["dout"])
        grads = (q.grad, k.grad, v.grad) + ((sinks.grad,) if sinks is not None else ())
    return out, lse, grads


def reference(case, inputs, round_dtype=None, backward=True):
    opts = options_of(case, inputs["slopes"], inputs.get("sinks"))
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    dout = inputs["dout"] if backward else None
    round_scores = round_dtype is not None and case.softcap > 0
    if case.varlen:
        return varlen_attention(q, k, v, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], opts,
                                inputs["seqused_k"], dout, round_dtype, round_scores)
    return dense_attention(q, k, v, opts, dout, round_dtype, round_scores)


def sm90_claims(case):
    """Whether the sm90 forward claims the case."""
    headdim_v = case.headdim if case.headdim_v is None else case.headdim_v
    dims_taken = ((case.headdim == headdim_v and case.headdim in SM90_HEADDIMS)
                  or (case.headdim, headdim_v) in SM90_HEADDIM_PAIRS)
    return case.dtype in (torch.float16, torch.bfloat16) and dims_taken and case.page is None


def check_case(case, backward=True, device=None):
    """The whole check of one case; raises AssertionError naming the case on any mismatch. With the sm90 path
    forced (arch_path) and a case it does not claim, checks instead that the forward is refused
    (expect_sm90_refusal) and returns (inputs, None)."""
    inputs = make_inputs(case, device)
    if sm90_forced(device) and not sm90_claims(case):
        expect_sm90_refusal(lambda: run_flare(case, inputs, backward=False), f"[{case.describe()}]")
        return inputs, None
    out, lse, grads = run_flare(case, inputs, backward)
    context = f"[{case.describe()}]"
    expected_out = (inputs["dout"].shape)
    assert out.shape == expected_out and out.dtype == case.dtype, \
        f"out: {tuple(out.shape)} {out.dtype}, expected {tuple(expected_out)} {case.dtype} {context}"
    ref = reference(case, inputs, None, backward)
    naive = reference(case, inputs, case.dtype, backward)
    check_close("out", out.detach(), ref["out"], naive["out"], case.dtype, context)
    check_lse(lse, ref["lse"], naive["lse"] if case.softcap > 0 else None, context)
    if backward:
        for name, got in zip(("dq", "dk", "dv"), grads):
            check_close(name, got, ref[name], naive[name], case.dtype, context)
        if case.sinks:  # fp32, formed from the stored out: the same-dtype rule against the rounded-out model
            check_close("dsinks", grads[3], ref["dsinks"], naive["dsinks"], case.dtype, context)
    return inputs, (out, lse, grads)


def heads_cycle(index):
    """MHA, GQA and MQA in turn, so a list of cases covers all three."""
    return [(4, 4), (6, 2), (4, 1)][index % 3]

