"""flash_attn-compatible functions (flash-attn 2.x: same names, parameters, defaults, layouts, returns).

Migrating is an import change: `from flare.flash_attn_interface import flash_attn_func` (or `from flare
import ...`) instead of `from flash_attn import ...`. What flare does not do raises NotImplementedError that
names the argument: dropout_p > 0, and so attention probabilities (flash-attn returns none without dropout
either: with dropout_p == 0, return_attn_probs=True gives (out, softmax_lse, an empty tensor), and so does
flare — the way callers get softmax_lse). Extras beyond flash-attn 2.x on flash_attn_varlen_func: seqused_k, out=, return_softmax_lse.
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


def _check_unsupported(dropout_p: float):
    if dropout_p != 0.0:
        raise NotImplementedError(f"flare: dropout_p={dropout_p}: attention dropout is not supported "
                                  "(use dropout_p=0.0)")


def _scale(softmax_scale: Optional[float]) -> float:
    # 0 asks the library for its default, 1/sqrt(headdim): the same as flash-attn's None. So a scale of 0 itself
    # cannot be asked for, and is refused rather than read as the default.
    if softmax_scale is None:
        return 0.0
    if softmax_scale == 0:
        _checks.reject("softmax_scale=0: the C ABI reads a zero scale as 'the default' (1/sqrt(headdim)), so a "
                       "zero scale cannot be asked for; pass None for the default")
    return float(softmax_scale)


def _window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        _checks.reject(f"window_size={window_size!r}: must be a pair (left, right)")
    return _checks.integer(left, "window_size[0]"), _checks.integer(right, "window_size[1]")


def _result(out: Tensor, lse: Tensor, return_attn_probs: bool):
    # flash-attn 2.x returns (out, softmax_lse, S_dmask); without dropout its S_dmask is an empty tensor.
    return (out, lse, out.new_empty(0)) if return_attn_probs else out


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           arch_path):
    _check_unsupported(dropout_p)
    left, right = _window(window_size)
    return ops.fwd(q, k, v, None, None, None, 0, 0, alibi_slopes, _scale(softmax_scale), bool(causal),
                   left, right, float(softcap), bool(deterministic), str(arch_path))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    arch_path="auto"):
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim) -> out like q
    (with return_attn_probs: (out, softmax_lse (batch, nheads, seqlen_q), empty S_dmask)).
    arch_path: the CUDA kernels of the forward, "auto", "sm80" or "sm90" (module docstring)."""
    out, lse = _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, arch_path)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              arch_path="auto"):
    """qkv (batch, seqlen, 3, nheads, headdim) -> out (batch, seqlen, nheads, headdim)."""
    out, lse = _dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, arch_path)
    return _result(out, lse, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             arch_path="auto"):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    out, lse = _dense(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, arch_path)
    return _result(out, lse, return_attn_probs)


_PAGED = ("paged k/v (num_blocks, block_size, nheads_k, headdim), block_table (batch, max_blocks), "
          "cu_seqlens_k (batch + 1)")


