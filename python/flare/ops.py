"""PyTorch custom ops over the C ABI: flare::fwd, flare::bwd, flare::fwd_kvcache, with autograd and fake
(meta) implementations, so they work with autograd, torch.compile(fullgraph=True) and torch.export.

Outputs are allocated by torch (torch.empty) and handed to libflare as views; inputs are passed as views
too, with only the last dimension made contiguous where it is not. The backend is picked by the device of
the tensors: a CUDA tensor goes to the same entry points with exec.stream = the current torch stream, its
device made current for the call, and scratch from torch's allocator (see _run).

Layouts (FlashAttention's):
  dense   q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim[_v]),
          out (batch, seqlen_q, nheads, headdim_v), softmax_lse fp32 (batch, nheads, seqlen_q)
  varlen  q (total_q, nheads, headdim), k/v (total_k, nheads_k, ...), cu_seqlens_q/k int32 (batch + 1),
          optional seqused_k int32 (batch), softmax_lse fp32 (nheads, total_q)
  paged   varlen q with a paged cache k/v (num_blocks, block_size, nheads_k, ...) and block_table int32
          (batch, max_blocks); each sequence's key count from seqused_k, else cu_seqlens_k (forward only,
          CPU only in this release; the library reads and checks the table, Python gathers nothing)
softmax_lse is an output for callers that want it; it is not differentiable (its gradient is ignored).

sinks (fwd, fwd_kvcache): optional learnable attention sinks (GPT-OSS's s_aux), one logit per query head,
shape (nheads), any float dtype (passed to the library as fp32): exp(sinks[h]) joins every softmax
denominator of head h without a value, and softmax_lse counts it. Differentiable through flare::fwd: their
gradient, -sum over each head's rows of exp(sinks[h] - lse) * rowsum(dout * out), is formed here from the
forward's out and lse (torch ops, so on any device), in the sinks' dtype.

dropout_p, dropout_seed, dropout_offset (flare::fwd and flare::bwd): attention dropout, FlashAttention 2's
semantics; the mask is a pure function of the seed, offset and coordinates (flare.h "Dropout"), so the backward
draws the forward's again (autograd hands the three on). Seeds and offsets are 64-bit patterns; Python ints
in int64's range carry them (read modulo 2^64). On CUDA the sm80 kernels run it.

arch_path (the forward ops): which CUDA kernels run the call, "auto" (default: the sm90 kernels on a compute
capability 9.0 GPU for the calls they cover, else the sm80 ones), "sm80" or "sm90" (NotImplementedError, with
the reason, for a call the sm90 kernels cannot run). The CPU ignores it; the backward always runs the sm80
kernels, so autograd does not hand it on. docs/cuda-backend.md has the rule.
"""

import contextlib
import os
import struct
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _capi, _checks

# ---- helpers shared by the ops ------------------------------------------------------------------------


def _last_dim_contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None or t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def _attn_options(ref: Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
                  softcap: float, alibi_slopes: Optional[Tensor]):
    """A flare_attn_options; also returns the tensors the views point into (keep them alive)."""
    opts = _capi.flare_attn_options()
    opts.softmax_scale = softmax_scale  # 0 = the library's default, 1/sqrt(headdim) (_checks keeps 1e-50 from 0)
    opts.softcap = softcap
    opts.causal = int(causal)
    opts.window_left = window_left
    opts.window_right = window_right
    keep = []
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype=torch.float32).contiguous()
        keep.append(slopes)
        opts.alibi_slopes = _capi.tensor_view(slopes)
    return opts, keep


def _sinks_view(p, sinks: Optional[Tensor]):
    """p.sinks = a view of sinks as fp32 (the ABI's dtype); returns the tensor it points into (keep it alive)."""
    if sinks is None:
        return None
    sinks = sinks.detach().to(dtype=torch.float32).contiguous()
    p.sinks = _capi.tensor_view(sinks)
    return sinks


def _set_dropout(p, dropout_p: float, dropout_seed: int, dropout_offset: int):
    """The params' dropout fields; seed and offset as the 64-bit patterns of Python ints."""
    p.dropout_p = dropout_p
    p.dropout_seed = dropout_seed & 0xFFFFFFFFFFFFFFFF
    p.dropout_offset = dropout_offset & 0xFFFFFFFFFFFFFFFF


def _exec_options(ref: Tensor):
    """flare_exec_options for the device of ref: the current torch stream on CUDA; on the CPU num_threads
    stays 0, so flare picks the count (OpenMP's, OMP_NUM_THREADS, cut for small problems); flare allocates
    its own scratch."""
    ex = _capi.flare_exec_options()
    if ref.device.type == "cuda":
        ex.stream = torch.cuda.current_stream(ref.device).cuda_stream
    return ex


