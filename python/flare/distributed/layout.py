"""Where each rank's tokens sit in the global sequence, and the block calls of one ring step.

Zigzag (the default, for load balance under causal masks): each sequence is cut into 2W equal chunks and
rank r holds chunks r and 2W-1-r, in that order. Contiguous: W chunks, rank r holds chunk r.

The ring code works on "dense-form" tensors, tokens along dim 1: x (batch, local_len, heads, dim) and
lse (batch, heads, local_len). A varlen batch is one row of that form, (1, total_local, heads, dim), with
its tokens reordered half-major: the first chunks of every sequence, then their second chunks, so that
"chunk c of every sequence" is one contiguous, packed range (VarlenGeometry.permutation).
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import ops
from .blocks import AttnOptions, BlockPlan, attend_block, attend_block_backward, merge_partial, plan_block


def chunk_ids(world_size: int, rank: int, zigzag: bool) -> Tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in its local order."""
    return (rank, 2 * world_size - 1 - rank) if zigzag else (rank,)


def chunk_count(world_size: int, zigzag: bool) -> int:
    """How many chunks each sequence is cut into."""
    return 2 * world_size if zigzag else world_size


def segments_index(starts: Sequence[int], lengths: Sequence[int], device) -> Tensor:
    """int64 indices of the ranges [starts[i], starts[i] + lengths[i]) one after the other."""
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    shift = torch.tensor(starts, dtype=torch.int64, device=device) - (torch.cumsum(lens, 0) - lens)
    return torch.arange(int(lens.sum()), device=device) + torch.repeat_interleave(shift, lens)


class _Geometry:
    """Shared by the dense and the varlen geometries: runs a step's block calls and folds their results
    into the accumulators. Subclasses yield the calls (tasks: query slice, key slice, plan, slopes)."""

    def __init__(self, world_size: int, rank: int, zigzag: bool, opts: AttnOptions):
        self.world_size, self.rank, self.zigzag, self.opts = world_size, rank, zigzag, opts

    def _tasks(self, src: int, slopes: Optional[Tensor]):
        raise NotImplementedError

    def forward_block(self, q: Tensor, k: Tensor, v: Tensor, src: int, out_acc: Tensor, lse_acc: Tensor,
                      slopes: Optional[Tensor]) -> None:
        """Attend the local queries to the block of rank `src` (k/v), merging into out_acc / lse_acc."""
        for qs, ks, plan, unit_slopes in self._tasks(src, slopes):
            row0, out, lse = attend_block(q[:, qs], k[:, ks], v[:, ks], plan, self.opts, unit_slopes)
            rows = slice(qs.start + row0, qs.start + row0 + out.shape[1])
            merge_partial(out_acc[:, rows], lse_acc[:, :, rows], out, lse)

    def backward_block(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, src: int,
                       dq_acc: Tensor, dk_acc: Tensor, dv_acc: Tensor, slopes: Optional[Tensor]) -> None:
        """Gradients of this step's blocks, added to dq_acc (local queries) and dk_acc / dv_acc (the block)."""
        for qs, ks, plan, unit_slopes in self._tasks(src, slopes):
            row0, dq, key0, dk, dv = attend_block_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs],
                                                           lse[:, :, qs], plan, self.opts, unit_slopes)
            r, c = qs.start + row0, ks.start + key0
            dq_acc[:, r:r + dq.shape[1]] += dq
            dk_acc[:, c:c + dk.shape[1]] += dk
            dv_acc[:, c:c + dv.shape[1]] += dv


class DenseGeometry(_Geometry):
    """(batch, local_len, ...) tensors, every row of the batch one sequence of the same length."""

    def __init__(self, local_len: int, world_size: int, rank: int, zigzag: bool, opts: AttnOptions):
        super().__init__(world_size, rank, zigzag, opts)
        self.chunk_len = local_len // len(chunk_ids(world_size, rank, zigzag))

    def _tasks(self, src, slopes):
        c, opts = self.chunk_len, self.opts
        q_ids = chunk_ids(self.world_size, self.rank, self.zigzag)
        k_ids = chunk_ids(self.world_size, src, self.zigzag)
        nq, nk = len(q_ids), len(k_ids)
        plans = {(a, b): plan_block(q_ids[a] * c, c, k_ids[b] * c, c, opts.window_left, opts.window_right,
                                    opts.alibi)
                 for a in range(nq) for b in range(nk)}
        # Unmasked pairs next to each other (chunks are adjacent in memory) go in one call, without ALiBi
        # (whose distances need each pair's own geometry).
        whole = {p: (not opts.alibi and plan is not None and plan.unmasked) for p, plan in plans.items()}
        done = set()

        def task(qa, qb, ka, kb, plan=None):
            done.update((a, b) for a in range(qa, qb) for b in range(ka, kb))
            plan = plan or BlockPlan(query_rows=(qb - qa) * c, key_rows=(kb - ka) * c)
            return slice(qa * c, qb * c), slice(ka * c, kb * c), plan, slopes

        if all(whole.values()):
            yield task(0, nq, 0, nk)
            return
        if (src == self.rank and self.zigzag and not opts.alibi and opts.window_left == -1
                and opts.window_right == 0):
            # A rank's own block under a plain causal mask is one causal call on its two chunks as they lie:
            # local row i of chunk r sees the keys of chunk r up to i and none of chunk 2W-1-r, and chunk
            # 2W-1-r's rows see all of chunk r (earlier) and their own diagonal, exactly what a square
            # causal mask over the 2c local rows gives. One call instead of three.
            yield task(0, nq, 0, nk, BlockPlan(query_rows=nq * c, key_rows=nk * c, window_right=0))
            return
        for a in range(nq):
            if nk > 1 and all(whole[a, b] for b in range(nk)):
                yield task(a, a + 1, 0, nk)
        for b in range(nk):
            if nq > 1 and all(whole[a, b] and (a, b) not in done for a in range(nq)):
                yield task(0, nq, b, b + 1)
        for (a, b), plan in plans.items():
            if plan is not None and (a, b) not in done:
                yield task(a, a + 1, b, b + 1, plan)


