"""Splitting sequences across the ranks of a ring and putting them back together.

Zigzag (default): a sequence of n tokens is cut into 2W chunks of n / 2W; rank r keeps chunks r and
2W-1-r, concatenated. Under a causal mask that gives every rank the same amount of work (an early chunk,
cheap, with a late one, expensive). Contiguous (zigzag=False): W chunks, rank r keeps chunk r.
Varlen batches (packed sequences, cu_seqlens) are split sequence by sequence, each in the same way.

Only shard_sequence / shard_varlen without explicit world_size and rank, and gather_sequence, talk to
torch.distributed; the rest is plain tensor indexing.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._capi import FlareArgumentError
from .layout import chunk_count, chunk_ids, segments_index


def _world(world_size: Optional[int], rank: Optional[int], group) -> Tuple[int, int]:
    if world_size is None or rank is None:
        import torch.distributed as dist
        if world_size is not None or rank is not None:
            raise FlareArgumentError("give both world_size and rank, or neither (then they come from the group)")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: pass world_size and rank")
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size < 1 or not 0 <= rank < world_size:
        raise FlareArgumentError(f"rank {rank} is not in a world of size {world_size}")
    return int(world_size), int(rank)


def _divisible(n: int, parts: int, what: str, zigzag: bool, world_size: int):
    if n % parts:
        how = f"2 * world_size = {parts} chunks (zigzag)" if zigzag else f"world_size = {parts} chunks"
        raise FlareArgumentError(f"{what} has length {n}, which does not split into {how}: pad it to a multiple of "
                         f"{parts} (world_size {world_size})")


def shard_sequence(x: Tensor, world_size: Optional[int] = None, rank: Optional[int] = None, *, group=None,
                   zigzag: bool = True, seq_dim: int = 1) -> Tensor:
    """This rank's part of x along seq_dim (x's length there must divide into 2W chunks, or W without
    zigzag). world_size and rank default to those of `group` (torch.distributed must be initialized)."""
    world_size, rank = _world(world_size, rank, group)
    parts = chunk_count(world_size, zigzag)
    n = x.shape[seq_dim]
    _divisible(n, parts, "the sequence", zigzag, world_size)
    c = n // parts
    pieces = [x.narrow(seq_dim, i * c, c) for i in chunk_ids(world_size, rank, zigzag)]
    return torch.cat(pieces, dim=seq_dim) if len(pieces) > 1 else pieces[0]


def unshard_sequence(shards: Sequence[Tensor], *, zigzag: bool = True, seq_dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard (shards[r] from rank r): the inverse of shard_sequence."""
    world_size = len(shards)
    if world_size == 0:
        raise FlareArgumentError("unshard_sequence needs the shards of every rank, got none")
    lengths = {s.shape[seq_dim] for s in shards}
    if len(lengths) != 1:
        raise FlareArgumentError(f"shards have different lengths along dim {seq_dim}: {sorted(lengths)}")
    per_rank = 2 if zigzag else 1
    (local,) = lengths
    if local % per_rank:
        raise FlareArgumentError(f"shard length {local} is odd: a zigzag shard holds 2 equal chunks")
    c = local // per_rank
    chunks: List[Optional[Tensor]] = [None] * chunk_count(world_size, zigzag)
    for rank, shard in enumerate(shards):
        for i, chunk in enumerate(chunk_ids(world_size, rank, zigzag)):
            chunks[chunk] = shard.narrow(seq_dim, i * c, c)
    return torch.cat(chunks, dim=seq_dim)


def gather_sequence(x: Tensor, group=None, *, zigzag: bool = True, seq_dim: int = 1) -> Tensor:
    """The whole sequence on every rank, from each rank's shard x (an all_gather; not differentiable)."""
    import torch.distributed as dist
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, zigzag=zigzag, seq_dim=seq_dim)


