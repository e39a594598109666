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
dropout, top-left causal with seqlen_q < seqlen_k, a scale of 0), forward and backward, go to torch's own
kernels, taken before flare replaced them: activating never changes those calls' results, speed or memory.
Outputs have the strides of torch's meta functions, which torch.compile checks.
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


def _flare_runs(attn_mask, dropout_p, window, scale):
    """Whether flare computes this call as asked: no attn_mask, no dropout, a causal alignment it can express,
    and a scale its fp32 field holds (a scale that is or rounds to 0 would read there as the default)."""
    return attn_mask is None and dropout_p == 0.0 and window is not None and _checks.fp32(scale) != 0


# torch's own kernels of the two ops, taken (torch.library.get_kernel) before flare replaces them: the calls
# flare does not run go back to them, so they cost what they cost without flare.
_torch_kernels = {}
_CPU = torch._C.DispatchKeySet("CPU")
_OPS = {"fwd": "aten::_scaled_dot_product_flash_attention_for_cpu",
        "bwd": "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def _torch_kernel(pass_):
    """torch's own CPU kernel of pass_ ("fwd" or "bwd"); taken before flare's registration (or now, while flare
    is not registered: then the dispatcher's kernel is torch's)."""
    if pass_ not in _torch_kernels:
        _torch_kernels[pass_] = torch.library.get_kernel(_OPS[pass_], "CPU")
    return _torch_kernels[pass_]


def _like_meta_out(query, out):
    """out in the strides of torch's meta function (empty_like(query)): torch.compile checks them."""
    want = torch.empty_like(query, device="meta")
    if out.stride() == want.stride():
        return out
    return torch.empty_like(query).copy_(out)


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    sq = query.shape[-2]
    window = _flare_window(sq, key.shape[-2], is_causal)
    flare_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if not _flare_runs(attn_mask, dropout_p, window, flare_scale):
        return _torch_kernel("fwd").call_boxed(_CPU, query, key, value, dropout_p, is_causal,
                                                attn_mask=attn_mask, scale=scale)
    causal, left, right = window
    out, lse = ops.fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, None, 0,
                       0, None, float(flare_scale), causal, left, right, 0.0, False)
    # As torch's kernel and its meta function: logsumexp (batch, nheads, seqlen_q) in the memory order
    # (batch, seqlen_q, nheads), in the inputs' accumulation type (fp64 for fp64, else fp32).
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    b, h = query.shape[0], query.shape[1]
    logsumexp = torch.empty(b, sq, h, dtype=acc, device=query.device).transpose(1, 2).copy_(lse)
    return _like_meta_out(query, out.transpose(1, 2)), logsumexp


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                   scale=None):
    window = _flare_window(query.shape[-2], key.shape[-2], is_causal)
    flare_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if not _flare_runs(attn_mask, dropout_p, window, flare_scale):
        return _torch_kernel("bwd").call_boxed(_CPU, grad_out, query, key, value, out, logsumexp, dropout_p,
                                                is_causal, attn_mask=attn_mask, scale=scale)
    causal, left, right = window
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    # flare's dq/dk/dv are (batch, seqlen, nheads, headdim) in memory: the layout torch's meta function gives.
    dq, dk, dv = ops.bwd(t(grad_out), t(query), t(key), t(value), t(out), logsumexp.float(), None, None,
                         None, 0, 0, None, float(flare_scale), causal, left, right, 0.0, False)
    return t(dq), t(dk), t(dv)


class _Handle:
    """What torch keeps while flare is active; remove() gives the kernels back to torch."""

    def __init__(self, library):
        self._library = library

    def remove(self):
        if self._library is not None:
            self._library._destroy()
            self._library = None


def _register_kernels():
    for pass_ in _OPS:
        _torch_kernel(pass_)
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
