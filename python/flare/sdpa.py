"""flare as torch's SDPA flash-attention provider (torch.nn.attention.register_flash_attention_impl).

    import flare.sdpa
    flare.sdpa.activate()     # F.scaled_dot_product_attention now runs flare where SDPA picks flash
    flare.sdpa.deactivate()   # back to torch's own kernels

torch >= 2.11 lets a library take over the dispatcher kernels behind SDPA's flash backend. On the CPU those
are aten::_scaled_dot_product_flash_attention_for_cpu and its backward, which this module implements with
flare (CUDA's _scaled_dot_product_flash_attention is to follow with the CUDA backend). SDPA's conventions
differ from FlashAttention's in two ways handled here: (batch, nheads, seqlen, headdim) layout (a transpose,
no copy) and top-left causal alignment (for seqlen_q > seqlen_k it is flare's window (-1, seqlen_q -
seqlen_k); for seqlen_q < seqlen_k flare cannot express it). Calls flare cannot run as asked (an attn_mask,
dropout, top-left causal with seqlen_q < seqlen_k, a scale of 0) are computed by a plain math path in this
module, so activating never changes results, only where they come from.
"""

import math

import torch

from . import _checks, ops

NAME = "flare"
_registered = False


def available() -> bool:
    """Whether this torch has the SDPA provider hook (torch.nn.attention.register_flash_attention_impl)."""
    return hasattr(torch.nn.attention, "register_flash_attention_impl")


def _flare_window(sq, sk, is_causal):
    """(causal, window_left, window_right) for SDPA's top-left causal, or None if flare cannot express it."""
    if not is_causal or sq == sk:
        return is_causal, -1, -1
    if sq > sk:
        return False, -1, sq - sk
    return None


def _flare_runs(attn_mask, window, scale):
    """Whether flare computes this call as asked: no attn_mask, a causal alignment it can express, and a scale
    its fp32 field holds (a scale that is or rounds to 0 would read there as the default 1/sqrt(headdim))."""
    return attn_mask is None and window is not None and _checks.fp32(scale) != 0


def _math_scores(query, key, attn_mask, is_causal, scale):
    """Scores in fp32+ for the math path, masks applied; key already has query's head count."""
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    s = torch.matmul(query.to(acc), key.to(acc).transpose(-1, -2)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    if is_causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.to(acc)
    return s


def _expand_kv(query, t):
    return t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) if t.shape[1] != query.shape[1] else t


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if dropout_p != 0.0:
        raise NotImplementedError(f"flare SDPA provider: dropout_p={dropout_p} is not supported")
    sq, sk = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    window = _flare_window(sq, sk, is_causal)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    if _flare_runs(attn_mask, window, scale):
        causal, left, right = window
        out, lse = ops.fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, None, 0,
                           0, None, float(scale), causal, left, right, 0.0, False)
        return out.transpose(1, 2), lse.to(acc)
    s = _math_scores(query, _expand_kv(query, key), attn_mask, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.matmul(p, _expand_kv(query, value).to(acc)).to(query.dtype)
    return out, lse


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                   scale=None):
    sq, sk = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    window = _flare_window(sq, sk, is_causal)
    if _flare_runs(attn_mask, window, scale) and dropout_p == 0.0:
        causal, left, right = window
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = ops.bwd(t(grad_out), t(query), t(key), t(value), t(out), logsumexp.float(), None, None,
                             None, 0, 0, None, float(scale), causal, left, right, 0.0, False)
        return t(dq), t(dk), t(dv)
    # math path: dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), dQ = dS K · scale, dK = dSᵀ Q · scale
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    k, v = _expand_kv(query, key).to(acc), _expand_kv(query, value).to(acc)
    s = _math_scores(query, k, attn_mask, is_causal, scale)
    p = torch.exp(s - logsumexp.to(acc).unsqueeze(-1)).nan_to_num(0.0)
    do = grad_out.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), query.to(acc)) * scale
    group = query.shape[1] // key.shape[1]
    if group != 1:  # sum the query heads of each kv head
        dk = dk.unflatten(1, (key.shape[1], group)).sum(2)
        dv = dv.unflatten(1, (key.shape[1], group)).sum(2)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


class _Handle:
    """What torch keeps while flare is active; remove() gives the kernels back to torch."""

    def __init__(self, library):
        self._library = library

    def remove(self):
        if self._library is not None:
            self._library._destroy()
            self._library = None


def _register_kernels():
    library = torch.library.Library("aten", "IMPL", "CPU")  # noqa: TOR901 (replacing aten kernels is the point)
    library.impl("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward, "CPU")
    library.impl("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward, "CPU")
    return _Handle(library)


def _require_hook():
    if not available():
        raise RuntimeError(f"flare.sdpa: torch {torch.__version__} has no torch.nn.attention."
                           "register_flash_attention_impl (added in torch 2.11); use flare.flash_attn_func "
                           "or the transformers integration instead")


def activate():
    """Route SDPA's flash kernels to flare (CPU now). Raises RuntimeError where torch lacks the hook."""
    global _registered
    _require_hook()
    if not _registered:
        torch.nn.attention.register_flash_attention_impl(NAME, register_fn=_register_kernels)
        _registered = True
    torch.nn.attention.activate_flash_attention_impl(NAME)


def deactivate():
    """Give SDPA's flash kernels back to torch."""
    _require_hook()
    if torch.nn.attention.current_flash_attention_impl() == NAME:
        torch.nn.attention.restore_flash_attention_impl()