# Workspace bytes per problem (_capi.problem_key). flare's size query validates the params exactly as the call
# does, so asking it before every call validated every call twice; the answer depends on the problem and the
# device alone, so each problem asks once and every later call validates once, in the call itself.
_WORKSPACE_SIZES_KEPT = 1024
_workspace_sizes = {}
# The CUDA forward's plan also reads these variables at each call (the forced arch path, the test knobs of the
# sm80 forward's rows, splits and shared memory), and its workspace follows the plan: their values are part of
# a forward's key.
_FORWARD_PLAN_ENV = ("FLARE_CUDA_ARCH_PATH", "FLARE_CUDA_FWD_ROWS", "FLARE_CUDA_FWD_SPLITS", "FLARE_CUDA_SMEM_LIMIT")


def _workspace_bytes(p, entry, workspace_size, env=()):
    key = (entry.__name__, _capi.problem_key(p), env)
    nbytes = _workspace_sizes.get(key)
    if nbytes is None:
        nbytes = workspace_size(p)
        if len(_workspace_sizes) >= _WORKSPACE_SIZES_KEPT:  # shapes that keep changing: start over
            _workspace_sizes.clear()
        _workspace_sizes[key] = nbytes
    return nbytes


def _on_device(ref: Tensor):
    """ref's CUDA device made current (so a tensor on cuda:1 works whatever the current device is); nothing on
    the CPU."""
    return torch.cuda.device(ref.device) if ref.device.type == "cuda" else contextlib.nullcontext()


def _validate(ref: Tensor, entry, workspace_size, p, env=()):
    """flare's own checks of p, before the Python layer allocates the call's outputs (p holds planned views for
    them: _capi.planned_view), so a call flare refuses costs no allocation, however large its outputs would be.
    They run in flare's size query, asked once per problem (_workspace_bytes): a later call of the same problem
    is validated once, by the call itself. Returns the workspace bytes the call needs on CUDA. env: the values
    of the variables the call's plan reads, when they matter (_FORWARD_PLAN_ENV)."""
    with _on_device(ref):
        return _workspace_bytes(p, entry, workspace_size, env)


def _run(ref: Tensor, entry, nbytes, p):
    """Calls entry(p) for tensors on ref's device, with p.exec set for it (_exec_options). On CUDA the call
    runs with ref's device current, and its scratch is a workspace of nbytes (_validate) from torch's caching
    allocator: flare then allocates nothing itself, which keeps the call capturable in a CUDA graph and its
    memory visible to torch. The workspace is released when this returns; the allocator hands it out again
    only to later work on the same stream, so the kernel keeps it."""
    if not ref.is_cuda:  # the params' exec is init's: flare's thread count and scratch
        entry(p)
        return
    with torch.cuda.device(ref.device):
        p.exec = _exec_options(ref)
        workspace = None
        if nbytes:
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=ref.device)
            p.exec.workspace, p.exec.workspace_size = workspace.data_ptr(), nbytes
        entry(p)
        del workspace


def _set_index_views(p, **tensors):
    """p.<name> = a view of each index tensor given, as int32 (_checks.index32); None leaves the params' default
    (absent) in place. Returns the int32 tensors the views point into (keep them alive)."""
    keep = []
    for name, t in tensors.items():
        if t is not None:
            keep.append(_checks.index32(t, name))
            setattr(p, name, _capi.tensor_view(keep[-1]))
    return keep


def _lse_shape(q: Tensor, varlen: bool):
    if varlen:
        return (q.shape[1], q.shape[0])               # (nheads, total_q)
    return (q.shape[0], q.shape[2], q.shape[1])       # (batch, nheads, seqlen_q)


def _out_shape(q: Tensor, v: Tensor):
    return (*q.shape[:-1], v.shape[-1])


# ---- the Python layer's own checks (_checks), shared by each op and its fake ----------------------------

_DENSE = "q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim[_v])"
_VARLEN = "q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim[_v]) with cu_seqlens_q/k"
_PAGED = ("q (total_q, nheads, headdim) with cu_seqlens_q, paged k/v (num_blocks, block_size, nheads_k, "
          "headdim[_v]), block_table (batch, max_blocks), seqused_k (batch) or cu_seqlens_k (batch + 1)")
_KVCACHE = ("q (batch, seqlen_q, nheads, headdim), k_cache/v_cache (batch_cache, seqlen_cache, nheads_k, "
            "headdim[_v]) or paged (num_blocks, block_size, nheads_k, headdim[_v]), k/v new like k_cache")


def _options(softmax_scale, window_left, window_right, softcap):
    """(int32s, float32s) of _checks.call for the options every pass takes."""
    return ((("window_left", window_left), ("window_right", window_right)),
            (("softmax_scale", softmax_scale, "the default scale 1/sqrt(headdim)"),
             ("softcap", softcap, "no softcap")))