def _gather_paged(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_k: Tensor):
    """The keys and values of a paged cache laid out as varlen (total_k, nheads_k, headdim) tensors.
    The C ABI's varlen pass has no block_table (only the KV-cache pass has), so paging is resolved here with
    a gather; this reads cu_seqlens_k and the used entries of block_table on the host, and checks them first
    (torch indexing would read block -1 as the last one, and a short row would drop keys)."""
    _checks.call(_PAGED, (("k", k_cache, 4), ("v", v_cache, 4)),
                 index=(("block_table", block_table), ("cu_seqlens_k", cu_seqlens_k)))
    _checks.rank(block_table, "block_table", 2, _PAGED)
    _checks.rank(cu_seqlens_k, "cu_seqlens_k", 1, _PAGED)
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    batch, columns = block_table.shape
    cu = cu_seqlens_k.tolist()
    if len(cu) != batch + 1:
        _checks.reject(f"cu_seqlens_k has {len(cu)} entries but block_table {batch} rows: it must have batch + 1")
    seqlens = [end - start for start, end in zip(cu, cu[1:])]
    if cu[0] != 0 or any(n < 0 for n in seqlens):
        _checks.reject(f"cu_seqlens_k = {cu} must start at 0 and not decrease")
    if block_size < 1 and any(seqlens):
        _checks.reject(f"k has shape {tuple(k_cache.shape)}: a paged cache's block_size (dim 1) must be >= 1")
    blocks = []
    for b, n in enumerate(seqlens):
        used = -(-n // block_size) if n else 0
        if used > columns:
            _checks.reject(f"sequence {b} has {n} keys, {used} blocks of {block_size}, but block_table has "
                           f"{columns} columns")
        blocks.append(block_table[b, :used].long())
    flat = torch.cat(blocks) if blocks else block_table.new_empty(0, dtype=torch.long)
    if flat.numel():
        low, high = (int(x) for x in torch.aminmax(flat))
        if low < 0 or high >= num_blocks:
            _checks.reject(f"block_table holds block {low if low < 0 else high} among the blocks in use, but k "
                           f"has {num_blocks} blocks (0..{num_blocks - 1})")

    def gather(cache):
        parts = [cache[ids].reshape(-1, *cache.shape[2:])[:n] for ids, n in zip(blocks, seqlens)]
        return torch.cat(parts, dim=0) if parts else cache.new_empty(0, *cache.shape[2:])

    return gather(k_cache), gather(v_cache)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           *, seqused_k=None, out=None, return_softmax_lse=False, arch_path="auto"):
    """q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim), cu_seqlens_q/k int32 (batch + 1).
    With block_table, k/v are a paged cache (num_blocks, block_size, nheads_k, headdim) and cu_seqlens_k
    gives each sequence's length in it. seqused_k int32 (batch): only its first seqused_k[b] keys are used.
    out=: written with the result (and returned). return_softmax_lse: return (out, softmax_lse (nheads,
    total_q)) instead of out. arch_path: as in flash_attn_func (varlen calls run the sm80 kernels today, so
    "sm90" refuses them)."""
    _check_unsupported(dropout_p)
    left, right = _window(window_size)
    max_seqlen_q = _checks.integer(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _checks.integer(max_seqlen_k, "max_seqlen_k")
    scale = _scale(softmax_scale)
    if out is not None:
        _checks.rank(q, "q", 3, ops._VARLEN)
        paged = block_table is not None
        _checks.rank(v, "v", 4 if paged else 3, _PAGED if paged else ops._VARLEN)
        _checks.output(out, "out", (*q.shape[:-1], v.shape[-1]), q)
    if block_table is not None:
        k, v = _gather_paged(k, v, block_table, cu_seqlens_k)
    result, lse = ops.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                          alibi_slopes, scale, bool(causal), left, right, float(softcap),
                          bool(deterministic), str(arch_path))
    if out is not None:
        out.copy_(result)
        result = out
    if return_softmax_lse:
        return result, lse
    return _result(result, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, *, arch_path="auto"):
    """qkv (total, 3, nheads, headdim), cu_seqlens int32 (batch + 1)."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                                  max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, arch_path=arch_path)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, arch_path="auto"):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, arch_path=arch_path)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Inference attention against a KV cache, dense (batch_cache, seqlen_cache, nheads_k, headdim) or paged
    (num_blocks, block_size, nheads_k, headdim) with block_table. k/v (batch, seqlen_new, nheads_k, headdim)
    are rotated (if rotary_cos/sin are given) and written into the cache in place at cache_seqlens, then
    attended to. cache_seqlens: int or int32 tensor (batch). Returns out, or (out, softmax_lse)."""
    left, right = _window(window_size)
    if isinstance(cache_seqlens, int):
        _checks.rank(q, "q", 4, ops._KVCACHE)
        cache_seqlens = _checks.int32(cache_seqlens, "cache_seqlens")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    num_splits = _checks.integer(num_splits, "num_splits")
    out, lse = ops.fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                               block_table, rotary_cos, rotary_sin, bool(rotary_interleaved), num_splits,
                               alibi_slopes, _scale(softmax_scale), bool(causal), left, right, float(softcap))
    return (out, lse) if return_softmax_lse else out