class VarlenGeometry(_Geometry):
    """A packed batch of sequences whose local lengths are `local_lens` (the same on every rank), in the
    half-major order of `permutation`. Without ALiBi and with an unbounded window (plain or causal) a
    chunk pair is one varlen call for the whole batch, since its mask depends only on the chunks' order;
    otherwise each sequence gets its own calls (its chunk length sets its block geometry)."""

    def __init__(self, local_lens: Sequence[int], world_size: int, rank: int, zigzag: bool, opts: AttnOptions,
                 device: torch.device):
        super().__init__(world_size, rank, zigzag, opts)
        n = len(chunk_ids(world_size, rank, zigzag))
        self.chunk_lens: List[int] = [length // n for length in local_lens]
        self.offsets: List[int] = [0]
        for length in self.chunk_lens:
            self.offsets.append(self.offsets[-1] + length)
        self.half = self.offsets[-1]  # tokens in one chunk position over all sequences
        self.max_chunk = max(self.chunk_lens, default=0)
        self.cu_chunks = torch.tensor(self.offsets, dtype=torch.int32, device=device)
        self.packed = (not opts.alibi and opts.window_left == -1 and opts.window_right in (-1, 0))
        self._local_lens, self._device = list(local_lens), device

    def permutation(self) -> Optional[Tensor]:
        """Index of the half-major order into the natural packed order (None when they are the same)."""
        if not self.zigzag:
            return None
        natural_starts = [0]
        for length in self._local_lens:
            natural_starts.append(natural_starts[-1] + length)
        starts = [natural_starts[b] + c * n for c in range(2) for b, n in enumerate(self.chunk_lens)]
        return segments_index(starts, self.chunk_lens * 2, self._device)

    def _order_window(self, q_id: int, k_id: int) -> Optional[Tuple[int, int]]:
        if self.opts.window_right == -1:
            return -1, -1
        if q_id == k_id:
            return -1, 0
        return (-1, -1) if q_id > k_id else None

    def _packed_pairs(self, src):
        q_ids = chunk_ids(self.world_size, self.rank, self.zigzag)
        k_ids = chunk_ids(self.world_size, src, self.zigzag)
        h = self.half
        if h == 0:  # every sequence empty: nothing to attend
            return
        for a, qi in enumerate(q_ids):
            for b, ki in enumerate(k_ids):
                window = self._order_window(qi, ki)
                if window is not None:
                    yield slice(a * h, (a + 1) * h), slice(b * h, (b + 1) * h), window

    def _packed_call(self, q, k, v, window):
        cu, m, o = self.cu_chunks, self.max_chunk, self.opts
        return ops.fwd_eager(q, k, v, cu, cu, None, m, m, None, o.softmax_scale, False, window[0], window[1],
                             o.softcap, o.deterministic)

    def _tasks(self, src, slopes):
        opts = self.opts
        q_ids = chunk_ids(self.world_size, self.rank, self.zigzag)
        k_ids = chunk_ids(self.world_size, src, self.zigzag)
        for b, c in enumerate(self.chunk_lens):
            if c == 0:
                continue
            unit_slopes = slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes
            off = self.offsets[b]
            for a, qi in enumerate(q_ids):
                for e, ki in enumerate(k_ids):
                    plan = plan_block(qi * c, c, ki * c, c, opts.window_left, opts.window_right, opts.alibi)
                    if plan is not None:
                        qs = slice(a * self.half + off, a * self.half + off + c)
                        ks = slice(e * self.half + off, e * self.half + off + c)
                        yield qs, ks, plan, unit_slopes

    def forward_block(self, q, k, v, src, out_acc, lse_acc, slopes):
        if not self.packed:
            return super().forward_block(q, k, v, src, out_acc, lse_acc, slopes)
        for qs, ks, window in self._packed_pairs(src):
            out, lse = self._packed_call(q[0, qs], k[0, ks], v[0, ks], window)
            merge_partial(out_acc[:, qs], lse_acc[:, :, qs], out.unsqueeze(0), lse.unsqueeze(0))

    def backward_block(self, dout, q, k, v, out, lse, src, dq_acc, dk_acc, dv_acc, slopes):
        if not self.packed:
            return super().backward_block(dout, q, k, v, out, lse, src, dq_acc, dk_acc, dv_acc, slopes)
        cu, m, o = self.cu_chunks, self.max_chunk, self.opts
        for qs, ks, window in self._packed_pairs(src):
            dq, dk, dv = ops.bwd_eager(dout[0, qs], q[0, qs], k[0, ks], v[0, ks], out[0, qs], lse[0, :, qs], cu,
                                       cu, None, m, m, None, o.softmax_scale, False, window[0], window[1],
                                       o.softcap, o.deterministic)
            dq_acc[0, qs] += dq
            dk_acc[0, ks] += dk
            dv_acc[0, ks] += dv