def _check_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     softmax_scale, window_left, window_right, softcap, grads=(), block_table=None, sinks=None):
    """flare::fwd's and flare::bwd's arguments (grads: bwd's ((name, tensor), ...) of dout, out, softmax_lse).
    block_table (fwd): k/v are a paged cache, rank 4; the library checks the table's contents."""
    rank, layout = (4, _DENSE) if cu_seqlens_q is None else (3, _VARLEN)
    rank_kv = rank
    if block_table is not None and cu_seqlens_q is not None:
        rank_kv, layout = 4, _PAGED
    int32s, float32s = _options(softmax_scale, window_left, window_right, softcap)
    _checks.call(layout, (("q", q, rank), ("k", k, rank_kv), ("v", v, rank_kv)),
                 (("alibi_slopes", alibi_slopes), ("sinks", sinks)) + grads,
                 (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k),
                  ("block_table", block_table)),
                 (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)) + int32s, float32s)


def _kvcache_call_passes(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                         block_table, rotary_cos, rotary_sin, num_splits, alibi_slopes, softmax_scale, window_left,
                         window_right, softcap, sinks) -> bool:
    """True when every check of _check_kvcache passes, tested straight (the common decode call costs a few
    comparisons); False leaves the verdict, and the message, to those checks."""
    if not (isinstance(q, Tensor) and isinstance(k_cache, Tensor) and isinstance(v_cache, Tensor)
            and q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4):
        return False
    return _kvcache_rest_passes(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                                block_table, rotary_cos, rotary_sin, num_splits, alibi_slopes, softmax_scale,
                                window_left, window_right, softcap, sinks)


def _kvcache_scalars_pass(num_splits, softmax_scale, window_left, window_right, softcap) -> bool:
    """The scalar arguments of a kvcache call in the ranges the op takes."""
    low, high, tiny, most = _checks.INT32_MIN, _checks.INT32_MAX, _checks.FP32_TINY, _checks.FP32_MAX
    return (type(num_splits) is int and type(window_left) is int and type(window_right) is int
            and low <= num_splits <= high and low <= window_left <= high and low <= window_right <= high
            and (softmax_scale == 0 or tiny <= abs(softmax_scale) <= most)
            and (softcap == 0 or tiny <= abs(softcap) <= most))


def _kvcache_plain_passes(q, k_cache, v_cache, cache_seqlens, num_splits, softmax_scale, window_left,
                          window_right, softcap) -> bool:
    """_kvcache_rest_passes for a call with no tensor but q, k_cache, v_cache and cache_seqlens (a plain Tensor
    or None): a decode step's usual call, checked without the loops over the other eight."""
    if q.is_cpu:
        if not (k_cache.is_cpu and v_cache.is_cpu and (cache_seqlens is None or cache_seqlens.is_cpu)):
            return False
    elif q.is_cuda:
        index = q.get_device()
        if not (k_cache.is_cuda and v_cache.is_cuda and k_cache.get_device() == index
                and v_cache.get_device() == index
                and (cache_seqlens is None or (cache_seqlens.is_cuda and cache_seqlens.get_device() == index))):
            return False
    else:
        return False
    return ((cache_seqlens is None or cache_seqlens.dtype is torch.int32)
            and _kvcache_scalars_pass(num_splits, softmax_scale, window_left, window_right, softcap))


def _kvcache_rest_passes(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                         block_table, rotary_cos, rotary_sin, num_splits, alibi_slopes, softmax_scale, window_left,
                         window_right, softcap, sinks) -> bool:
    """_kvcache_call_passes past the ranks of q, k_cache, v_cache: devices, dtypes, pairs, values."""
    if q.is_cuda:
        index = q.get_device()
        for t in (k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                  rotary_cos, rotary_sin, alibi_slopes, sinks):
            if t is not None and not (isinstance(t, Tensor) and t.is_cuda and t.get_device() == index):
                return False
    elif q.is_cpu:
        for t in (k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                  rotary_cos, rotary_sin, alibi_slopes, sinks):
            if t is not None and not (isinstance(t, Tensor) and t.is_cpu):
                return False
    else:
        return False
    for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table):
        if t is not None and t.dtype is not torch.int32:
            return False
    if (k_new is None) != (v_new is None) or (rotary_cos is None) != (rotary_sin is None):
        return False
    if k_new is not None and (k_cache.requires_grad or v_cache.requires_grad):
        return False
    return _kvcache_scalars_pass(num_splits, softmax_scale, window_left, window_right, softcap)