def local_positions(seqlen: int, world_size: Optional[int] = None, rank: Optional[int] = None, *, group=None,
                    zigzag: bool = True, device=None) -> Tensor:
    """The global positions (int64) of this rank's tokens of a sequence of seqlen tokens: the position_ids
    (rotary embeddings) of its shard."""
    return shard_sequence(torch.arange(seqlen, device=device), world_size, rank, group=group, zigzag=zigzag,
                          seq_dim=0)


# ---- varlen -------------------------------------------------------------------------------------------


def _cu_list(cu_seqlens: Tensor) -> List[int]:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise FlareArgumentError("cu_seqlens must be a 1-D tensor of batch + 1 offsets")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise FlareArgumentError(f"cu_seqlens = {cu} must start at 0 and not decrease")
    return cu


def varlen_shard_index(cu_seqlens: Tensor, world_size: Optional[int] = None, rank: Optional[int] = None, *,
                       group=None, zigzag: bool = True) -> Tensor:
    """Indices (int64) of this rank's tokens in the packed global batch: its chunks of each sequence in
    order. Every sequence's length must divide into 2W chunks (W without zigzag)."""
    world_size, rank = _world(world_size, rank, group)
    cu = _cu_list(cu_seqlens)
    parts = chunk_count(world_size, zigzag)
    starts, lens = [], []
    for b, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        _divisible(hi - lo, parts, f"sequence {b}", zigzag, world_size)
        c = (hi - lo) // parts
        for chunk in chunk_ids(world_size, rank, zigzag):
            starts.append(lo + chunk * c)
            lens.append(c)
    return segments_index(starts, lens, cu_seqlens.device)


def shard_varlen(x: Tensor, cu_seqlens: Tensor, world_size: Optional[int] = None, rank: Optional[int] = None, *,
                 group=None, zigzag: bool = True) -> Tuple[Tensor, Tensor, int]:
    """This rank's part of a packed batch x (total_tokens, ...) with global offsets cu_seqlens (batch + 1).
    Returns (x_local (total_tokens / W, ...), cu_seqlens_local int32, max_seqlen_local): what
    ring_attention_varlen takes."""
    world_size, rank = _world(world_size, rank, group)
    index = varlen_shard_index(cu_seqlens, world_size, rank, zigzag=zigzag)
    cu_local = (cu_seqlens.to(torch.int64) // world_size).to(torch.int32)
    lens = (cu_local[1:] - cu_local[:-1])
    return x.index_select(0, index.to(x.device)), cu_local, int(lens.max()) if lens.numel() else 0


def unshard_varlen(shards: Sequence[Tensor], cu_seqlens: Tensor, *, zigzag: bool = True) -> Tensor:
    """The packed global batch from every rank's shard (shards[r] from rank r) and the global cu_seqlens:
    the inverse of shard_varlen."""
    world_size = len(shards)
    if world_size == 0:
        raise FlareArgumentError("unshard_varlen needs the shards of every rank, got none")
    total = _cu_list(cu_seqlens)[-1]
    first = shards[0]
    out = first.new_empty((total, *first.shape[1:]))
    for rank, shard in enumerate(shards):
        index = varlen_shard_index(cu_seqlens, world_size, rank, zigzag=zigzag).to(first.device)
        if shard.shape[0] != index.numel():
            raise FlareArgumentError(f"shard {rank} has {shard.shape[0]} tokens, expected {index.numel()}")
        out.index_copy_(0, index, shard)
    return out


def local_positions_varlen(cu_seqlens: Tensor, world_size: Optional[int] = None, rank: Optional[int] = None, *,
                           group=None, zigzag: bool = True) -> Tensor:
    """Each local token's position inside its own sequence (int64, total_tokens / W): the position_ids of a
    packed shard."""
    world_size, rank = _world(world_size, rank, group)
    index = varlen_shard_index(cu_seqlens, world_size, rank, zigzag=zigzag)
    cu = cu_seqlens.to(torch.int64).to(index.device)
    seq = torch.searchsorted(cu, index, right=True) - 1
    return index - cu[seq]
