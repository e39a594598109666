#!/usr/bin/env python3
"""CPU benchmark: flare against torch's CPU scaled_dot_product_attention and the naive way, in one process.

Implementations (BENCH.md names):
  flare      libflare.so through ctypes (python/flare/_capi.py); backward is flare_bwd fed the out/lse of
             flare's own forward.
  torch-cpu  torch.nn.functional.scaled_dot_product_attention (its CPU flash kernel); backward is the
             autograd backward of that call.
  naive      torch math in fp32, materialised: softmax(Q K^T * scale, masked) @ V, autograd for backward.
             Runs only while its estimated memory fits --naive-budget-gib; otherwise its row says so.

Shapes: BENCH.md's convention (fixed total tokens, batch = tokens / seqlen; fixed model width, nheads =
width / headdim) scaled for a small CPU: 8192 tokens and width 256 (the GPU protocol's 16384 x 2048 is
16x the work), so the largest row (seqlen 8192, batch 1) takes seconds per run, not minutes. Rows of group
"race" add many short, odd-length sequences: batch 60 x 4 heads x head dim 64 at the lengths of
FlashAttention's race-condition test (1 x 239, 239 x 1, 3 x 799, ..., 768 x 768); causal only where
seqlen_q == seqlen_k (torch's is_causal is aligned top-left, flare's bottom-right). Dtypes fp32, bf16, fp16.
All tensors are stored (batch, seqlen, nheads, headdim), the layout a QKV projection produces: flare reads
it directly, torch gets the transposed (batch, nheads, seqlen, headdim) views, as transformers passes them.

Timing: time.perf_counter around the call, one warm-up run, then the median of 3..10 runs (fewer for long
runs, about --budget-s seconds per implementation and row). Inputs are fresh N(0, 1) for every shape.
Before timing, each shape is checked: flare's out (forward) and dq/dk/dv (backward) against an fp32
reference (torch SDPA on fp32 copies); flare's error must be within 2x torch's own error plus a small
tolerance, or the run stops.

Memory: one long-context forward (seqlen 32768 by default) records peak_mib per implementation: the peak
resident set (VmHWM, reset through /proc/self/clear_refs) minus the resident set before the call, with
inputs already allocated and the output allocated inside the measured region for every implementation.

  python3 bench/cpu/bench_cpu.py                 # the full run, writes bench/results/cpu-<date>-<sha>.json
  python3 bench/cpu/bench_cpu.py --quick         # a few rows, writes build/bench/cpu-quick-<date>-<sha>.json
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "python"))  # the flare package's ctypes binding, the only one
sys.path.insert(0, str(REPO / "bench"))

import meta  # noqa: E402
from flare._capi import Flare, tensor_view  # noqa: E402
from flops import attention_flops  # noqa: E402
from table import Console, fmt  # noqa: E402

TOTAL_TOKENS = 8192
MODEL_WIDTH = 256
SEQLENS = [512, 1024, 2048, 4096, 8192]
HEADDIMS = [64, 128]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Many short, odd-length sequences: FlashAttention's race-condition test shapes (batch 60, 4 heads), group "race".
RACE_BATCH, RACE_HEADS, RACE_HEADDIM = 60, 4, 64
RACE_SEQLENS = [(1, 239), (239, 1), (3, 799), (799, 3), (1024, 128), (97, 97), (128, 128), (200, 200), (256, 256),
                (257, 257), (384, 384), (512, 512), (768, 768)]

# The long-context memory run: forward, causal, 1 x MEM_HEADS x MEM_HEADDIM, MEM_DTYPE.
MEM_SEQLEN = 32768
MEM_HEADS = 8
MEM_HEADDIM = 128
MEM_DTYPE = "bf16"

# Accuracy gate: |flare - ref| <= 2 * |torch - ref| + TOL[dtype] * max(1, max|ref|).
TOL = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 2e-3}

MIB = 1024.0 ** 2
GIB = 1024.0 ** 3


# ---------------------------------------------------------------------------------------------------------
# the three implementations


def naive_attention(q, k, v, causal):
    """(batch, seqlen, nheads, headdim) in any float dtype -> same; computed in fp32 with S materialised."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))  # (b, h, s, d)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(qf * scale, kf.transpose(-2, -1))  # (b, h, sq, sk): the n x n matrix
    if causal:
        sq, sk = scores.shape[-2:]
        hidden = torch.ones(sq, sk, dtype=torch.bool).triu_(sk - sq + 1)  # bottom-right aligned
        scores = scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    del scores
    return torch.matmul(probs, vf).transpose(1, 2).to(q.dtype)


