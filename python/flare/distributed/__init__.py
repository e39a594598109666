"""flare.distributed: context parallelism — ring attention over torch.distributed (docs/distributed.md).

  ring_attention, ring_attention_varlen   attention over a sequence split across a process group
  shard_sequence / unshard_sequence / gather_sequence, local_positions
  shard_varlen / unshard_varlen, local_positions_varlen, varlen_shard_index
                                          the zigzag split (rank r: chunks r and 2W-1-r of 2W) and back
  transformers                            (submodule, imports transformers lazily) attn_implementation
                                          "flare_ring" and the sharding of model inputs

Modules: ring (autograd, the ring loops, the public functions), layout (which chunks a rank holds; the
block calls of a step), blocks (one block: mask geometry, flare call, LSE merge), comm (the P2P ring),
sharding (split and join).
"""

from .ring import ring_attention, ring_attention_varlen
from .sharding import (
    gather_sequence,
    local_positions,
    local_positions_varlen,
    shard_sequence,
    shard_varlen,
    unshard_sequence,
    unshard_varlen,
    varlen_shard_index,
)

__all__ = [
    "gather_sequence",
    "local_positions",
    "local_positions_varlen",
    "ring_attention",
    "ring_attention_varlen",
    "shard_sequence",
    "shard_varlen",
    "unshard_sequence",
    "unshard_varlen",
    "varlen_shard_index",
]
