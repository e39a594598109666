"""The GPU tests' reference: attention in fp32 with torch on the test's device, written from
docs/semantics.md independently of flare, and the accuracy rule of STYLE.md #10 as
tests/cpp/attention_harness.hpp applies it.

Two runs of the same code:
  reference   fp32 throughout (TF32 off): the answer flare is measured against;
  naive       the same math on the same inputs, but with P (after normalisation), out and, in the backward,
              dP, dS and the gradients rounded to the input dtype: what a plain same-dtype implementation
              commits. With softcap the capped scores are rounded too (round_scores), as a torch
              implementation in the dtype does; that is the allowance for a fast tanh.
The rule (attention_harness.hpp's expect_matches for fp16/bf16):
  max|flare - ref| <= 2 * max|naive - ref| + atol,   atol = 2 * unit_roundoff(dtype) * max(1, max|ref|)
(one unit in the last place at the output's scale: two correct pipelines can land on neighbouring values).
softmax_lse is fp32 whatever the inputs: max|flare - ref| <= LSE_TOL * max(1, max|ref|) over finite rows,
plus twice the naive error when the naive run rounds scores; rows with no visible key must be -inf in both.

Layouts are flare's: dense q (b, sq, h, d), k/v (b, sk, hk, d[v]); varlen (total, h, d) with cu_seqlens.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24,
                 torch.float64: 2.0 ** -53}
# softmax_lse: fp32 accumulation over up to a few thousand keys in both flare and the reference.
LSE_TOL = 2e-5


@dataclass
class AttnOptions:
    """The attention options of one call, with FlashAttention's meaning (docs/semantics.md)."""
    softmax_scale: Optional[float] = None  # None: 1/sqrt(headdim)
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None  # fp32 (nheads) or (batch, nheads)
    sinks: Optional[torch.Tensor] = None  # learnable sinks (nheads): exp(sink) joins each softmax denominator

    def scale_for(self, headdim):
        return 1.0 / math.sqrt(headdim) if self.softmax_scale is None else self.softmax_scale


def visible_keys(seqlen_q, seqlen_k, causal, window, device):
    """(visible (sq, sk) bool, distance |i + sk - sq - j| as fp32): bottom-right aligned masks."""
    i = torch.arange(seqlen_q, device=device).view(-1, 1) + (seqlen_k - seqlen_q)  # each query's diagonal
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible, (i - j).abs().to(torch.float32)


def _rounder(dtype, compute):
    if dtype is None:
        return lambda x: x
    return lambda x: x.to(dtype).to(compute)


def dense_attention(q, k, v, opts: AttnOptions, dout=None, round_dtype=None, round_scores=False,
                    compute=torch.float32):
    """Forward (and with dout the backward) of dense attention. Returns a dict with out (b, sq, h, dv),
    lse (b, h, sq) and, with dout, dq, dk, dv, all in `compute`. round_dtype None: the reference;
    a dtype: the naive same-dtype model (see the module docstring)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    rnd = _rounder(round_dtype, compute)
    scale = opts.scale_for(d)
    qf, kf, vf = (t.to(compute) for t in (q, k, v))
    kf = kf.repeat_interleave(group, dim=2)  # query head h reads kv head h // group
    vf = vf.repeat_interleave(group, dim=2)

    raw = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale  # (b, h, sq, sk)
    s = opts.softcap * torch.tanh(raw / opts.softcap) if opts.softcap > 0 else raw
    if dout is None or opts.softcap <= 0:
        raw = None  # only the softcap backward needs the raw scores again
    visible, distance = visible_keys(sq, sk, opts.causal, opts.window, q.device)
    if opts.alibi_slopes is not None:
        slopes = opts.alibi_slopes.to(device=q.device, dtype=compute)
        slopes = slopes.view(1, h, 1, 1) if slopes.dim() == 1 else slopes.view(b, h, 1, 1)
        s = s - slopes * distance.to(compute)
    if round_scores:
        s = rnd(s)
    s = s.masked_fill(~visible, float("-inf"))
    if opts.sinks is None:
        lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no visible key
    else:  # the sink's term joins the denominator: a row with no visible key has lse = sink
        sink = opts.sinks.to(device=q.device, dtype=compute).view(1, h, 1, 1).expand(b, h, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    p = torch.where(torch.isfinite(lse).unsqueeze(-1), p, torch.zeros((), dtype=compute, device=q.device))
    del s
    p = rnd(p)
    out = rnd(torch.einsum("bhij,bjhd->bihd", p, vf))
    result = {"out": out, "lse": lse}
    if dout is None:
        return result

    # Backward (docs/semantics.md): D = dout . out; dP = dout V^T; dS = P (dP - D) [* softcap'];
    # dq = scale dS K; dk = scale dS^T Q; dv = P^T dout; dk, dv summed over each kv head's group.
    doutf = dout.to(compute)
    d_row = (doutf * out).sum(-1).transpose(1, 2).unsqueeze(-1)  # (b, h, sq, 1)
    dp = rnd(torch.einsum("bihd,bjhd->bhij", doutf, vf))
    ds = rnd(p * (dp - d_row))
    del dp
    if opts.softcap > 0:
        ds = ds * (1.0 - torch.tanh(raw / opts.softcap) ** 2)
    del raw
    dq = torch.einsum("bhij,bjhd->bihd", ds, kf) * scale
    dk = torch.einsum("bhij,bihd->bjhd", ds, qf) * scale
    dv = torch.einsum("bhij,bihd->bjhd", p, doutf)
    dk = dk.view(b, sk, hk, group, d).sum(3)
    dv = dv.view(b, sk, hk, group, dv.shape[-1]).sum(3)
    result.update(dq=rnd(dq), dk=rnd(dk), dv=rnd(dv))
    if opts.sinks is not None:  # d out / d sink = -exp(sink - lse) out
        share = torch.exp(opts.sinks.to(device=q.device, dtype=compute).view(1, h, 1) - lse)
        result["dsinks"] = -(share * d_row.squeeze(-1)).sum(dim=(0, 2))
    return result


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, opts: AttnOptions, seqused_k=None, dout=None,
                     round_dtype=None, round_scores=False, compute=torch.float32):
    """Varlen attention, one dense call per sequence. out (total_q, h, dv), lse (h, total_q); dk/dv are 0
    for keys past seqused_k (and zero-length sequences contribute nothing)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    total_q, h = q.shape[0], q.shape[1]
    dv_dim = v.shape[-1]
    out = torch.zeros(total_q, h, dv_dim, dtype=compute, device=q.device)
    lse = torch.full((h, total_q), float("-inf"), dtype=compute, device=q.device)
    grads = None
    if dout is not None:
        grads = {"dq": torch.zeros(q.shape, dtype=compute, device=q.device),
                 "dk": torch.zeros(k.shape, dtype=compute, device=q.device),
                 "dv": torch.zeros(v.shape, dtype=compute, device=q.device)}
        if opts.sinks is not None:
            grads["dsinks"] = torch.zeros(h, dtype=compute, device=q.device)
    for b in range(len(cu_q) - 1):
        q0, q1 = cu_q[b], cu_q[b + 1]
        k0, k1 = cu_k[b], cu_k[b + 1]
        if used is not None:
            k1 = k0 + used[b]
        if q1 == q0:
            continue
        slopes = opts.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        seq_opts = AttnOptions(opts.softmax_scale, opts.causal, opts.window, opts.softcap, slopes, opts.sinks)
        if k1 == k0:  # no keys: every row fully masked (out 0, lse -inf or the sink, no gradient)
            if opts.sinks is not None:
                lse[:, q0:q1] = opts.sinks.to(device=q.device, dtype=compute).view(h, 1)
            continue
        r = dense_attention(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0), seq_opts,
                            None if dout is None else dout[q0:q1].unsqueeze(0), round_dtype, round_scores,
                            compute)
        out[q0:q1] = r["out"][0]
        lse[:, q0:q1] = r["lse"][0]
        if grads is not None:
            grads["dq"][q0:q1] = r["dq"][0]
            grads["dk"][k0:k1] = r["dk"][0]
            grads["dv"][k0:k1] = r["dv"][0]
            if "dsinks" in grads:
                grads["dsinks"] += r["dsinks"]
    result = {"out": out, "lse": lse}
    if grads is not None:
        result.update(grads)
    return result