def naive_bytes(pass_, batch, nheads, seqlen_q, seqlen_k):
    """Estimated peak extra memory of naive_attention: fp32 score-sized buffers alive at once
    (forward: scores and probabilities; backward: probabilities kept for autograd plus dP and dS, and
    the forward's own two)."""
    score_bytes = 4.0 * batch * nheads * seqlen_q * seqlen_k
    return (2 if pass_ == "fwd" else 4) * score_bytes


class FlareRunner:
    """flare forward and backward on fixed tensors; params are built once, outside the timed calls. Each call
    allocates its outputs, as a caller's would and as torch's calls do theirs (out; dq, dk, dv): on memory-bound
    shapes the first touch of a fresh output is a large part of the time. The latest ones are kept (out, dq,
    dk, dv); the backward reads the out and lse of the first forward (kept apart)."""

    def __init__(self, lib, q, k, v, dout, causal, threads):
        b, s, h, _ = q.shape
        self.lib = lib
        self.out = torch.empty_like(q)
        self.lse = torch.empty(b, h, s, dtype=torch.float32)
        self.dq, self.dk, self.dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._keep = (q, k, v, dout)  # the params hold raw pointers to these
        self.fwd_params = lib.fwd_params()
        fp = self.fwd_params
        fp.q, fp.k, fp.v = tensor_view(q), tensor_view(k), tensor_view(v)
        fp.out, fp.softmax_lse = tensor_view(self.out), tensor_view(self.lse)
        fp.attn.causal = int(causal)
        fp.exec.num_threads = threads
        self.bwd_params = lib.bwd_params()
        bp = self.bwd_params
        bp.q, bp.k, bp.v = tensor_view(q), tensor_view(k), tensor_view(v)
        bp.out, bp.dout, bp.softmax_lse = tensor_view(self.out), tensor_view(dout), tensor_view(self.lse)
        bp.dq, bp.dk, bp.dv = tensor_view(self.dq), tensor_view(self.dk), tensor_view(self.dv)
        bp.attn.causal = int(causal)
        bp.exec.num_threads = threads
        self._fwd_out = None

    def fwd(self):
        if self._fwd_out is None:  # the first forward writes the out the backward reads
            self._fwd_out = self.out
        else:
            self.out = torch.empty_like(self._fwd_out)
            self.fwd_params.out.data = self.out.data_ptr()
        self.lib.fwd(self.fwd_params)

    def bwd(self):
        self.dq, self.dk, self.dv = (torch.empty_like(x) for x in (self.dq, self.dk, self.dv))
        bp = self.bwd_params
        bp.dq.data, bp.dk.data, bp.dv.data = self.dq.data_ptr(), self.dk.data_ptr(), self.dv.data_ptr()
        self.lib.bwd(bp)


class AutogradRunner:
    """A torch attention function (b, s, h, d) -> (b, s, h, d): forward without grad, and the autograd
    backward of one recorded forward (retain_graph, so it can be timed repeatedly)."""

    def __init__(self, attend, q, k, v, dout):
        self.attend = attend
        self.q, self.k, self.v, self.dout = q, k, v, dout
        self._graph = None

    def fwd(self):
        with torch.no_grad():
            return self.attend(self.q, self.k, self.v)

    def record(self):
        leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
        self._graph = (self.attend(*leaves), leaves)

    def bwd(self):
        if self._graph is None:
            self.record()
        out, leaves = self._graph
        return torch.autograd.grad(out, leaves, self.dout, retain_graph=True)

    def release(self):
        self._graph = None


def torch_sdpa(causal):
    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal)
        return out.transpose(1, 2)
    return attend


def naive(causal):
    return lambda q, k, v: naive_attention(q, k, v, causal)


# ---------------------------------------------------------------------------------------------------------
# measurement


