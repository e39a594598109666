"""Rotary position embedding in plain torch, with flash-attn 2.x's signature
(flash_attn.layers.rotary.apply_rotary_emb), for code that rotates q/k itself before calling attention.

flare's own KV-cache pass rotates in the library (flash_attn_with_kvcache's rotary_cos/rotary_sin); this is
the stand-alone function, differentiable through torch's autograd, on any device and dtype torch supports.
"""

import torch
from torch import Tensor

__all__ = ["apply_rotary_emb"]


def _positions(x: Tensor, seqlen_offsets, cu_seqlens, max_seqlen):
    """The rotary position of each token: (batch, seqlen) for a dense x, (total,) for a varlen one."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, Tensor):
            return pos + seqlen_offsets.to(device=device, dtype=torch.long).view(batch, 1)
        return pos + int(seqlen_offsets)
    if max_seqlen is None:
        raise ValueError("apply_rotary_emb: max_seqlen is required with cu_seqlens (as in flash_attn)")
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=x.shape[0])
    pos = torch.arange(x.shape[0], device=device) - cu[seq]
    if isinstance(seqlen_offsets, Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.long)[seq]
    return pos + int(seqlen_offsets)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotates the first rotary_dim = 2 * cos.shape[-1] features of x by position; the others pass through.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens int32 (batch + 1) and
    max_seqlen. cos, sin: (seqlen_ro, rotary_dim / 2), seqlen_ro covering every position used.
    interleaved=False rotates the halves (x[:r/2], x[r/2:r]) as GPT-NeoX; True the pairs (x[2i], x[2i+1]) as
    GPT-J. seqlen_offsets: an int, or a (batch,) integer tensor, added to each sequence's positions (decoding
    with a cache). inplace=True writes the result into x and returns x. Computed in fp32 for half-precision
    inputs, returned in x's dtype."""
    rotary_half = cos.shape[-1]
    rotary_dim = 2 * rotary_half
    if sin.shape != cos.shape:
        raise ValueError(f"apply_rotary_emb: cos is {tuple(cos.shape)} but sin is {tuple(sin.shape)}")
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"apply_rotary_emb: rotary_dim = 2 * cos.shape[-1] = {rotary_dim} is more than "
                         f"headdim {x.shape[-1]}")
    pos = _positions(x, seqlen_offsets, cu_seqlens, max_seqlen)
    if pos.numel() and int(pos.max()) >= cos.shape[0]:
        raise ValueError(f"apply_rotary_emb: position {int(pos.max())} needs cos/sin rows past their "
                         f"{cos.shape[0]}")
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    c = cos.to(device=x.device, dtype=compute)[pos].unsqueeze(-2)  # (..., 1, rotary_dim / 2)
    s = sin.to(device=x.device, dtype=compute)[pos].unsqueeze(-2)
    rot = x[..., :rotary_dim].to(compute)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :rotary_half], rot[..., rotary_half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = rotated
        return x
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
