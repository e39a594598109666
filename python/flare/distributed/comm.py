"""The ring's transport: each rank sends to the next rank of the group and receives from the previous one,
through torch.distributed point-to-point ops posted together (dist.batch_isend_irecv).

Overlap: the ops are posted before the compute that does not need their result, and waited for after it.
With NCCL they run on the process group's own communication stream (the current stream waits for it only
at wait()), so the next block travels while this one is computed; with gloo (CPU) they run on gloo's
threads. Send buffers are kept referenced until the wait, so no allocator reuses them mid-flight.
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .._capi import FlareArgumentError


class Pending:
    """Tensors in flight: wait() returns the received ones (same shapes and dtypes as those sent)."""

    def __init__(self, works, sent: Sequence[Tensor], received: List[Tensor]):
        self._works, self._sent, self._received = works, sent, received

    def wait(self) -> List[Tensor]:
        for work in self._works:
            work.wait()
        self._sent = ()
        return self._received


class Ring:
    """A process group seen as a ring: rank r sends to r + 1 and receives from r - 1 (mod world size)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("flare.distributed: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise FlareArgumentError("flare.distributed: this process is not a member of the given group")
        self.backend = str(dist.get_backend(self.group))
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)

    def source(self, step: int) -> int:
        """The group rank whose block this rank holds at ring step `step` (0: its own)."""
        return (self.rank - step) % self.world_size

    def pass_on(self, tensors: Sequence[Tensor], tag: int = 0) -> Pending:
        """Send `tensors` to the next rank and receive the previous rank's tensors of the same shapes.
        Tags tag, tag + 1, ... keep concurrent exchanges apart on backends that match by tag (gloo)."""
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group, tag + i) for i, t in enumerate(received)]
        return Pending(dist.batch_isend_irecv(ops), tensors, received)