def time_ms(fn, max_runs, budget_s):
    """Median wall time of fn in ms after one warm-up call, and the number of timed runs (3..max_runs,
    as many as fit in about budget_s)."""
    start = time.perf_counter()
    fn()
    warm = time.perf_counter() - start
    runs = int(min(max_runs, max(3, budget_s / max(warm, 1e-9))))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, runs


def time_interleaved_ms(fns, max_runs, budget_s):
    """Median wall time in ms of each of fns (name -> callable) and the number of rounds. After one warm-up
    call each, the calls alternate round by round (3..max_runs rounds, as many as fit in about budget_s per
    callable), so that a slow phase of a shared machine falls on all of them alike rather than on whichever
    happened to be timed then."""
    warm = 0.0
    for fn in fns.values():
        start = time.perf_counter()
        fn()
        warm += time.perf_counter() - start
    rounds = int(min(max_runs, max(3, len(fns) * budget_s / max(warm, 1e-9))))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}, rounds


def proc_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_extra_mib(fn):
    """Runs fn once; returns (ms, MiB of peak resident memory above the resident set before the call)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = proc_status_kib("VmRSS")
    start = time.perf_counter()
    result = fn()
    ms = (time.perf_counter() - start) * 1e3
    peak = proc_status_kib("VmHWM")
    del result
    return ms, max(0, peak - before) / 1024.0


def max_abs_err(x, ref):
    return (x.float() - ref).abs().max().item()


def check_close(what, flare_val, torch_val, ref, dtype_name):
    """The accuracy gate (see TOL). Returns flare's and torch's errors against ref."""
    err_flare, err_torch = max_abs_err(flare_val, ref), max_abs_err(torch_val, ref)
    bound = 2.0 * err_torch + TOL[dtype_name] * max(1.0, ref.abs().max().item())
    if not err_flare <= bound:  # also catches NaN
        raise AssertionError(f"{what}: flare differs from the fp32 reference by {err_flare:.3e}, torch by "
                             f"{err_torch:.3e}; allowed {bound:.3e}")
    return err_flare, err_torch


# ---------------------------------------------------------------------------------------------------------
# one shape: check, then time every pass and implementation


def shape_of(seqlen, headdim, args):
    return {"batch": max(1, args.tokens // seqlen), "nheads": max(1, args.width // headdim),
            "seqlen_q": seqlen, "seqlen_k": seqlen, "headdim": headdim}


def race_shape(seqlen_q, seqlen_k):
    return {"batch": RACE_BATCH, "nheads": RACE_HEADS, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
            "headdim": RACE_HEADDIM, "group": "race"}


def make_row(pass_, impl, dtype_name, shape, causal, ms, **extra):
    row = {"pass": pass_, "impl": impl, "dtype": dtype_name, "batch": shape["batch"],
           "seqlen_q": shape["seqlen_q"], "seqlen_k": shape["seqlen_k"], "nheads": shape["nheads"],
           "nheads_k": shape["nheads"], "headdim": shape["headdim"], "causal": causal,
           "ms": None if ms is None else round(ms, 4)}
    if "group" in shape:
        row["group"] = shape["group"]
    if ms is not None:
        flops = attention_flops(pass_, shape["batch"], shape["nheads"], shape["seqlen_q"], shape["seqlen_k"],
                                shape["headdim"], causal)
        row["tflops"] = round(flops / (ms * 1e-3) * 1e-12, 5)
    row.update(extra)
    return row


def random_inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    b, h, d = shape["batch"], shape["nheads"], shape["headdim"]
    return [torch.randn(b, shape[n], h, d, generator=gen).to(dtype)
            for n in ("seqlen_q", "seqlen_k", "seqlen_k", "seqlen_q")]  # q, k, v, dout


def run_shape(lib, dtype_name, shape, causal, seed, args, table):
    headdim, sq, sk = shape["headdim"], shape["seqlen_q"], shape["seqlen_k"]
    dtype = DTYPES[dtype_name]
    q, k, v, dout = random_inputs(shape, dtype, seed)
    flare = FlareRunner(lib, q, k, v, dout, causal, args.threads)
    sdpa = AutogradRunner(torch_sdpa(causal), q, k, v, dout)
    ref = AutogradRunner(torch_sdpa(causal), *(x.float() for x in (q, k, v, dout)))
    runners = {"flare": flare, "torch-cpu": sdpa}
    budget = args.naive_budget_gib * GIB
    naive_fits = {p: naive_bytes(p, shape["batch"], shape["nheads"], sq, sk) <= budget
                  for p in ("fwd", "bwd")}
    if naive_fits["fwd"] or naive_fits["bwd"]:
        runners["naive"] = AutogradRunner(naive(causal), q, k, v, dout)

    # Accuracy gate before any timing.
    where = f"{dtype_name} hd{headdim} {'causal' if causal else 'full'} seqlen {sq}x{sk}"
    flare.fwd()
    flare.bwd()
    ref_out, ref_grads = ref.fwd(), ref.bwd()
    ref.release()
    errors = {"fwd": check_close(f"fwd out, {where}", flare.out, sdpa.fwd(), ref_out, dtype_name)}
    bwd_errs = [check_close(f"bwd {name}, {where}", mine, theirs, r, dtype_name)
                for name, mine, theirs, r in zip(("dq", "dk", "dv"), (flare.dq, flare.dk, flare.dv),
                                                 sdpa.bwd(), ref_grads)]
    errors["bwd"] = (max(e[0] for e in bwd_errs), max(e[1] for e in bwd_errs))
    if naive_fits["fwd"]:
        naive_err = max_abs_err(runners["naive"].fwd(), ref_out)
        if not naive_err <= 2.0 * errors["fwd"][1] + TOL[dtype_name] * max(1.0, ref_out.abs().max().item()):
            raise AssertionError(f"the naive foil is wrong: error {naive_err:.3e} at {where}")
    del ref_out, ref_grads

    rows = []
    for pass_ in ("fwd", "bwd"):
        # flare and torch are timed together, their calls alternated; the naive foil on its own after.
        paired, paired_runs = time_interleaved_ms(
            {impl: (runners[impl].fwd if pass_ == "fwd" else runners[impl].bwd) for impl in ("flare", "torch-cpu")},
            args.max_runs, args.budget_s)
        times = {}
        for impl, runner in runners.items():
            if impl == "naive" and not naive_fits[pass_]:
                need = naive_bytes(pass_, shape["batch"], shape["nheads"], sq, sk)
                rows.append(make_row(pass_, impl, dtype_name, shape, causal, None,
                                     skipped=f"needs {need / GIB:.1f} GiB (> --naive-budget-gib "
                                             f"{args.naive_budget_gib:g})"))
                continue
            fn = runner.fwd if pass_ == "fwd" else runner.bwd
            if impl in paired:
                ms, runs = paired[impl], paired_runs
            else:
                ms, runs = time_ms(fn, args.max_runs, args.budget_s)
            times[impl] = ms
            extra = {"runs": runs}
            if impl in ("flare", "torch-cpu"):
                extra["max_abs_err"] = float(f"{errors[pass_][0 if impl == 'flare' else 1]:.3e}")
            rows.append(make_row(pass_, impl, dtype_name, shape, causal, ms, **extra))
            if pass_ == "bwd" and isinstance(runner, AutogradRunner):
                runner.release()  # frees the recorded graph (the naive way's is score-sized)
        table.print_row(pass_, dtype_name, shape, causal, times)
    for runner in runners.values():
        if isinstance(runner, AutogradRunner):
            runner.release()
    return rows


def memory_shape(args):
    return {"batch": 1, "nheads": args.mem_heads, "seqlen_q": args.mem_seqlen, "seqlen_k": args.mem_seqlen,
            "headdim": args.mem_headdim}


def memory_child(args):
    """In a fresh interpreter (so that no freed-but-resident memory flatters anyone): allocate the
    inputs, then run one implementation's causal forward once and print {"ms", "peak_mib"} as JSON."""
    torch.set_num_threads(args.threads)
    shape = memory_shape(args)
    q, k, v, _ = random_inputs(shape, DTYPES[args.mem_dtype], seed=args.seed + 100000)
    impl = args.memory_child
    lib = Flare(args.lib) if impl == "flare" else None

    def run():
        if impl == "flare":
            out = torch.empty_like(q)
            lse = torch.empty(1, shape["nheads"], shape["seqlen_q"], dtype=torch.float32)
            p = lib.fwd_params()
            p.q, p.k, p.v = tensor_view(q), tensor_view(k), tensor_view(v)
            p.out, p.softmax_lse = tensor_view(out), tensor_view(lse)
            p.attn.causal = 1
            p.exec.num_threads = args.threads
            lib.fwd(p)
            return out, lse
        with torch.no_grad():
            if impl == "torch-cpu":
                return torch_sdpa(True)(q, k, v)
            return naive_attention(q, k, v, True)

    ms, mib = peak_extra_mib(run)
    print(json.dumps({"ms": ms, "peak_mib": mib}))


