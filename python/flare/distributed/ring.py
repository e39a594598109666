"""Ring attention (context parallelism): ring_attention and ring_attention_varlen.

Each of the W ranks of a process group holds a slice of one long sequence (q, k and v of the same tokens).
For W steps every rank attends its queries to the K/V block in hand, folds the partial result into a
running one through the LSE (exact, fp32), and passes the block on to the next rank; the next block's
transfer is posted before the current block's compute. The backward pass runs the same ring: dQ stays
local, dK/dV accumulators (fp32) travel with their K/V block and arrive back at their owner at the end.
Every block is computed by flare's own ops (flare::fwd / flare::bwd); see blocks.py for how global
positions (causal, windows, ALiBi) map onto one call, and layout.py for the zigzag split.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._capi import FlareArgumentError
from .blocks import AttnOptions
from .comm import Ring
from .layout import DenseGeometry, VarlenGeometry, chunk_count

_KV_TAG, _GRAD_TAG = 0, 2  # gloo matches by tag: K/V and dK/dV exchanges may be in flight together

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc_dtype(q: Tensor) -> torch.dtype:
    """Accumulators: fp32, or fp64 for fp64 inputs (lse stays fp32, as flare's is)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _ring_forward(q, k, v, slopes, geometry, ring):
    """Dense-form q (batch, len, nheads, d), k/v (batch, len, nheads_k, d[_v]) -> (out, lse fp32)."""
    batch, length, nheads = q.shape[:3]
    out_acc = torch.zeros((batch, length, nheads, v.shape[-1]), dtype=_acc_dtype(q), device=q.device)
    lse_acc = torch.full((batch, nheads, length), -math.inf, dtype=torch.float32, device=q.device)
    block = (k, v)
    for step in range(ring.world_size):
        incoming = ring.pass_on(block, _KV_TAG) if step + 1 < ring.world_size else None
        geometry.forward_block(q, block[0], block[1], ring.source(step), out_acc, lse_acc, slopes)
        if incoming is not None:
            block = tuple(incoming.wait())
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, slopes, geometry, ring):
    """Gradients (dq, dk, dv) of _ring_forward; dk/dv end on the rank that owns k/v."""
    world = ring.world_size
    acc = _acc_dtype(q)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    block = (k, v)
    grads_in = None  # the dk/dv accumulators of the block this rank holds next, on their way
    for step in range(world):
        incoming = ring.pass_on(block, _KV_TAG) if step + 1 < world else None
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        geometry.backward_block(dout, q, block[0], block[1], out, lse, ring.source(step), dq_acc, dk, dv, slopes)
        if grads_in is not None:
            dk_before, dv_before = grads_in.wait()
            dk += dk_before
            dv += dv_before
        # after the last step this hop takes each accumulator home: rank r then holds block r + 1's
        grads_in = ring.pass_on((dk, dv), _GRAD_TAG) if world > 1 else None
        if incoming is not None:
            block = tuple(incoming.wait())
    if grads_in is not None:
        dk, dv = grads_in.wait()
    return dq_acc.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Autograd over the ring on dense-form tensors; lse is an output, not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, geometry, ring):
        k, v = k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, slopes, geometry, ring)
        ctx.save_for_backward(q, k, v, out, lse, slopes)
        ctx.geometry, ctx.ring = geometry, ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, slopes = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, slopes, ctx.geometry, ctx.ring)
        return dq, dk, dv, None, None, None


# ---- validation ---------------------------------------------------------------------------------------
# These checks run before the ring starts, although flare's C ABI makes most of them again in every block call
# (dtypes, head counts, head dims, windows, softcap, ALiBi): a rank posts its first K/V transfer before its
# first block call, so an error raised there would leave the other ranks waiting on a transfer that never
# completes (with NCCL, a hang instead of a message). Raised here, on every rank alike (each gets the same
# shapes and options), nothing has been sent. The others only the ring can check: q, k and v of one sharded
# sequence, zigzag chunks of even length, cu_seqlens_k equal to cu_seqlens_q, NCCL's CUDA tensors.