# ---- the accuracy rule -----------------------------------------------------------------------------------


def _where_max(err):
    flat = int(torch.argmax(err.reshape(-1)))
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))


def check_close(name, got, ref, naive, dtype, context=""):
    """flare's `got` against the fp32 `ref` by the rule of the module docstring; `naive` is the same-dtype
    model's result. Raises AssertionError with the numbers and where the worst element is."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)} {context}"
    if got.numel() == 0:
        return
    got = got.to(ref.dtype)
    bad = ~torch.isfinite(got)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} of {got.numel()} values are NaN/inf (first at {first}: "
                             f"{got[first].item()}, reference {ref[first].item()}) {context}")
    err = (got - ref).abs()
    max_err = err.max().item()
    naive_err = (naive.to(ref.dtype) - ref).abs().max().item()
    magnitude = max(1.0, ref.abs().max().item())
    atol = 2.0 * UNIT_ROUNDOFF[dtype] * magnitude
    bound = 2.0 * naive_err + atol
    if not max_err <= bound:
        at = _where_max(err)
        raise AssertionError(
            f"{name}: max|flare - ref| = {max_err:.4e} > bound {bound:.4e} (= 2 * naive error {naive_err:.4e} + "
            f"atol {atol:.2e}); worst at {at}: flare {got[at].item():.6g}, ref {ref[at].item():.6g}, "
            f"naive {naive[at].item():.6g}; mean error {err.mean().item():.3e} {context}")


def check_lse(got, ref, naive=None, context=""):
    """softmax_lse (fp32): -inf exactly where the reference has no visible key, else within LSE_TOL at the
    scale of the values (plus twice the naive error when `naive` is given: the rounded-score model)."""
    assert got.dtype == torch.float32, f"softmax_lse is {got.dtype}, not fp32 {context}"
    assert got.shape == ref.shape, f"softmax_lse: shape {tuple(got.shape)}, expected {tuple(ref.shape)} {context}"
    if got.numel() == 0:
        return
    ref = ref.to(torch.float32)
    masked = torch.isneginf(ref)
    if bool(torch.isnan(got).any()):
        raise AssertionError(f"softmax_lse: {int(torch.isnan(got).sum())} NaN values {context}")
    wrong = masked != torch.isneginf(got)
    if bool(wrong.any()):
        first = tuple(int(i) for i in wrong.nonzero()[0])
        raise AssertionError(f"softmax_lse: {int(wrong.sum())} rows disagree on 'no visible key' (-inf); first "
                             f"at {first}: flare {got[first].item()}, ref {ref[first].item()} {context}")
    finite = ~masked
    if not bool(finite.any()):
        return
    err = (got[finite] - ref[finite]).abs()
    max_err = err.max().item()
    bound = LSE_TOL * max(1.0, ref[finite].abs().max().item())
    if naive is not None:
        bound += 2.0 * (naive.to(torch.float32)[finite] - ref[finite]).abs().max().item()
    if not max_err <= bound:
        raise AssertionError(f"softmax_lse: max|flare - ref| = {max_err:.4e} > bound {bound:.4e} {context}")