def _check_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                   rotary_cos, rotary_sin, num_splits, alibi_slopes, softmax_scale, window_left, window_right,
                   softcap, sinks=None):
    if _kvcache_call_passes(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                            block_table, rotary_cos, rotary_sin, num_splits, alibi_slopes, softmax_scale,
                            window_left, window_right, softcap, sinks):
        return
    int32s, float32s = _options(softmax_scale, window_left, window_right, softcap)
    _checks.call(_KVCACHE, (("q", q, 4), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)),
                 (("k_new", k_new), ("v_new", v_new), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                  ("alibi_slopes", alibi_slopes), ("sinks", sinks)),
                 (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                  ("cache_leftpad", cache_leftpad), ("block_table", block_table)),
                 (("num_splits", num_splits),) + int32s, float32s)
    appended = "k_new and v_new (the keys and values to append: flash_attn_with_kvcache's k and v)"
    for a, b, names in ((k_new, v_new, appended),
                        (rotary_cos, rotary_sin, "rotary_cos and rotary_sin")):
        if (a is None) != (b is None):
            _checks.reject(f"{names} must be given together (one of them is None)")
    # The op runs below autograd (grad mode is off in here, whatever the caller's), so a cache that requires
    # grad is refused whenever it is written, as torch refuses an in-place op on a leaf that requires grad.
    if k_new is not None:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.requires_grad:
                _checks.reject(f"{name} requires grad, but appending k_new/v_new writes it in place and the "
                               "KV-cache pass has no autograd: pass a cache that does not require grad")


# ---- forward ------------------------------------------------------------------------------------------


def fwd_eager(q: Tensor, k: Tensor, v: Tensor,
              cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
              max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
              softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
              deterministic: bool, arch_path: str = "auto",
              block_table: Optional[Tensor] = None, sinks: Optional[Tensor] = None, dropout_p: float = 0.0,
              dropout_seed: int = 0, dropout_offset: int = 0) -> Tuple[Tensor, Tensor]:
    """flare::fwd's computation called directly, without torch's custom-op dispatch (50 us less host time
    per call, 55 for bwd_eager, on a 2-core EPYC: bench/cpu/host_cost.py): no autograd, not traceable by
    torch.compile. For code that holds its own autograd and issues many calls (flare.distributed's ring);
    everything else should call fwd."""
    _check_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     softmax_scale, window_left, window_right, softcap, block_table=block_table, sinks=sinks)
    varlen = cu_seqlens_q is not None
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out_shape, lse_shape = _out_shape(q, v), _lse_shape(q, varlen)

    lib = _capi.library()
    p = lib.fwd_params()
    tv = _capi.tensor_view
    p.q, p.k, p.v = tv(q), tv(k), tv(v)
    p.out = _capi.planned_view(out_shape, q.dtype, q.device)
    p.softmax_lse = _capi.planned_view(lse_shape, torch.float32, q.device)
    index = _set_index_views(p, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                             block_table=block_table)
    p.max_seqlen_q, p.max_seqlen_k = max_seqlen_q, max_seqlen_k
    p.attn, keep = _attn_options(q, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)
    p.arch_path = _capi.arch_path_value(arch_path)
    sinks32 = _sinks_view(p, sinks)
    _set_dropout(p, dropout_p, dropout_seed, dropout_offset)
    entry = lib.fwd_varlen if varlen else lib.fwd
    env = tuple(map(os.environ.get, _FORWARD_PLAN_ENV)) if q.is_cuda else ()
    nbytes = _validate(q, entry, lambda p: lib.fwd_workspace_size(p, varlen), p, env)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    p.out.data, p.softmax_lse.data = out.data_ptr(), lse.data_ptr()  # laid out as planned
    _run(q, entry, nbytes, p)
    del keep, index, sinks32
    return out, lse


@torch.library.custom_op("flare::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
        max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
        deterministic: bool, arch_path: str = "auto", block_table: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None, dropout_p: float = 0.0, dropout_seed: int = 0,
        dropout_offset: int = 0) -> tuple[Tensor, Tensor]:
    """Forward attention; dense when cu_seqlens_q is None, else varlen (paged with block_table). Returns (out,
    softmax_lse). deterministic only matters to the backward; it is here so autograd can hand it on. arch_path:
    the CUDA kernels ("auto", "sm80", "sm90"; see the module docstring). sinks: learnable sinks (nheads).
    dropout_p/seed/offset: attention dropout (module docstring)."""
    return fwd_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     softmax_scale, causal, window_left, window_right, softcap, deterministic, arch_path,
                     block_table, sinks, dropout_p, dropout_seed, dropout_offset)


def _direct_call(tensors) -> bool:
    """Whether a call on these tensors may skip torch's custom-op dispatch (fwd_call): plain tensors (no
    subclass: FakeTensor, FunctionalTensor, DTensor, ... need the op) on the CPU or one CUDA device, none
    recording a gradient, and no tracing (torch.compile), torch function mode, dispatch mode or functorch
    transform active."""
    first = tensors[0]
    if first.device.type not in ("cpu", "cuda"):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) is not Tensor or t.device != first.device or (grad and t.requires_grad):
            return False
    return not _intercepted()


def _intercepted() -> bool:
    """Whether something would see a call through torch's op dispatch that a direct call skips: tracing
    (torch.compile), a torch function mode (a device context), a dispatch mode (FakeTensorMode, counters, ...)
    or a functorch transform (vmap, grad)."""
    return bool(torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_dispatch_stack() or torch._C._functorch.maybe_current_level() is not None)


