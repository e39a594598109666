"""Padding helpers with flash-attn 2.x's signatures (flash_attn.bert_padding): unpad_input, pad_input,
index_first_axis, index_put_first_axis.

unpad_input turns a padded batch (batch, seqlen, ...) plus a (batch, seqlen) mask into the varlen layout
(total, ...) that flash_attn_varlen_func takes; pad_input scatters a varlen result back.
"""

import torch
import torch.nn.functional as F

__all__ = ["unpad_input", "pad_input", "index_first_axis", "index_put_first_axis"]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen), 1/True = a real token.
    unused_mask (batch, seqlen), optional: tokens that are kept in the output (allocated) but not counted
    by seqused. Returns (hidden_states (total, ...), indices (total,) into the flattened batch*seqlen,
    cu_seqlens int32 (batch + 1), max_seqlen_in_batch (int), seqused int32 (batch))."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states (total, ...), indices (total,) from unpad_input -> (batch, seqlen, ...), zeros at
    padding."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def index_first_axis(input, indices):
    """input (first_axis, ...), indices (n,) -> input[indices] (n, ...): the rows of the flattened batch that
    unpad_input kept. Differentiable (the gradient scatters back, zeros elsewhere)."""
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """values (n, ...), indices (n,) -> (first_axis_dim, ...) with values at indices and zeros elsewhere: the
    inverse of index_first_axis. Differentiable."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)