def _check_tensors(q: Tensor, k: Tensor, v: Tensor, rank: int, ring: Ring, what: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise FlareArgumentError(f"{what}: {name} has {t.dim()} dimensions, expected {rank}")
    if not (q.dtype == k.dtype == v.dtype):
        raise FlareArgumentError(f"{what}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise FlareArgumentError(f"{what}: dtype {q.dtype} is not supported (float16, bfloat16, float32, float64)")
    if not (q.device == k.device == v.device):
        raise FlareArgumentError(f"{what}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if ring.backend == "nccl" and q.device.type != "cuda":
        raise FlareArgumentError(f"{what}: the group's backend is NCCL, which moves CUDA tensors; q is on {q.device}")
    if q.shape[-2] % k.shape[-2] != 0 or k.shape[-2] != v.shape[-2]:
        raise FlareArgumentError(f"{what}: q has {q.shape[-2]} heads, k {k.shape[-2]}, v {v.shape[-2]}: k and v need "
                         "the same head count, and q's must be a multiple of it (GQA/MQA)")
    if q.shape[-1] != k.shape[-1]:
        raise FlareArgumentError(f"{what}: q has headdim {q.shape[-1]} but k has {k.shape[-1]}")


def _options(what, q, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic, batch):
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise FlareArgumentError(f"{what}: window_size must be a pair of ints, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise FlareArgumentError(f"{what}: window_size={window_size!r}: each side is -1 (unbounded) or >= 0")
    if softcap < 0 or not math.isfinite(softcap):
        raise FlareArgumentError(f"{what}: softcap={softcap} must be finite and >= 0 (0: off)")
    if alibi_slopes is not None:
        nheads = q.shape[-2]
        if alibi_slopes.shape not in ((nheads,), (batch, nheads)):
            raise FlareArgumentError(f"{what}: alibi_slopes has shape {tuple(alibi_slopes.shape)}, expected ({nheads},) "
                             f"or ({batch}, {nheads})")
        if alibi_slopes.device != q.device:
            raise FlareArgumentError(f"{what}: alibi_slopes is on {alibi_slopes.device}, q on {q.device}")
    scale = 0.0 if softmax_scale is None else float(softmax_scale)
    return AttnOptions(softmax_scale=scale, window_left=left, window_right=0 if causal else right,
                       softcap=float(softcap), deterministic=bool(deterministic), alibi=alibi_slopes is not None)


def _slopes(alibi_slopes: Optional[Tensor]) -> Optional[Tensor]:
    return None if alibi_slopes is None else alibi_slopes.detach().to(torch.float32).contiguous()


# ---- public API ---------------------------------------------------------------------------------------


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = False,
                   softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                   softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                   return_lse: bool = False, *, zigzag: bool = True):
    """Attention over a sequence split across the ranks of `group` (default: the world), exactly as
    flash_attn_func would compute it on the whole sequence.

    q (batch, local_seqlen, nheads, headdim), k/v (batch, local_seqlen, nheads_k, headdim[_v]): this rank's
    tokens of the global sequence, as shard_sequence(x, zigzag=zigzag) gives them (zigzag: chunks r and
    2W-1-r of 2W; else chunk r of W). Every rank calls this with the same shapes and options; the backward
    pass is collective too. causal, window_size (left, right), softcap, alibi_slopes ((nheads) or (batch,
    nheads) fp32) and GQA/MQA (nheads a multiple of nheads_k) follow flash_attn_func, at global positions.
    Returns out (batch, local_seqlen, nheads, headdim_v) in q's dtype, or (out, lse) with return_lse, lse
    fp32 (batch, nheads, local_seqlen), natural log. Differentiable in q, k and v."""
    what = "ring_attention"
    ring = Ring(group)
    _check_tensors(q, k, v, 4, ring, what)
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise FlareArgumentError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: ring attention "
                         "splits one sequence, so q, k and v need the same batch and local seqlen")
    local_len = q.shape[1]
    per_rank = 2 if zigzag else 1
    if local_len % per_rank != 0:
        raise FlareArgumentError(f"{what}: local seqlen {local_len} is odd, but with zigzag=True each rank holds 2 "
                         f"chunks of the global sequence (cut into {chunk_count(ring.world_size, True)}); "
                         "shard it with shard_sequence")
    opts = _options(what, q, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic, q.shape[0])
    geometry = DenseGeometry(local_len, ring.world_size, ring.rank, zigzag, opts)
    out, lse = _RingAttention.apply(q, k, v, _slopes(alibi_slopes), geometry, ring)
    return (out, lse) if return_lse else out


def _seqlens(cu_seqlens: Tensor, name: str, total: int, what: str):
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise FlareArgumentError(f"{what}: {name} must be a 1-D tensor of batch + 1 offsets")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise FlareArgumentError(f"{what}: {name} has dtype {cu_seqlens.dtype}, expected torch.int32")
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or any(n < 0 for n in lens) or cu[-1] != total:
        raise FlareArgumentError(f"{what}: {name} = {cu} must start at 0, not decrease, and end at the token count "
                         f"{total}")
    return lens


def ring_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, group=None, causal: bool = False,
                          softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                          softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                          deterministic: bool = False, return_lse: bool = False, *, zigzag: bool = True):
    """ring_attention for a packed batch of sequences of different lengths (flash_attn_varlen_func's layout).

    q (total_local, nheads, headdim), k/v (total_local, nheads_k, headdim[_v]): this rank's tokens of every
    sequence, packed, as shard_varlen gives them; cu_seqlens_q/k int32 (batch + 1): the LOCAL offsets (each
    sequence's local length is its global length / W; the same on every rank; ring attention is
    self-attention, so cu_seqlens_k must equal cu_seqlens_q). max_seqlen_q/k: upper bounds of the local
    lengths (0: derived); flare reads the lengths themselves from cu_seqlens (on the host). With zigzag
    every local length must be even (global lengths divisible by 2W). Options as ring_attention; slopes
    (nheads) or (batch, nheads). Returns out (total_local, nheads, headdim_v), or (out, lse) with lse fp32
    (nheads, total_local).

    Without ALiBi and with window_size (-1, -1) (plain or causal), each chunk pair is one varlen call for
    the whole batch; sliding windows and ALiBi depend on each sequence's chunk length, so they run one
    call per sequence and chunk pair (correct, slower for many short sequences)."""
    what = "ring_attention_varlen"
    ring = Ring(group)
    _check_tensors(q, k, v, 3, ring, what)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise FlareArgumentError(f"{what}: q has {q.shape[0]} tokens, k {k.shape[0]}, v {v.shape[0]}: ring attention "
                         "is self-attention over sharded sequences, so they must be equal")
    lens = _seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], what)
    if _seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], what) != lens:
        raise FlareArgumentError(f"{what}: cu_seqlens_k differs from cu_seqlens_q: ring attention is self-attention, "
                         "the keys are the queries' own tokens")
    longest = max(lens, default=0)
    for name, bound in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if bound and int(bound) < longest:
            raise FlareArgumentError(f"{what}: {name}={bound} is below the longest local sequence ({longest})")
    if zigzag:
        odd = [(b, n) for b, n in enumerate(lens) if n % 2]
        if odd:
            b, n = odd[0]
            raise FlareArgumentError(f"{what}: sequence {b} has local length {n}, which is odd: with zigzag=True each "
                             f"rank holds 2 chunks of every sequence (global lengths divisible by "
                             f"{chunk_count(ring.world_size, True)}); shard with shard_varlen")
    opts = _options(what, q, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic, len(lens))
    geometry = VarlenGeometry(lens, ring.world_size, ring.rank, zigzag, opts, q.device)
    perm = geometry.permutation()
    if perm is not None:
        q, k, v = (t.index_select(0, perm) for t in (q, k, v))
    out, lse = _RingAttention.apply(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), _slopes(alibi_slopes),
                                    geometry, ring)
    out, lse = out[0], lse[0]
    if perm is not None:
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        out, lse = out.index_select(0, inverse), lse.index_select(1, inverse)
    return (out, lse) if return_lse else out
