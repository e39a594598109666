"""One step of the ring, one block at a time: which part of a (query chunk, key chunk) pair is visible, how
one flare call computes it exactly, and the fp32 merge of partial results through their LSE.

Positions. Ring attention is self-attention over one global sequence: global query position gi attends
global key position gj by t = gi - gj (no alignment shift, seqlen_q == seqlen_k globally). A window
(left, right), with causal folded in as right = 0 and -1 unbounded, keeps the keys with -right <= t <= left;
ALiBi adds -slope * |t|.

A block is a query chunk starting at global position q_start (q_len rows) and a key chunk starting at
k_start (k_len keys): t = i - j + D with D = q_start - k_start, i and j local. One flare call on the query
rows [0, qb) and the keys [0, kb) sees t_f = i - j + g with g = kb - qb (bottom-right alignment, see
docs/semantics.md), so t = t_f + (D - g): the global window is flare's window shifted by D - g. flare takes
no negative window side, so where a shifted side would be negative, rows (or keys) that see nothing are cut
off the call until it is 0; every window is then exact.

ALiBi needs |t_f| to match |t| too. The diagonal block has g = D (exact as it is). Every other block of an
equal-chunk split lies on one side of the diagonal, so t has one sign there and -slope*|t| is linear; the
call is arranged so that t_f has the same sign on every real row, and |t| - |t_f| is a constant whose bias
(slope * constant) moves the LSE only, added back afterwards:
  - keys after the queries (t < 0): append kb - 1 zero query rows, g = 1 - q_len, so t_f <= 0 on real rows;
  - keys before the queries (t > 0): reverse q and k/v along the sequence first (t changes sign, the window
    sides swap), then as above.
The padded rows' outputs are dropped (forward) and give zero gradients (backward: zero dout and out).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import ops


@dataclass(frozen=True)
class AttnOptions:
    """The attention options every block call shares. window_right is 0 when causal."""
    softmax_scale: float   # 0: flare's default, 1/sqrt(headdim)
    window_left: int       # -1 or >= 0
    window_right: int      # -1 or >= 0
    softcap: float
    deterministic: bool
    alibi: bool            # whether ALiBi slopes are given


@dataclass(frozen=True)
class BlockPlan:
    """One flare call for a (query chunk, key chunk) pair, in the chunks' own row numbers.

    flip: reverse q and k/v along the sequence first (the rows and keys below count in reversed order);
    query_rows / key_rows: the call uses rows [0, query_rows) and keys [0, key_rows) (the rest see nothing);
    pad_rows: zero query rows appended after them (ALiBi geometry), dropped from the result;
    window_left / window_right: flare's window for the call (-1 unbounded);
    alibi_shift: with ALiBi, lse_true = lse_flare + slope * alibi_shift on the real rows (0 otherwise).
    """
    query_rows: int
    key_rows: int
    window_left: int = -1
    window_right: int = -1
    pad_rows: int = 0
    flip: bool = False
    alibi_shift: int = 0

    @property
    def unmasked(self) -> bool:
        """A plain call on whole chunks: no mask, no padding, no reversal (ALiBi aside)."""
        return (self.window_left == -1 and self.window_right == -1 and self.pad_rows == 0 and not self.flip)


def _side(value: Optional[int]) -> int:
    return -1 if value is None else value


def _plan_window(d: int, q_len: int, k_len: int, lo: Optional[int], hi: Optional[int]) -> BlockPlan:
    """Window-only plan (or ALiBi on the diagonal, where g == d): shift the window, cut rows or keys that
    see nothing where a shifted side would be negative. lo/hi bound t (None: unbounded); the band meets the
    block (checked by the caller)."""
    qb, kb = q_len, k_len
    g = kb - qb
    left = None if hi is None else hi - d + g
    right = None if lo is None else d - g - lo
    if left is not None and left < 0:
        # rows i >= qb see no key: t >= qb - (k_len - 1) + d > hi there
        g = d - hi
        qb = kb - g
        left, right = 0, (None if lo is None else hi - lo)
    elif right is not None and right < 0:
        # keys j >= kb are seen by no row: t <= q_len - 1 - kb + d < lo there
        g = d - lo
        kb = qb + g
        left, right = (None if hi is None else hi - lo), 0
    # t_f = i - j + g lies in [1 - qb, kb - 1]: a side that covers it all is no mask at all
    if left is not None and left >= kb - 1:
        left = None
    if right is not None and right >= qb - 1:
        right = None
    return BlockPlan(query_rows=qb, key_rows=kb, window_left=_side(left), window_right=_side(right))


def _plan_alibi_off_diagonal(d: int, q_len: int, k_len: int, lo: Optional[int], hi: Optional[int],
                             flip: bool) -> BlockPlan:
    """ALiBi where every t of the block is negative (keys after queries, in the possibly reversed order):
    pad k_len - 1 zero rows so that t_f = i - j + 1 - q_len <= 0 on every real row."""
    pad = k_len - 1
    g = 1 - q_len
    t_max = d + q_len - 1                      # < 0
    assert hi is None or hi >= 0 > t_max       # window sides are >= 0: the upper edge never cuts here
    right = None if lo is None else t_max - lo  # >= 0: the band meets the block
    if right is not None and right >= q_len + pad - 1:
        right = None
    # left = 0 keeps every real row whole (t_f <= 0) and halves the padded rows' work
    return BlockPlan(query_rows=q_len, key_rows=k_len, window_left=0, window_right=_side(right),
                     pad_rows=pad, flip=flip, alibi_shift=d - g)


def plan_block(q_start: int, q_len: int, k_start: int, k_len: int, window_left: int, window_right: int,
               alibi: bool = False) -> Optional[BlockPlan]:
    """How flare computes queries [q_start, q_start + q_len) against keys [k_start, k_start + k_len) of
    one global sequence under the window (window_left, window_right) (causal: window_right = 0; -1
    unbounded) and, with alibi, ALiBi at global distances. None when no query sees any key of the block.

    With ALiBi, a block that straddles the diagonal must be aligned with it (q_start - k_start ==
    k_len - q_len, true of the diagonal blocks of an equal-chunk split); others raise ValueError."""
    if q_len <= 0 or k_len <= 0:
        return None
    d = q_start - k_start
    t_min, t_max = d - (k_len - 1), d + (q_len - 1)
    lo = None if window_right < 0 else -window_right
    hi = None if window_left < 0 else window_left
    if (lo is not None and t_max < lo) or (hi is not None and t_min > hi):
        return None
    if not alibi or d == k_len - q_len:
        plan = _plan_window(d, q_len, k_len, lo, hi)
        return plan
    if t_max < 0:
        return _plan_alibi_off_diagonal(d, q_len, k_len, lo, hi, flip=False)
    if t_min > 0:
        # reversed rows i_r = q_len-1-i, keys j_r = k_len-1-j: t_r = -t = i_r - j_r + (k_len - q_len - d)
        return _plan_alibi_off_diagonal(k_len - q_len - d, q_len, k_len,
                                        None if hi is None else -hi, None if lo is None else -lo, flip=True)
    raise ValueError(f"ALiBi block with q_start={q_start}, q_len={q_len}, k_start={k_start}, k_len={k_len} "
                     "straddles the diagonal without being aligned with it")


# ---- running a plan -----------------------------------------------------------------------------------


def _oriented(x: Tensor, flip: bool, rows: int, dim: int = 1) -> Tensor:
    if flip:
        x = x.flip(dim)
    return x.narrow(dim, 0, rows)


def _padded(x: Tensor, rows: int, dim: int = 1) -> Tensor:
    if rows == 0:
        return x
    shape = list(x.shape)
    shape[dim] = rows
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _slope_column(slopes: Tensor) -> Tensor:
    """(nheads) or (batch, nheads) fp32 slopes as a (1 or batch, nheads, 1) column for an lse."""
    s = slopes.to(torch.float32)
    return (s.unsqueeze(0) if s.dim() == 1 else s).unsqueeze(-1)


def attend_block(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, opts: AttnOptions,
                 slopes: Optional[Tensor]):
    """Forward of one block. q (batch, q_len, nheads, headdim), k/v (batch, k_len, nheads_k, headdim[_v]).
    Returns (row0, out (batch, rows, nheads, headdim_v), lse fp32 (batch, nheads, rows)): the result for
    query rows [row0, row0 + rows); the other rows see no key of the block."""
    qb, kb = plan.query_rows, plan.key_rows
    qo = _padded(_oriented(q, plan.flip, qb), plan.pad_rows)
    ko, vo = _oriented(k, plan.flip, kb), _oriented(v, plan.flip, kb)
    out, lse = ops.fwd_eager(qo, ko, vo, None, None, None, 0, 0, slopes if opts.alibi else None,
                             opts.softmax_scale, False, plan.window_left, plan.window_right, opts.softcap,
                             opts.deterministic)
    out, lse = out[:, :qb], lse[:, :, :qb]
    if plan.flip:
        out, lse = out.flip(1), lse.flip(2)
    if plan.alibi_shift:
        lse = lse + plan.alibi_shift * _slope_column(slopes)
    return (q.shape[1] - qb if plan.flip else 0), out, lse


def attend_block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          plan: BlockPlan, opts: AttnOptions, slopes: Optional[Tensor]):
    """Backward of one block with the global out and lse of the query rows (batch, q_len, ...) /
    (batch, nheads, q_len). Returns (row0, dq, key0, dk, dv): dq for query rows [row0, row0 + len), dk/dv
    for keys [key0, key0 + len); both in the input dtype."""
    qb, kb = plan.query_rows, plan.key_rows
    qo, do, oo = (_oriented(t, plan.flip, qb) for t in (q, dout, out))
    lo = _oriented(lse, plan.flip, qb, dim=2)
    if plan.alibi_shift:
        lo = lo - plan.alibi_shift * _slope_column(slopes)
    # padded rows: zero q, dout and out, lse 0 -> P <= 1 and dS = P * (dP - D) = 0: no gradient anywhere
    qo, do, oo = (_padded(t, plan.pad_rows) for t in (qo, do, oo))
    lo = _padded(lo, plan.pad_rows, dim=2)
    ko, vo = _oriented(k, plan.flip, kb), _oriented(v, plan.flip, kb)
    dq, dk, dv = ops.bwd_eager(do, qo, ko, vo, oo, lo, None, None, None, 0, 0, slopes if opts.alibi else None,
                               opts.softmax_scale, False, plan.window_left, plan.window_right, opts.softcap,
                               opts.deterministic)
    dq = dq[:, :qb]
    if plan.flip:
        dq, dk, dv = dq.flip(1), dk.flip(1), dv.flip(1)
    row0 = q.shape[1] - qb if plan.flip else 0
    key0 = k.shape[1] - kb if plan.flip else 0
    return row0, dq, key0, dk, dv


# ---- the merge ----------------------------------------------------------------------------------------


def merge_partial(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor, lse_part: Tensor) -> None:
    """Fold one partial result into the running one, in place, exactly:
        lse = log(exp(lse_acc) + exp(lse_part))
        out = (exp(lse_acc) * out_acc + exp(lse_part) * out_part) / exp(lse)
            = out_acc + w * (out_part - out_acc),  w = exp(lse_part - lse) = sigmoid(lse_part - lse_acc)
    out_acc fp32 or fp64 (batch, rows, nheads, headdim_v) and lse_acc fp32 (batch, nheads, rows) (views are fine);
    w is computed in out_acc's dtype. Rows with no visible key so far carry lse = -inf and out = 0, and stay so
    until a key shows up (both -inf: w = 0, not NaN). Five torch ops: the ring runs one merge per block, and
    at short blocks their launches are what a step costs (docs/distributed.md)."""
    acc = out_acc.dtype
    w = torch.sub(lse_part.to(acc), lse_acc.to(acc)).nan_to_num_(nan=-math.inf).sigmoid_()
    out_acc.lerp_(out_part.to(acc), w.transpose(1, 2).unsqueeze(-1))
    torch.logaddexp(lse_acc, lse_part, out=lse_acc)