def run_memory(args):
    """The long-context forward: one run per implementation, each in its own process (memory_child)."""
    shape, dtype_name = memory_shape(args), args.mem_dtype
    print(f"\nmemory: forward, causal, {dtype_name}, 1 x {shape['nheads']} heads x headdim "
          f"{shape['headdim']}, seqlen {shape['seqlen_q']}: one run each in a fresh process; peak resident "
          f"memory above the inputs, output included", flush=True)
    rows = []
    need = naive_bytes("fwd", 1, shape["nheads"], shape["seqlen_q"], shape["seqlen_k"])
    for impl in ("flare", "torch-cpu", "naive"):
        if impl == "naive" and need > args.naive_budget_gib * GIB:
            skipped = f"needs {need / GIB:.1f} GiB (> --naive-budget-gib {args.naive_budget_gib:g})"
            rows.append(make_row("fwd", impl, dtype_name, shape, True, None, skipped=skipped,
                                 peak_mib_needed=round(need / MIB)))
            print(f"  {impl:<10} skipped: {skipped}", flush=True)
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", impl, "--lib", str(args.lib),
               "--threads", str(args.threads), "--seed", str(args.seed), "--mem-seqlen", str(args.mem_seqlen),
               "--mem-heads", str(args.mem_heads), "--mem-headdim", str(args.mem_headdim),
               "--mem-dtype", args.mem_dtype]
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode != 0:
            why = (f"killed by signal {-child.returncode}" if child.returncode < 0
                   else f"exit status {child.returncode}")
            raise RuntimeError(f"memory run of {impl} failed ({why}):\n{child.stderr[-3000:]}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
        rows.append(make_row("fwd", impl, dtype_name, shape, True, result["ms"],
                             peak_mib=round(result["peak_mib"], 1), runs=1))
        print(f"  {impl:<10} {result['ms']:10.1f} ms   peak +{result['peak_mib']:10.1f} MiB", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------
# output


class Table:
    """The progress table printed while the run goes (bench/table.py's Console)."""

    def __init__(self):
        self.console = Console([("pass", -4), ("dtype", -5), ("hd", 4), ("causal", -6), ("seqlen", 9), ("b x h", 7),
                                "|", ("flare ms", 10), ("torch ms", 10), ("naive ms", 10),
                                "|", ("torch/flare", 11), ("flare GF/s", 10)])

    def print_row(self, pass_, dtype_name, shape, causal, times):
        flare_ms, torch_ms = times.get("flare"), times.get("torch-cpu")
        flops = attention_flops(pass_, shape["batch"], shape["nheads"], shape["seqlen_q"], shape["seqlen_k"],
                                shape["headdim"], causal)
        sq, sk = shape["seqlen_q"], shape["seqlen_k"]
        self.console.row(pass_, dtype_name, shape["headdim"], "yes" if causal else "no", sq if sq == sk else f"{sq}x{sk}",
                         f"{shape['batch']}x{shape['nheads']}",
                         *(fmt(times.get(impl), 2) if impl in times else None
                           for impl in ("flare", "torch-cpu", "naive")),
                         f"{torch_ms / flare_ms:.2f}x" if flare_ms and torch_ms else None,
                         fmt(flops / (flare_ms * 1e-3) * 1e-9, 1) if flare_ms else None)


def default_out(quick):
    if quick:  # smoke runs stay out of bench/results
        return meta.default_result_path(REPO / "build" / "bench", "cpu", quick=True)
    return meta.default_result_path(meta.RESULTS, "cpu")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a few small rows and a small memory run (smoke test)")
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/cpu-<date>-<sha>.json)")
    p.add_argument("--lib", type=Path, default=Path(os.environ.get("FLARE_LIB",
                                                                   REPO / "build/release/src/libflare.so")))
    p.add_argument("--fma-peak", type=Path, default=REPO / "build/release/tools/fma_peak")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for flare and torch")
    p.add_argument("--tokens", type=int, default=TOTAL_TOKENS, help="batch = max(1, tokens // seqlen)")
    p.add_argument("--width", type=int, default=MODEL_WIDTH, help="nheads = width // headdim")
    p.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS)
    p.add_argument("--headdims", type=int, nargs="+", default=HEADDIMS)
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--max-runs", type=int, default=10, help="timed runs per row and implementation, at most")
    p.add_argument("--budget-s", type=float, default=5.0, help="about this many seconds of timed runs per "
                   "row and implementation (at least 3 runs)")
    p.add_argument("--naive-budget-gib", type=float, default=6.0,
                   help="run the naive way only where its estimated memory fits")
    p.add_argument("--mem-seqlen", type=int, default=MEM_SEQLEN, help="0 skips the memory run")
    p.add_argument("--mem-heads", type=int, default=MEM_HEADS)
    p.add_argument("--mem-headdim", type=int, default=MEM_HEADDIM)
    p.add_argument("--mem-dtype", choices=sorted(DTYPES), default=MEM_DTYPE)
    p.add_argument("--memory-child", choices=["flare", "torch-cpu", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--race", choices=["yes", "no", "only"], default=None,
                   help="the many-short-sequences rows (batch 60 x 4 heads, FlashAttention's race-test lengths; "
                        "default yes, no with --quick)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.race is None:
        args.race = "no" if args.quick else "yes"
    if args.quick:
        args.seqlens, args.headdims, args.causal = [512, 1024], [64], "yes"
        args.max_runs, args.budget_s = 3, 1.0
        if args.mem_seqlen == MEM_SEQLEN:
            args.mem_seqlen, args.mem_heads, args.mem_headdim = 4096, 2, 64
    return args


def main():
    args = parse_args()
    if args.memory_child:
        memory_child(args)
        return
    torch.set_num_threads(args.threads)
    if not args.lib.is_file():
        sys.exit(f"bench_cpu: {args.lib} not found: build it first (cmake --preset release && "
                 f"cmake --build build/release -j) or pass --lib")
    lib = Flare(args.lib)
    ceilings = meta.fma_ceilings(args.fma_peak)  # before anything else loads the cores
    run = {
        **meta.provenance(__file__), "device": meta.cpu_description(), "ceilings": ceilings,
        "flare_version": lib.version(), "flare_cpu_isa": lib.cpu_isa(), "torch": torch.__version__,
        "threads": args.threads,
        "shapes": f"batch = max(1, {args.tokens} // seqlen), nheads = {args.width} // headdim; group race: "
                  f"batch {RACE_BATCH} x {RACE_HEADS} heads x hd {RACE_HEADDIM} at FlashAttention's race-test "
                  f"lengths (seqlen_q x seqlen_k)",
        "timing": f"time.perf_counter, median of 3..{args.max_runs} runs after one warm-up; flare and "
                  f"torch-cpu calls alternated; every call allocates its outputs",
    }
    print(f"flare {run['flare_version']} ({run['flare_cpu_isa']}) vs torch {torch.__version__} on "
          f"{run['device']}, {args.threads} threads; ceilings {ceilings}")
    print(f"shapes: {run['shapes']}; {run['timing']}; torch/flare > 1 means flare is faster\n")

    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    table = Table()
    rows = []
    seed = args.seed
    shapes = [] if args.race == "only" else [shape_of(s, d, args) for d in args.headdims for s in args.seqlens]
    if args.race != "no":
        shapes += [race_shape(sq, sk) for (sq, sk) in RACE_SEQLENS]
    for dtype_name in args.dtypes:
        for causal in causals:
            for shape in shapes:
                if causal and shape["seqlen_q"] != shape["seqlen_k"]:
                    continue  # torch's is_causal aligns the mask top-left, flare's bottom-right: no common call
                rows += run_shape(lib, dtype_name, shape, causal, seed, args, table)
                seed += 1
    if args.mem_seqlen > 0:
        rows += run_memory(args)

    out = meta.write_result(args.out or default_out(args.quick), {"meta": run, "rows": rows})
    print(f"\nwrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
