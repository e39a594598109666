"""flash_attn-compatible functions (flash-attn 2.x: same names, parameters, defaults, layouts, returns).

Migrating is an import change: `from flare.flash_attn_interface import flash_attn_func` (or `from flare
import ...`) instead of `from flash_attn import ...`. What flare does not do raises NotImplementedError that
names the argument. dropout_p > 0 draws its seed and offset from torch's default CPU generator (a host step:
no CUDA graph capture of a dropout call yet), so torch.manual_seed reproduces a run; the backward redraws the forward's mask. With dropout,
return_attn_probs=True gives flash-attn 2's S_dmask, (batch, nheads, seqlen_q, seqlen_k), the softmax
probabilities with the dropped ones negated, from the dense functions (seqlen_k within the head-dim limit: it
is computed by a forward against identity values, for tests); without dropout it is an empty tensor, as in
flash-attn (the way callers get softmax_lse). Extras beyond flash-attn 2.x on flash_attn_varlen_func: seqused_k, out=, return_softmax_lse.
Extra on every function, keyword-only: s_aux=None, learnable attention sinks (GPT-OSS; the name vLLM's
flash-attention takes them by): a (nheads) tensor of logits whose exp joins each head's softmax denominator
(flare.ops module docstring), differentiable; softmax_lse then counts them.
Extra on every function but flash_attn_with_kvcache, keyword-only: arch_path="auto" | "sm80" | "sm90", the CUDA
kernels of the forward ("auto": the sm90 ones on an H100/H200 for the calls they cover, else the sm80 ones; a
forced "sm90" that cannot run raises NotImplementedError saying why; the CPU ignores it; the backward always
runs the sm80 kernels). The environment variable FLARE_CUDA_ARCH_PATH does the same for calls left at "auto".
Everything runs through the torch ops in ops.py (autograd, torch.compile).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _checks, ops

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


def _dropout(dropout_p):
    """(dropout_p, seed, offset): a fresh seed and offset from torch's default CPU generator when dropout_p is not
    0 (the library checks its range)."""
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        _checks.reject(f"dropout_p={dropout_p!r}: it must be a number in [0, 1)")
    if p == 0.0:
        return 0.0, 0, 0
    seed, offset = torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64).tolist()
    return p, seed, offset


def _scale(softmax_scale: Optional[float]) -> float:
    # 0 asks the library for its default, 1/sqrt(headdim): the same as flash-attn's None. So a scale of 0 itself
    # cannot be asked for, and is refused rather than read as the default.
    if softmax_scale is None:
        return 0.0
    if softmax_scale == 0:
        _checks.reject("softmax_scale=0: the C ABI reads a zero scale as 'the default' (1/sqrt(headdim)), so a "
                       "zero scale cannot be asked for; pass None for the default")
    return float(softmax_scale)


def _sinks(s_aux):
    if s_aux is not None and not isinstance(s_aux, torch.Tensor):
        _checks.reject(f"s_aux is a {type(s_aux).__name__}: learnable sinks are a tensor of shape (nheads), or None")
    return s_aux


def _window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        _checks.reject(f"window_size={window_size!r}: must be a pair (left, right)")
    return _checks.integer(left, "window_size[0]"), _checks.integer(right, "window_size[1]")


def _result(out: Tensor, lse: Tensor, return_attn_probs: bool, s_dmask=None):
    # flash-attn 2.x returns (out, softmax_lse, S_dmask); without dropout its S_dmask is an empty tensor.
    if not return_attn_probs:
        return out
    return out, lse, (out.new_empty(0) if s_dmask is None else s_dmask)


def _s_dmask(q, k, args, dropout):
    """flash-attn 2's S_dmask of a dense call: the probabilities P (batch, nheads, seqlen_q, seqlen_k) from a
    forward without dropout against identity values (out[i][j] = P_ij), negated where dropout drops them."""
    b, sq, h = q.shape[:3]
    sk, hk = k.shape[1], k.shape[2]
    eye = torch.eye(sk, dtype=q.dtype, device=q.device).view(1, sk, 1, sk).expand(b, sk, hk, sk).contiguous()
    with torch.no_grad():
        probs, _ = ops.fwd_eager(q.detach(), k.detach(), eye, *args)
    probs = probs.permute(0, 2, 1, 3)
    keep = torch.stack([ops.dropout_mask(dropout[0], dropout[1], dropout[2], i, h, sq, sk) for i in range(b)])
    return torch.where(keep.to(probs.device), probs, -probs)


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           arch_path, s_aux, return_attn_probs=False):
    """(out, lse, S_dmask or None) of a dense call."""
    dropout = _dropout(dropout_p)
    left, right = _window(window_size)
    args = (None, None, None, 0, 0, alibi_slopes, _scale(softmax_scale), bool(causal), left, right, float(softcap),
            bool(deterministic), str(arch_path), None, _sinks(s_aux))
    out, lse = ops.fwd_call(q, k, v, *args, *dropout)
    s_dmask = _s_dmask(q, k, args, dropout) if return_attn_probs and dropout[0] > 0 else None
    return out, lse, s_dmask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    arch_path="auto", s_aux=None):
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim) -> out like q
    (with return_attn_probs: (out, softmax_lse (batch, nheads, seqlen_q), empty S_dmask)).
    arch_path: the CUDA kernels of the forward, "auto", "sm80" or "sm90"; s_aux: sinks (module docstring)."""
    out, lse, s_dmask = _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, arch_path, s_aux, return_attn_probs)
    return _result(out, lse, return_attn_probs, s_dmask)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              arch_path="auto", s_aux=None):
    """qkv (batch, seqlen, 3, nheads, headdim) -> out (batch, seqlen, nheads, headdim)."""
    out, lse, s_dmask = _dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                               window_size, softcap, alibi_slopes, deterministic, arch_path, s_aux,
                               return_attn_probs)
    return _result(out, lse, return_attn_probs, s_dmask)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             arch_path="auto", s_aux=None):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    out, lse, s_dmask = _dense(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                               softcap, alibi_slopes, deterministic, arch_path, s_aux, return_attn_probs)
    return _result(out, lse, return_attn_probs, s_dmask)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           *, seqused_k=None, out=None, return_softmax_lse=False, arch_path="auto", s_aux=None):
    """q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim), cu_seqlens_q/k int32 (batch + 1).
    With block_table, k/v are a paged cache (num_blocks, block_size, nheads_k, headdim), any block_size >= 1,
    read in place by the library (no gather); each sequence's key count is seqused_k[b] when given, else its
    cu_seqlens_k span (one of them is needed; vLLM passes seqused_k alone). Paged calls are forward-only; on
    CUDA tensors they run on the KV-cache kernels (no dropout there). seqused_k int32 (batch): only its first seqused_k[b]
    keys are used. max_seqlen_q/k: upper bounds, or None/0 to derive them.
    out=: written with the result (and returned). return_softmax_lse: return (out, softmax_lse (nheads,
    total_q)) instead of out. arch_path: as in flash_attn_func."""
    dropout = _dropout(dropout_p)
    if return_attn_probs and dropout[0] > 0 and not return_softmax_lse:
        raise NotImplementedError("flare: return_attn_probs=True with dropout_p > 0 (S_dmask) is given by the dense "
                                  "functions only, not by flash_attn_varlen_func")
    left, right = _window(window_size)
    max_seqlen_q = _checks.integer(max_seqlen_q or 0, "max_seqlen_q")
    max_seqlen_k = _checks.integer(max_seqlen_k or 0, "max_seqlen_k")
    scale = _scale(softmax_scale)
    if out is not None:
        _checks.rank(q, "q", 3, ops._VARLEN)
        paged = block_table is not None
        _checks.rank(v, "v", 4 if paged else 3, ops._PAGED if paged else ops._VARLEN)
        _checks.output(out, "out", (*q.shape[:-1], v.shape[-1]), q)
    result, lse = ops.fwd_call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                          alibi_slopes, scale, bool(causal), left, right, float(softcap),
                          bool(deterministic), str(arch_path), block_table, _sinks(s_aux), *dropout)
    if out is not None:
        out.copy_(result)
        result = out
    if return_softmax_lse:
        return result, lse
    return _result(result, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, *, arch_path="auto",
                                     s_aux=None):
    """qkv (total, 3, nheads, headdim), cu_seqlens int32 (batch + 1)."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                                  max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, arch_path=arch_path, s_aux=s_aux)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, arch_path="auto", s_aux=None):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, arch_path=arch_path, s_aux=s_aux)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, s_aux=None):
    """Inference attention against a KV cache, dense (batch_cache, seqlen_cache, nheads_k, headdim) or paged
    (num_blocks, block_size, nheads_k, headdim) with block_table. k/v (batch, seqlen_new, nheads_k, headdim)
    are rotated (if rotary_cos/sin are given) and written into the cache in place at cache_seqlens, then
    attended to. cache_seqlens: int or int32 tensor (batch). Returns out, or (out, softmax_lse)."""
    left, right = (-1, -1) if window_size == (-1, -1) else _window(window_size)
    if isinstance(cache_seqlens, int):
        _checks.rank(q, "q", 4, ops._KVCACHE)
        cache_seqlens = _checks.int32(cache_seqlens, "cache_seqlens")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if type(num_splits) is not int:
        num_splits = _checks.integer(num_splits, "num_splits")
    scale = 0.0 if softmax_scale is None else _scale(softmax_scale)
    if type(softcap) is not float:
        softcap = float(softcap)
    # Eager, on plain tensors that pass the op's checks: the op's function itself (no autograd either way),
    # without softmax_lse unless it is returned; anything else goes through the op (fwd_kvcache_eager's
    # direct). The op bumps the version of the caches it appends to; so does this.
    result = ops.fwd_kvcache_eager(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                   block_table, rotary_cos, rotary_sin, rotary_interleaved, num_splits,
                                   alibi_slopes, scale, causal, left, right, softcap, s_aux, return_softmax_lse,
                                   True)  # want_lse, direct
    if result is None:
        out, lse = ops.fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                   block_table, rotary_cos, rotary_sin, bool(rotary_interleaved), num_splits,
                                   alibi_slopes, scale, bool(causal), left, right, softcap, _sinks(s_aux))
        return (out, lse) if return_softmax_lse else out
    out, lse = result
    if k is not None:
        torch.autograd.graph.increment_version((k_cache, v_cache))
    return (out, lse) if return_softmax_lse else out
