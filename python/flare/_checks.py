"""The checks the Python layer makes itself, before it narrows a value into a C field or allocates anything.

The library validates every call (shapes, dtypes, strides, devices, options, index contents) and names the
argument, the value and the rule; ops.py asks it before allocating a call's outputs. What the library cannot
see is checked here, once, for the eager call and for the fake (meta) one alike, so torch.compile traces the
same errors an eager call raises:
  - what is lost on the way into the C structs: a Python int that does not fit an int32 field, a float that
    rounds to 0 or to infinity in an fp32 one, an index tensor of int64 values past int32 or of floats;
  - what decides the outputs' shapes before the library runs (the ranks of q, k, v), and the devices of all
    tensors of a call (a meta tensor among real ones would otherwise run the fake kernel);
  - what the Python layer does on its own (an in-place append into a cache autograd tracks, rotary tables
    given one without the other, an out= it copies the result into).
Every failure is a FlareArgumentError whose message names the argument, the value and the rule.
"""

import ctypes
import operator

import torch

from ._capi import FlareArgumentError

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def reject(message):
    raise FlareArgumentError(f"flare: {message}")


def integer(value, name):
    """value as a Python int; a float or anything else that is not an integer is rejected (int() would
    truncate 2.7 to 2)."""
    try:
        return operator.index(value)
    except TypeError:
        reject(f"{name}={value!r}: must be an integer, got {type(value).__name__}")


def int32(value, name):
    """value, checked to fit the int32 field it goes into (ctypes would wrap 2**32 to 0)."""
    value = integer(value, name)
    if not INT32_MIN <= value <= INT32_MAX:
        reject(f"{name}={value} does not fit the C ABI's int32 field ({INT32_MIN}..{INT32_MAX})")
    return value


def fp32(value):
    """value as the C ABI's fp32 fields hold it."""
    return ctypes.c_float(value).value


# The magnitudes fp32 holds as normal numbers: a value between them survives the narrowing (fast path).
FP32_TINY, FP32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def float32(value, name, zero_means):
    """value, checked to survive the fp32 field it goes into: a nonzero value that rounds to 0 would read as
    zero_means (e.g. "the default scale"), a finite one that rounds to infinity as infinity."""
    if value == 0 or FP32_TINY <= abs(value) <= FP32_MAX:
        return value
    narrowed = fp32(value)
    if narrowed == 0:
        reject(f"{name}={value!r} rounds to 0 in the C ABI's fp32 field, where 0 means {zero_means}")
    if narrowed in (float("inf"), float("-inf")) and abs(value) != float("inf"):
        reject(f"{name}={value!r} is past fp32's range (|x| <= 3.4e38) of the C ABI's field")
    return value


def rank(t, name, expected, layout):
    if not isinstance(t, torch.Tensor):
        reject(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != expected:
        reject(f"{name} has shape {tuple(t.shape)} (rank {t.dim()}) but must have rank {expected}: {layout}")


def index_dtype(t, name):
    """Index tensors cross the ABI as int32: any integer dtype is taken (values checked by index32)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        reject(f"{name} has dtype {t.dtype}: index tensors hold integers (int32, or int64 within int32's range)")


def index32(t, name):
    """t as the contiguous int32 tensor the ABI takes. A tensor of another integer dtype has its values checked
    to fit int32 first (a host read, and on CUDA a sync: pass int32 to avoid it)."""
    if t is None:
        return None
    if t.dtype != torch.int32 and t.numel():
        low, high = (int(x) for x in torch.aminmax(t))
        if low < INT32_MIN or high > INT32_MAX:
            reject(f"{name} holds {low if low < INT32_MIN else high}, past int32 ({INT32_MIN}..{INT32_MAX}): "
                   "index tensors cross the C ABI as int32")
    return t.to(torch.int32).contiguous()


def call(layout, shaped, tensors=(), index=(), int32s=(), float32s=()):
    """The checks of one op call. shaped: ((name, tensor, rank), ...), the tensors whose shapes give the
    outputs' (layout names the layout), the first one (q) setting the device; tensors: ((name, tensor or None),
    ...), the other tensor arguments; index: the same for the index tensors; int32s: ((name, value), ...);
    float32s: ((name, value, what 0 means), ...). Runs on every call: the common case costs a few comparisons."""
    first, ref, _ = shaped[0]
    device = ref.device if isinstance(ref, torch.Tensor) else None
    for name, t, expected in shaped:
        if not isinstance(t, torch.Tensor) or t.dim() != expected:
            rank(t, name, expected, layout)
        if t.device != device:
            _other_device(name, t, first, device)
    for name, t in tensors:
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != device):
            _other_device(name, t, first, device)
    for name, t in index:
        if t is not None:
            if not isinstance(t, torch.Tensor) or t.device != device:
                _other_device(name, t, first, device)
            if t.dtype != torch.int32:
                index_dtype(t, name)
    for name, value in int32s:
        if type(value) is not int or not INT32_MIN <= value <= INT32_MAX:
            int32(value, name)
    for name, value, zero_means in float32s:
        float32(value, name, zero_means)


def _other_device(name, t, first, device):
    if not isinstance(t, torch.Tensor):
        reject(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    reject(f"{name} is on {t.device} but {first} on {device}: all tensors of a call must be on one device")


def output(t, name, shape, like):
    """An out= tensor the Python layer writes the result into: exactly shape, like's dtype and device, each
    element its own memory (no stride-0 dims), and writable where autograd is on (not a leaf requiring grad).
    Checked before the work, so a wrong one costs none and is never half written."""
    if not isinstance(t, torch.Tensor):
        reject(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        reject(f"{name} has shape {tuple(t.shape)} but the result has shape {tuple(shape)}")
    if t.dtype != like.dtype:
        reject(f"{name} has dtype {t.dtype} but the result {like.dtype}: no casting into out=")
    if t.device != like.device:
        reject(f"{name} is on {t.device} but q on {like.device}")
    if any(stride == 0 and extent > 1 for stride, extent in zip(t.stride(), t.shape)):
        reject(f"{name} has strides {t.stride()}: elements that share memory (a stride-0 dim) cannot each be "
               "written")
    if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
        reject(f"{name} is a leaf that requires grad: it cannot be written in place")