def fwd_call(q: Tensor, k: Tensor, v: Tensor, *options) -> Tuple[Tensor, Tensor]:
    """flare::fwd (same arguments), or its computation called directly (fwd_eager) where the op would add only
    host time: when no gradient is recorded and nothing traces or intercepts the call (_direct_call). Besides
    tens of microseconds per call, that spares a process's first call torch's import of torch._dynamo (1-4 s),
    which the kernels of every torch.library.custom_op pay on first use (they are wrapped to disable dynamo).
    Both routes run the same checks, so errors are the same."""
    if _direct_call((q, k, v) + tuple(t for t in options if isinstance(t, Tensor))):
        return fwd_eager(q, k, v, *options)
    return fwd(q, k, v, *options)


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
      softmax_scale, causal, window_left, window_right, softcap, deterministic, arch_path="auto", block_table=None,
      sinks=None, dropout_p=0.0, dropout_seed=0, dropout_offset=0):
    _check_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     softmax_scale, window_left, window_right, softcap, block_table=block_table, sinks=sinks)
    _capi.arch_path_value(arch_path)  # a bad name fails when traced as it would when run
    varlen = cu_seqlens_q is not None
    out = q.new_empty(_out_shape(q, v))
    lse = q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)
    return out, lse


# ---- backward -----------------------------------------------------------------------------------------


def bwd_eager(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
              cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
              max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
              softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
              deterministic: bool, dropout_p: float = 0.0, dropout_seed: int = 0,
              dropout_offset: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """flare::bwd's computation called directly, without torch's custom-op dispatch (see fwd_eager)."""
    _check_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     softmax_scale, window_left, window_right, softcap,
                     (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
    varlen = cu_seqlens_q is not None
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out, dout = _last_dim_contiguous(out), _last_dim_contiguous(dout).to(q.dtype)
    softmax_lse = softmax_lse.contiguous()

    lib = _capi.library()
    p = lib.bwd_params()
    tv = _capi.tensor_view
    p.q, p.k, p.v, p.out, p.dout, p.softmax_lse = tv(q), tv(k), tv(v), tv(out), tv(dout), tv(softmax_lse)
    p.dq, p.dk, p.dv = (_capi.planned_view(t.shape, t.dtype, t.device) for t in (q, k, v))
    index = _set_index_views(p, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k)
    p.max_seqlen_q, p.max_seqlen_k = max_seqlen_q, max_seqlen_k
    p.deterministic = int(deterministic)
    p.attn, keep = _attn_options(q, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)
    _set_dropout(p, dropout_p, dropout_seed, dropout_offset)
    entry = lib.bwd_varlen if varlen else lib.bwd
    nbytes = _validate(q, entry, lambda p: lib.bwd_workspace_size(p, varlen), p)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    p.dq.data, p.dk.data, p.dv.data = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()  # laid out as planned
    _run(q, entry, nbytes, p)
    del keep, index
    return dq, dk, dv


@torch.library.custom_op("flare::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
        max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
        deterministic: bool, dropout_p: float = 0.0, dropout_seed: int = 0,
        dropout_offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of flare::fwd with the same options (dropout's included), from out, dout and
    softmax_lse."""
    return bwd_eager(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap,
                     deterministic, dropout_p, dropout_seed, dropout_offset)


@bwd.register_fake
def _(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
      alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, deterministic, dropout_p=0.0,
      dropout_seed=0, dropout_offset=0):
    _check_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     softmax_scale, window_left, window_right, softcap,
                     (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---- autograd: flare::fwd's derivative is flare::bwd ----------------------------------------------------

_FWD_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "alibi_slopes",
                "softmax_scale", "causal", "window_left", "window_right", "softcap", "deterministic", "arch_path",
                "block_table", "sinks", "dropout_p", "dropout_seed", "dropout_offset")


def sink_gradient(sinks: Tensor, out: Tensor, dout: Tensor, softmax_lse: Tensor) -> Tensor:
    """The gradient of sum(out * dout) by learnable sinks (nheads), from a forward's out and softmax_lse (which
    counts the sinks): dsinks[h] = -sum over head h's rows of exp(sinks[h] - lse) * rowsum(dout * out), in fp32,
    returned in sinks' dtype. Dense out (batch, seqlen_q, nheads, headdim_v) with lse (batch, nheads, seqlen_q),
    or varlen out (total_q, nheads, headdim_v) with lse (nheads, total_q)."""
    d = (dout.float() * out.float()).sum(-1)  # rowsum(dout * out): (batch, seqlen_q, nheads) or (total_q, nheads)
    s = sinks.float()
    if out.dim() == 4:
        share = torch.exp(s[None, :, None] - softmax_lse) * d.transpose(1, 2)
        grad = -share.sum(dim=(0, 2))
    else:
        grad = -(torch.exp(s[:, None] - softmax_lse) * d.transpose(0, 1)).sum(dim=1)
    return grad.to(sinks.dtype)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes, *options = inputs
    out, lse = output
    sinks = options[8] if len(options) > 8 else None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks)
    # softmax_scale, causal, window_left, window_right, softcap, deterministic; arch_path stays with the forward
    # (the backward has the sm80 kernels alone).
    ctx.scalars = (max_seqlen_q, max_seqlen_k) + tuple(options[:6])
    ctx.paged = len(options) > 7 and options[7] is not None  # block_table: the backward has no paged layout
    ctx.dropout = tuple(options[9:12]) if len(options) > 9 else (0.0, 0, 0)  # p, seed, offset
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, dlse):
    if ctx.paged:
        raise NotImplementedError("flare: the backward of a paged varlen forward (block_table) is not supported: "
                                  "the paged layout serves inference; pass varlen k/v to train through it")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, det = ctx.scalars
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, det,
                     *ctx.dropout)
    # The lse carries the sinks into dq/dk/dv; their own gradient comes from out and lse.
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[3 + _FWD_OPTIONS.index("sinks")]:
        dsinks = sink_gradient(sinks, out, dout, lse)
    grads = [None] * len(_FWD_OPTIONS)
    grads[_FWD_OPTIONS.index("sinks")] = dsinks
    return (dq, dk, dv) + tuple(grads)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---- KV-cache forward (inference; no autograd) ----------------------------------------------------------


_KV = {name: getattr(_capi.flare_kvcache_params, name).offset for name, _ in _capi.flare_kvcache_params._fields_}
_KV_ATTN = _KV["attn"]
_KV_Q, _KV_K_CACHE, _KV_V_CACHE, _KV_CACHE_SEQLENS = _KV["q"], _KV["k_cache"], _KV["v_cache"], _KV["cache_seqlens"]
assert [_KV[name] - _KV_Q for name in ("k_cache", "v_cache", "k_new", "v_new", "cache_seqlens")] == \
    [i * _capi._TENSOR_PACK.size for i in range(1, 6)]  # _capi.set_kv_views packs these six at once
_KV_OUT = _KV["out"]
_KV_ALIBI = _KV_ATTN + _capi.flare_attn_options.alibi_slopes.offset
_ADDRESS = struct.Struct("=Q")  # flare_tensor.data, at the start of the struct
assert _capi.flare_tensor.data.offset == 0
# softmax_scale, softcap, causal, window_left, window_right: the head of flare_attn_options.
_ATTN_SCALARS = struct.Struct("=ffiii")
assert _capi.flare_attn_options.window_right.offset == _ATTN_SCALARS.size - 4
# Outputs up to this many elements are allocated before the library has validated the call (a refused call then
# costs one small allocation, and writes nothing); larger ones only after (_validate).
_SMALL_OUTPUT = 1 << 20


def _int32_index(t: Optional[Tensor], name: str) -> Optional[Tensor]:
    """_checks.index32 with the common case (already contiguous int32) first."""
    if t is None or (t.dtype is torch.int32 and t.is_contiguous()):
        return t
    return _checks.index32(t, name)


def fwd_kvcache_eager(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor],
                      v_new: Optional[Tensor], cache_seqlens: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                      cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                      rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], rotary_interleaved: bool,
                      num_splits: int, alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                      window_left: int, window_right: int, softcap: float, sinks: Optional[Tensor] = None,
                      want_lse: bool = True, direct: bool = False) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """flare::fwd_kvcache's computation called directly, without torch's custom-op dispatch (see fwd_eager).
    want_lse=False: no softmax_lse is asked of the library, and None is returned for it.

    direct=True is flash_attn_with_kvcache's eager route around the op, taken only where the op would add
    nothing but tens of microseconds of host time: plain tensors (no subclass: FakeTensor, FunctionalTensor,
    DTensor, ... need the op) of ranks the op takes on the CPU or one CUDA device, nothing intercepting the call
    (_intercepted: tracing, modes, functorch transforms), and arguments that pass every check of the op
    (_kvcache_rest_passes). Otherwise it returns None, and the caller
    calls the op, whose checks name what is wrong.

    The params are packed from a copy of the library's defaults, each view written in place (_capi.set_view);
    outputs of at most _SMALL_OUTPUT elements on the CPU are allocated before the library validates the call,
    which then runs once (a decode step's host cost), others after it validated them as planned views."""
    if direct:
        if not (type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor
                and q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4):
            return None
        if (k_new is None and v_new is None and cache_batch_idx is None and cache_leftpad is None
                and block_table is None and rotary_cos is None and rotary_sin is None and alibi_slopes is None
                and sinks is None):  # a decode step's usual call: checked in fewer steps (host_cost.py)
            if not ((cache_seqlens is None or type(cache_seqlens) is Tensor) and not _intercepted()
                    and _kvcache_plain_passes(q, k_cache, v_cache, cache_seqlens, num_splits, softmax_scale,
                                              window_left, window_right, softcap)):
                return None
        else:
            for t in (k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
                      rotary_sin, alibi_slopes, sinks):
                if t is not None and type(t) is not Tensor:
                    return None
            if _intercepted():
                return None
            if not _kvcache_rest_passes(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx,
                                        cache_leftpad, block_table, rotary_cos, rotary_sin, num_splits,
                                        alibi_slopes, softmax_scale, window_left, window_right, softcap, sinks):
                return None
    else:
        _check_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                       block_table, rotary_cos, rotary_sin, num_splits, alibi_slopes, softmax_scale, window_left,
                       window_right, softcap, sinks)
    q_contiguous = q.is_contiguous()
    if not q_contiguous and q.stride(-1) != 1:
        q = _last_dim_contiguous(q)
    if k_new is not None:
        k_new, v_new = _last_dim_contiguous(k_new), _last_dim_contiguous(v_new)
    if rotary_cos is not None:
        rotary_cos, rotary_sin = _last_dim_contiguous(rotary_cos), _last_dim_contiguous(rotary_sin)
        if rotary_cos.stride() != rotary_sin.stride():  # the ABI wants one row stride
            rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    batch, seqlen_q, nheads, headdim = q.shape
    headdim_v = v_cache.shape[-1]

    lib = _capi.library()
    p = lib.kvcache_params_copy()
    view = _capi.set_view
    if cache_seqlens is not None and (cache_seqlens.dtype is not torch.int32 or not cache_seqlens.is_contiguous()):
        cache_seqlens = _checks.index32(cache_seqlens, "cache_seqlens")
    if k_new is not None or cache_seqlens is None or cache_seqlens.dim() != 1 or \
            not _capi.set_kv_views(p, _KV_Q, q, k_cache, v_cache, cache_seqlens):
        view(p, _KV_Q, q)
        view(p, _KV_K_CACHE, k_cache)
        view(p, _KV_V_CACHE, v_cache)
        if cache_seqlens is not None:
            view(p, _KV_CACHE_SEQLENS, cache_seqlens)
    if cache_batch_idx is not None:
        cache_batch_idx = _int32_index(cache_batch_idx, "cache_batch_idx")
        view(p, _KV["cache_batch_idx"], cache_batch_idx)
    if cache_leftpad is not None:
        cache_leftpad = _int32_index(cache_leftpad, "cache_leftpad")
        view(p, _KV["cache_leftpad"], cache_leftpad)
    if block_table is not None:
        block_table = _int32_index(block_table, "block_table")
        view(p, _KV["block_table"], block_table)
    if k_new is not None:
        view(p, _KV["k_new"], k_new)
        view(p, _KV["v_new"], v_new)
    if rotary_cos is not None:
        view(p, _KV["rotary_cos"], rotary_cos)
        view(p, _KV["rotary_sin"], rotary_sin)
        p.rotary_interleaved = bool(rotary_interleaved)
    if num_splits:
        p.num_splits = num_splits
    _ATTN_SCALARS.pack_into(p, _KV_ATTN, softmax_scale, softcap, bool(causal), window_left, window_right)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(dtype=torch.float32).contiguous()
        view(p, _KV_ALIBI, alibi_slopes)
    if sinks is not None:
        sinks = sinks.detach().to(dtype=torch.float32).contiguous()
        view(p, _KV["sinks"], sinks)

    nbytes = 0
    if q.is_cuda or batch * seqlen_q * nheads * headdim_v > _SMALL_OUTPUT:  # validated before allocating
        p.out = _capi.planned_view((batch, seqlen_q, nheads, headdim_v), q.dtype, q.device)
        if want_lse:
            p.softmax_lse = _capi.planned_view((batch, nheads, seqlen_q), torch.float32, q.device)
        nbytes = _validate(q, lib.fwd_kvcache, lib.kvcache_workspace_size, p)
    if headdim_v == headdim and q_contiguous:  # out is laid out as q: q's view, out's address
        out = torch.empty_like(q)
        p.out = p.q
        _ADDRESS.pack_into(p, _KV_OUT, out.data_ptr())
    else:
        out = torch.empty((batch, seqlen_q, nheads, headdim_v), dtype=q.dtype, device=q.device)
        view(p, _KV["out"], out)
    lse = None
    if want_lse:
        lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
        view(p, _KV["softmax_lse"], lse)
    if q.is_cuda:
        _run(q, lib.fwd_kvcache, nbytes, p)
    else:  # _run's CPU case, without its calls
        lib.fwd_kvcache(p)
    return out, lse  # the views pointed into the tensors above, alive until here


@torch.library.custom_op("flare::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor], v_new: Optional[Tensor],
                cache_seqlens: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], rotary_interleaved: bool,
                num_splits: int, alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                window_left: int, window_right: int, softcap: float,
                sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of q against a (dense or paged) KV cache, appending k_new/v_new to it in place first.
    Returns (out, softmax_lse). sinks: learnable sinks (nheads), as in fwd."""
    return fwd_kvcache_eager(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                             block_table, rotary_cos, rotary_sin, rotary_interleaved, num_splits, alibi_slopes,
                             softmax_scale, causal, window_left, window_right, softcap, sinks)


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
      rotary_cos, rotary_sin, rotary_interleaved, num_splits, alibi_slopes, softmax_scale, causal,
      window_left, window_right, softcap, sinks=None):
    _check_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                   rotary_cos, rotary_sin, num_splits, alibi_slopes, softmax_scale, window_left, window_right,
                   softcap, sinks)
    return q.new_empty(_out_shape(q, v_cache)), q.new_empty(_lse_shape(q, False), dtype=torch.float32)


# ---- dropout masks -------------------------------------------------------------------------------------


def dropout_mask(dropout_p: float, dropout_seed: int, dropout_offset: int, sequence: int, nheads: int,
                 seqlen_q: int, seqlen_k: int) -> Tensor:
    """The keep mask (True = kept) that a forward with these dropout arguments applies to sequence `sequence`
    (batch index, or varlen index) of a call with nheads query heads: bool (nheads, seqlen_q, seqlen_k), on the
    CPU, from flare_dropout_mask (the kernels draw the same one). For tests and S_dmask."""
    mask = torch.empty((nheads, seqlen_q, seqlen_k), dtype=torch.uint8)
    _capi.library().dropout_mask(float(dropout_p), dropout_seed & 0xFFFFFFFFFFFFFFFF,
                                 dropout_offset & 0xFFFFFFFFFFFFFFFF, sequence, nheads, seqlen_q, seqlen_k,
                                 mask.data_ptr())
    return mask.bool()


# ---- merging partial attention states (cascade attention, shared prefixes, split-KV) --------------------

_MERGE = ("out_a/out_b (batch, seqlen, nheads, headdim) with lse_a/lse_b fp32 (batch, nheads, seqlen), or varlen "
          "(total, nheads, headdim) with (nheads, total)")


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """The attention result over the union of two disjoint key sets, from each set's result and softmax_lse:
    m = max(lse_a, lse_b), out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m)),
    lse = m + log(e^(lse_a - m) + e^(lse_b - m)); a row whose two lse are -inf gets out 0 and lse -inf.
    Layouts are flare's forward outputs (see _MERGE). Returns new tensors (out, lse), out in out_a's dtype.
    CPU tensors run flare_merge_states (fp32 arithmetic, fp64 for fp64); CUDA tensors run the same formula
    as torch elementwise ops in fp32 (the C ABI's merge is CPU-only in this release). No autograd."""
    if not isinstance(out_a, Tensor) or out_a.dim() not in (3, 4):
        _checks.rank(out_a, "out_a", 4, _MERGE)
    rank = out_a.dim()
    _checks.call(_MERGE, (("out_a", out_a, rank), ("out_b", out_b, rank), ("lse_a", lse_a, rank - 1),
                          ("lse_b", lse_b, rank - 1)))
    if out_a.device.type != "cpu":
        return _merge_torch(out_a, lse_a, out_b, lse_b)
    out_a, out_b = _last_dim_contiguous(out_a), _last_dim_contiguous(out_b)
    lse_a, lse_b = _last_dim_contiguous(lse_a), _last_dim_contiguous(lse_b)
    lib = _capi.library()
    p = lib.merge_params()
    tv = _capi.tensor_view
    p.out_a, p.lse_a, p.out_b, p.lse_b = tv(out_a), tv(lse_a), tv(out_b), tv(lse_b)
    p.out = _capi.planned_view(tuple(out_a.shape), out_a.dtype, out_a.device)
    p.lse = _capi.planned_view(tuple(lse_a.shape), torch.float32, out_a.device)
    out = torch.empty(out_a.shape, dtype=out_a.dtype)
    lse = torch.empty(lse_a.shape, dtype=torch.float32)
    p.out.data, p.lse.data = out.data_ptr(), lse.data_ptr()  # laid out as planned
    lib.merge_states(p)
    return out, lse


def _merge_torch(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """merge_attention_states in torch ops (CUDA tensors): the library's formula, in fp32."""
    if out_b.shape != out_a.shape or lse_a.shape != lse_b.shape or out_b.dtype != out_a.dtype:
        _checks.reject(f"out_a {tuple(out_a.shape)} {out_a.dtype}, out_b {tuple(out_b.shape)} {out_b.dtype}, lse_a "
                       f"{tuple(lse_a.shape)}, lse_b {tuple(lse_b.shape)}: {_MERGE}, the two parts alike")
    # lse (..., nheads, seqlen) against out (..., seqlen, nheads, headdim): bring lse to out's row order.
    la = lse_a.float().transpose(-1, -2).unsqueeze(-1)
    lb = lse_b.float().transpose(-1, -2).unsqueeze(-1)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # both -inf: weights 0, not NaN
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    s = wa + wb
    out = (wa * out_a.float() + wb * out_b.float()) / torch.where(s > 0, s, torch.ones_like(s))
    lse = (m + torch.log(s)).squeeze(-1).transpose(-1, -2)
    return out.to(out_a.dtype), lse.contiguous()
