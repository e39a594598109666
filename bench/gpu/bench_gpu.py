#!/usr/bin/env python3
"""GPU benchmark: flare forward and backward against torch SDPA's FLASH_ATTENTION (FA2), CUDNN_ATTENTION
and EFFICIENT_ATTENTION backends, in one process, by the protocol of shared/BENCH.md.

Shapes: 16384 tokens in total (batch = 16384 / seqlen), model width 2048 (nheads = 2048 / headdim), seqlen
512 ... 16384, headdim 64 / 128 / 256, bf16, causal and not, forward and backward. Each implementation gets
fresh N(0, 1) inputs in its own layout: flare (batch, seqlen, heads, dim) as a QKV projection gives it,
each torch backend the memory order it runs fastest (TORCH_LAYOUT), and its backward dout in its output's.
Backward times the gradient of one recorded forward: flare_bwd fed flare's own out/lse (through the C ABI with params built once, as the CPU bench does),
torch through autograd (retain_graph).
Timing: triton.testing.do_bench (CUDA events, L2 flushed before every run, median) after its warm-up; or,
with --timer cudagraph, triton's do_bench_cudagraph (launch overhead removed for everyone).
FLOPs: bench/flops.py (BENCH.md: 4·b·h·sq·sk·d, halved when causal; backward 2.5x).
Ceilings of the same run: a 1 GiB device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul.
Accuracy gate before timing each shape: flare's out and dq/dk/dv on one sequence x up to 4 heads against an
fp32 reference, within 2x the error of torch's own bf16 kernel (+ one bf16 ulp); a failure is recorded
in flare's rows ("check_failed") and makes the exit status 1, but the run goes on.
Memory: fwd + bwd, causal, 1 x 16 heads x hd 128 at seqlen 8192 and 16384: peak allocated memory beyond
the inputs for flare, torch math and torch flash.

Rows follow BENCH.md's schema, plus "vs_fa2" / "vs_cudnn" on every timed row (its TFLOP/s over the peer's;
> 1 means faster than that peer) and "skipped" with the reason where a backend refused a shape.

  python3 bench/gpu/bench_gpu.py                         full run -> bench/results/gpu-fwd-bwd-<date>-<sha>.json
  python3 bench/gpu/bench_gpu.py --quick --out $OUT      a few shapes, JSON under $OUT
  python3 bench/gpu/bench_gpu.py --dry-run               no GPU: synthetic timings, exercises the JSON path
  python3 bench/gpu/bench_gpu.py --device cpu --tokens 512 --width 128 --seqlens 128 256 --headdims 64
                                                         no GPU: the real code path on the CPU backend
                                                         (perf_counter timing, no ceilings or memory run)
"""

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

from flops import attention_flops  # noqa: E402
import meta as run_meta  # noqa: E402
from table import Console, fmt  # noqa: E402

TOTAL_TOKENS = 16384
MODEL_WIDTH = 2048
SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
HEADDIMS = [64, 128, 256]
# flare-sm90 / flare-sm80: flare's forward with its CUDA path forced (arch_path; the backward has one path, so
# these rows are forward rows only); "flare" is the path flare picks (auto).
FLARE_PATHS = {"flare": "auto", "flare-sm90": "sm90", "flare-sm80": "sm80"}
IMPLS = ["flare", "flare-sm90", "flare-sm80", "torch-flash", "torch-cudnn", "torch-efficient"]
MEMORY_SEQLENS = [8192, 16384]
MEMORY_IMPLS = ["flare", "torch-math", "torch-flash"]
# Each torch backend's inputs in the memory order it runs fastest, all passed as (b, h, s, d) tensors: "bshd"
# = (b, s, h, d) storage viewed through transpose(1, 2), "bhsd" = (b, h, s, d) contiguous. Its backward gets
# dout in its own output's memory order, as the layer after it hands the gradient back. Measured on the H200
# (bench/results/gpu-layouts-2026-12-02-b1a5893.json, seqlen 512): with (b, h, s, d) contiguous inputs torch's
# FLASH_ATTENTION backward runs a copy kernel of 185-188 us per call at 16384 tokens x width 2048 (and a
# dout in another order than its output costs another 93 us); from (b, s, h, d) storage, none. cuDNN is 1-2%
# faster from (b, h, s, d) contiguous inputs.
TORCH_LAYOUT = {"torch-flash": "bshd", "torch-cudnn": "bhsd", "torch-efficient": "bhsd", "torch-math": "bhsd"}
GATE_HEADS = 4  # the accuracy gate looks at one sequence and this many heads
BF16_ULP_AT_1 = 2.0 ** -7


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
            "torch-efficient": SDPBackend.EFFICIENT_ATTENTION, "torch-math": SDPBackend.MATH}


# ---------------------------------------------------------------------------------------------------------
# implementations


class FlareAbi:
    """flare through the C ABI, params built once (the timed call is one ctypes call). Layout (b, s, h, d); k
    and v may have fewer heads (GQA), v another head dim; window (left, right) with -1 for unbounded, softcap 0
    for none; sinks an fp32 (h,) tensor or None; dropout_p 0 for none (seed and offset fixed: the same mask
    every call). backward=False: the forward alone (no backward params, dout unused)."""

    def __init__(self, q, k, v, dout, causal, arch_path="auto", window=(-1, -1), softcap=0.0, sinks=None,
                 dropout_p=0.0, backward=True):
        from flare import _capi
        lib = _capi.library()
        tv = _capi.tensor_view
        b, s, h, _ = q.shape
        self.lib, self.keep = lib, [q, k, v, dout]
        self.out = q.new_empty(b, s, h, v.shape[-1])
        self.lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        self.dq, self.dk, self.dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        stream = torch.cuda.current_stream().cuda_stream if q.is_cuda else None
        fp = lib.fwd_params()
        fp.q, fp.k, fp.v, fp.out, fp.softmax_lse = tv(q), tv(k), tv(v), tv(self.out), tv(self.lse)
        fp.attn.causal = int(causal)
        fp.attn.window_left, fp.attn.window_right = window
        fp.attn.softcap = softcap
        fp.exec.stream = stream
        if sinks is not None:
            self.keep.append(sinks)
            fp.sinks = tv(sinks)
        fp.dropout_p, fp.dropout_seed, fp.dropout_offset = dropout_p, 7, 3
        fp.arch_path = _capi.arch_path_value(arch_path)
        self._workspace(fp, lib.fwd_workspace_size(fp, False), q.device)
        self.fwd_params, self.bwd_params = fp, None
        if not backward:
            self.fwd()
            return
        bp = lib.bwd_params()
        bp.q, bp.k, bp.v, bp.out, bp.dout, bp.softmax_lse = tv(q), tv(k), tv(v), tv(self.out), tv(dout), tv(self.lse)
        bp.dq, bp.dk, bp.dv = tv(self.dq), tv(self.dk), tv(self.dv)
        bp.attn.causal = int(causal)
        bp.attn.window_left, bp.attn.window_right = window
        bp.attn.softcap = softcap
        bp.exec.stream = stream
        if sinks is not None:
            bp.sinks = tv(sinks)
        bp.dropout_p, bp.dropout_seed, bp.dropout_offset = dropout_p, 7, 3
        self._workspace(bp, lib.bwd_workspace_size(bp, False), q.device)
        self.fwd_params, self.bwd_params = fp, bp
        self.fwd()  # the backward reads out and lse: never time it on an unwritten pair

    def _workspace(self, params, nbytes, device):
        if nbytes:
            ws = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.keep.append(ws)
            params.exec.workspace, params.exec.workspace_size = ws.data_ptr(), nbytes

    def fwd(self):
        self.lib.fwd(self.fwd_params)

    def bwd(self):
        self.lib.bwd(self.bwd_params)

    def outputs(self):
        return self.out, (self.dq, self.dk, self.dv)


class Autograd:
    """An attention function through autograd: forward under no_grad, backward as the gradient of one
    recorded forward (retain_graph, so it can be timed again and again)."""

    def __init__(self, attend, q, k, v, dout):
        self.attend, self.q, self.k, self.v, self.dout = attend, q, k, v, dout
        self.graph = None

    def fwd(self):
        with torch.no_grad():
            return self.attend(self.q, self.k, self.v)

    def bwd(self):
        if self.graph is None:
            leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
            out = self.attend(*leaves)
            # the gradient in the output's own memory order (TORCH_LAYOUT)
            self.graph = (out, leaves, torch.empty_like(out).copy_(self.dout))
        out, leaves, dout = self.graph
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    def outputs(self):
        return self.fwd(), self.bwd()


def sdpa(backend, causal):
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v):  # (b, h, s, d)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attend


def flare_autograd(causal):
    import flare

    def attend(q, k, v):  # (b, s, h, d)
        return flare.flash_attn_func(q, k, v, causal=causal)
    return attend


def torch_inputs(impl, q, k, v, dout):
    """q, k, v, dout as (b, h, s, d) tensors in the memory order of torch backend `impl` (TORCH_LAYOUT), from
    flare's (b, s, h, d) tensors: views of them, or contiguous copies."""
    views = [x.transpose(1, 2) for x in (q, k, v, dout)]
    return views if TORCH_LAYOUT[impl] == "bshd" else [x.contiguous() for x in views]


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def refusal_reason(run):
    """None if run() works, else why not: the exception and the warnings torch gives for each backend."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
            synchronize()
            return None
        except (RuntimeError, torch.OutOfMemoryError) as e:
            reasons = [str(w.message).strip().splitlines()[0] for w in caught][:4]
            return "; ".join([str(e).strip().splitlines()[0]] + reasons)[:600]


# ---------------------------------------------------------------------------------------------------------
# measurement


def timer(args):
    if args.device == "cpu":
        def perf_counter_ms(fn):
            fn()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        return perf_counter_ms
    import triton.testing
    if args.timer == "cudagraph":
        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median")
    return lambda fn: triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")


def measure_ceilings(time_ms):
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: torch.mm(a, b, out=c))
    return {"copy_tbps": round(2 * nbytes / (copy_ms * 1e-3) / 1e12, 3),
            "matmul_bf16_tflops": round(2 * n ** 3 / (mm_ms * 1e-3) / 1e12, 1)}


def shape_of(seqlen, headdim, args):
    return {"batch": max(1, args.tokens // seqlen), "nheads": max(1, args.width // headdim), "seqlen_q": seqlen,
            "seqlen_k": seqlen, "headdim": headdim}


def make_row(pass_, impl, shape, causal, ms, **extra):
    row = {"pass": pass_, "impl": impl, "dtype": "bf16", "batch": shape["batch"], "seqlen_q": shape["seqlen_q"],
           "seqlen_k": shape["seqlen_k"], "nheads": shape["nheads"], "nheads_k": shape["nheads"],
           "headdim": shape["headdim"], "causal": causal, "ms": None if ms is None else round(ms, 5)}
    if ms is not None:
        flops = attention_flops(pass_, shape["batch"], shape["nheads"], shape["seqlen_q"], shape["seqlen_k"],
                                shape["headdim"], causal)
        row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
    row.update(extra)
    return row


def add_ratios(rows):
    """vs_fa2 / vs_cudnn on every timed row: its TFLOP/s over torch-flash's / torch-cudnn's for the same shape."""
    key = lambda r: (r["pass"], r["dtype"], r["batch"], r["seqlen_q"], r["seqlen_k"], r["nheads"],  # noqa: E731
                     r["nheads_k"], r["headdim"], r["causal"])
    by_shape = {}
    for r in rows:
        if "peak_mib" not in r and r.get("tflops"):
            by_shape.setdefault(key(r), {})[r["impl"]] = r["tflops"]
    for r in rows:
        peers = by_shape.get(key(r), {})
        if "peak_mib" in r or not r.get("tflops"):
            continue
        for field, peer in (("vs_fa2", "torch-flash"), ("vs_cudnn", "torch-cudnn")):
            if peers.get(peer):
                r[field] = round(r["tflops"] / peers[peer], 3)


def max_err(x, ref):
    return (x.float() - ref.float()).abs().max().item()


def accuracy_gate(flare_outputs, peer_outputs, q, k, v, dout, causal):
    """flare vs an fp32 reference on batch 0, heads [0, GATE_HEADS): returns (ok, message, errors)."""
    h = min(GATE_HEADS, q.shape[2])
    sl = (slice(0, 1), slice(None), slice(0, h))
    leaves = [x[sl].detach().float().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*leaves, is_causal=causal)  # fp32: torch picks efficient or math
    ref_grads = torch.autograd.grad(ref_out, leaves, dout[sl].float().transpose(1, 2))
    ref_out = ref_out.transpose(1, 2)
    ref_grads = [g.transpose(1, 2) for g in ref_grads]
    names = ("out", "dq", "dk", "dv")
    mine = [flare_outputs[0][sl]] + [g[sl] for g in flare_outputs[1]]
    theirs = [peer_outputs[0][sl]] + [g[sl] for g in peer_outputs[1]]
    messages, errors = [], {}
    for name, m, t, r in zip(names, mine, theirs, [ref_out] + ref_grads):
        e_mine, e_peer = max_err(m, r), max_err(t, r)
        bound = 2 * e_peer + BF16_ULP_AT_1 * max(1.0, r.abs().max().item())
        errors[name] = float(f"{e_mine:.3e}")
        if not e_mine <= bound:
            messages.append(f"{name}: flare error {e_mine:.3e} > {bound:.3e} (2 x torch's {e_peer:.3e} + 1 ulp)")
    return not messages, "; ".join(messages), errors


def run_shape(seqlen, headdim, causal, args, time_ms, table):
    shape = shape_of(seqlen, headdim, args)
    b, h, s, d = shape["batch"], shape["nheads"], seqlen, headdim
    q, k, v, dout = (torch.randn(b, s, h, d, device=args.device, dtype=torch.bfloat16) for _ in range(4))
    backends = sdpa_backends()
    runners, rows = {}, []
    for impl in args.impls:
        if impl in FLARE_PATHS:
            try:
                runner = (FlareAbi(q, k, v, dout, causal, FLARE_PATHS[impl])
                          if args.flare_via == "abi" or impl != "flare"
                          else Autograd(flare_autograd(causal), q, k, v, dout))
                runner.fwd()
                runner.bwd()
                synchronize()
                runners[impl] = runner
            except Exception as e:  # a failing flare is a result of the run, not the end of it
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:500] if str(e) else ''}"
                print(f"  FLARE FAILED hd{headdim} seqlen {seqlen} causal {causal}: {why}", flush=True)
                for pass_ in args.passes:
                    rows.append(make_row(pass_, impl, shape, causal, None, error=why))
            continue
        runner = Autograd(sdpa(backends[impl], causal), *torch_inputs(impl, q, k, v, dout))
        why = refusal_reason(runner.fwd) or refusal_reason(runner.bwd)
        if why:
            for pass_ in args.passes:
                rows.append(make_row(pass_, impl, shape, causal, None, skipped=why))
            runner.graph = None
            continue
        runners[impl] = runner

    extra = {}
    if args.check and "flare" in runners:
        peer = next((runners[p] for p in ("torch-flash", "torch-cudnn", "torch-efficient") if p in runners), None)
        if peer is not None:
            f_out = runners["flare"].outputs()
            p_out, p_grads = peer.outputs()
            p_out, p_grads = p_out.transpose(1, 2), [g.transpose(1, 2) for g in p_grads]
            ok, message, errors = accuracy_gate(f_out, (p_out, p_grads), q, k, v, dout, causal)
            extra["max_abs_err"] = errors
            if not ok:
                extra["check_failed"] = message
                print(f"  ACCURACY CHECK FAILED hd{headdim} seqlen {seqlen} causal {causal}: {message}", flush=True)
    for pass_ in args.passes:
        times = {}
        for impl, runner in runners.items():
            if impl != "flare" and impl in FLARE_PATHS and pass_ != "fwd":
                continue  # a forced path is a forward choice
            fn = runner.fwd if pass_ == "fwd" else runner.bwd
            ms = time_ms(fn)
            times[impl] = ms
            rows.append(make_row(pass_, impl, shape, causal, ms, **(extra if impl == "flare" else {})))
        table.print_row(pass_, shape, causal, times)
    for runner in runners.values():
        if isinstance(runner, Autograd):
            runner.graph = None
    return rows


def run_memory(seqlens, args):
    """Peak allocated memory of one forward + backward beyond the inputs, per implementation."""
    backends = sdpa_backends()
    rows = []
    for seqlen in seqlens:
        shape = {"batch": 1, "nheads": 16, "seqlen_q": seqlen, "seqlen_k": seqlen, "headdim": 128}
        for impl in MEMORY_IMPLS:
            gc.collect()
            torch.cuda.empty_cache()
            q, k, v, dout = (torch.randn(1, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            if impl != "flare":  # each torch backend in its memory order (TORCH_LAYOUT), made before `base`
                q, k, v, dout = torch_inputs(impl, q, k, v, dout)
            for x in (q, k, v):
                x.requires_grad_()  # leaves (views of tensors without grad, or copies): no copy in the backward
            attend = flare_autograd(True) if impl == "flare" else sdpa(backends[impl], True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                start.record()
                attend(q, k, v).backward(dout)
                end.record()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                rows.append(make_row("bwd", impl, shape, True, start.elapsed_time(end), peak_mib=round(peak, 1),
                                     memory="one forward + backward: peak allocated beyond q, k, v, dout"))
                rows[-1].pop("tflops", None)  # one cold run: a memory figure, not a speed figure
                print(f"  memory {impl:<12} seqlen {seqlen:>6}: peak +{peak:12.1f} MiB", flush=True)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                rows.append(make_row("bwd", impl, shape, True, None, skipped=str(e).splitlines()[0][:300],
                                     memory="one forward + backward: peak allocated beyond q, k, v, dout"))
                print(f"  memory {impl:<12} seqlen {seqlen:>6}: {rows[-1]['skipped']}", flush=True)
            del q, k, v, dout
    gc.collect()
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------------
# output


class Table:
    """The progress table printed while the run goes (bench/table.py's Console), TFLOP/s per implementation."""

    def __init__(self, impls):
        self.impls = impls
        self.console = Console([("pass", -4), ("hd", 4), ("causal", -6), ("seqlen", 6), ("b x h", 7), "|",
                                *((impl, 15) for impl in impls), "|", ("flare/FA2", 10), ("flare/cuDNN", 11)])

    def print_row(self, pass_, shape, causal, times):
        def tflops(ms):
            return attention_flops(pass_, shape["batch"], shape["nheads"], shape["seqlen_q"], shape["seqlen_k"],
                                   shape["headdim"], causal) / (ms * 1e-3) / 1e12
        ratios = (f"{times[peer] / times['flare']:.2f}x" if "flare" in times and peer in times else None
                  for peer in ("torch-flash", "torch-cudnn"))
        self.console.row(pass_, shape["headdim"], "yes" if causal else "no", shape["seqlen_q"],
                         f"{shape['batch']}x{shape['nheads']}",
                         *(fmt(tflops(times[i]), 1) if i in times else None for i in self.impls), *ratios)


def dry_run_rows(args):
    """Synthetic rows (no GPU): the shapes, FLOPs, ratios and JSON of a real run, with made-up times."""
    fake_tflops = {"flare": 400.0, "flare-sm90": 400.0, "flare-sm80": 330.0, "torch-flash": 320.0,
                   "torch-cudnn": 520.0, "torch-efficient": 150.0}
    rows = []
    for headdim in args.headdims:
        for causal in args.causals:
            for seqlen in args.seqlens:
                shape = shape_of(seqlen, headdim, args)
                for pass_ in args.passes:
                    for impl in args.impls:
                        if impl in FLARE_PATHS and impl != "flare" and pass_ != "fwd":
                            continue  # forward rows only, as in a real run
                        if impl == "torch-efficient" and headdim == 256 and pass_ == "bwd":
                            rows.append(make_row(pass_, impl, shape, causal, None, skipped="dry run: a refusal"))
                            continue
                        flops = attention_flops(pass_, shape["batch"], shape["nheads"], seqlen, seqlen, headdim,
                                                causal)
                        scale = 0.8 if pass_ == "bwd" else 1.0
                        ms = flops / (fake_tflops[impl] * scale * 1e12) * 1e3
                        rows.append(make_row(pass_, impl, shape, causal, ms))
    if args.memory:
        for seqlen in MEMORY_SEQLENS:
            shape = {"batch": 1, "nheads": 16, "seqlen_q": seqlen, "seqlen_k": seqlen, "headdim": 128}
            for impl, mib in (("flare", 0.004 * seqlen), ("torch-math", 0.24 * seqlen ** 2 / 2 ** 14),
                              ("torch-flash", 0.004 * seqlen)):
                rows.append(make_row("bwd", impl, shape, True, 1.0, peak_mib=round(mib, 1), memory="dry run"))
                rows[-1].pop("tflops")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="seqlen 1024 and 8192, headdim 128 (smoke run)")
    p.add_argument("--out", type=Path, help="directory for the result JSON (default bench/results; with --quick "
                   "or --dry-run build/bench)")
    p.add_argument("--headdims", type=int, nargs="+", default=HEADDIMS)
    p.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS)
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS)
    p.add_argument("--flare-via", choices=["abi", "autograd"], default="abi",
                   help="time flare through the C ABI with prebuilt params (default) or through its torch op + "
                        "autograd, as the peers are")
    p.add_argument("--timer", choices=["events", "cudagraph"], default="events")
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the accuracy gate")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--memory-seqlens", type=int, nargs="+", default=MEMORY_SEQLENS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="no GPU needed: synthetic timings, real JSON")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: check this script's code path against the CPU backend (small --tokens/--width)")
    p.add_argument("--tokens", type=int, default=TOTAL_TOKENS, help="batch = tokens // seqlen")
    p.add_argument("--width", type=int, default=MODEL_WIDTH, help="nheads = width // headdim")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.headdims, args.memory_seqlens = [1024, 8192], [128], [8192]
        args.warmup_ms, args.rep_ms = min(args.warmup_ms, 50), min(args.rep_ms, 100)
    args.causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    bad = [d for d in args.headdims if args.width % d or d % 8 or d > 256]
    if bad:
        p.error(f"head dims must divide the width {args.width}, be multiples of 8 and at most 256: {bad}")
    bad = [s for s in args.seqlens if args.tokens % s and s < args.tokens]
    if bad:
        p.error(f"seqlens below --tokens {args.tokens} must divide it (batch = tokens / seqlen): {bad}")
    if args.device == "cpu":
        args.ceilings = args.memory = False
    return args


def main(argv=None):
    args = parse_args(argv)
    run_meta.prefer_cuda_build()
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **({} if args.dry_run else run_meta.flare_meta()),
            "shapes": f"batch = {args.tokens} // seqlen, nheads = {args.width} // headdim, bf16",
            "layouts": "flare (b, s, h, d) contiguous; torch SDPA (b, h, s, d) tensors, FLASH_ATTENTION from "
                       "(b, s, h, d) storage, CUDNN_ATTENTION and EFFICIENT_ATTENTION (b, h, s, d) contiguous "
                       "(TORCH_LAYOUT); every backward's dout in its output's memory order",
            "timing": (f"triton.testing.do_bench, median, warmup {args.warmup_ms} ms, rep {args.rep_ms} ms, L2 "
                       "flushed before each run" if args.timer == "events"
                       else f"triton.testing.do_bench_cudagraph, median, rep {args.rep_ms} ms"),
            "flare_via": "C ABI, params built once" if args.flare_via == "abi" else "torch op + autograd",
            "backward": "gradient of one recorded forward (flare: flare_bwd on its own out/lse)",
            "ratios": "vs_fa2 / vs_cudnn = row TFLOP/s over torch-flash's / torch-cudnn's (> 1: faster)"}
    if args.dry_run:
        meta["dry_run"] = True
        meta["ceilings"] = {"copy_tbps": 4.2, "matmul_bf16_tflops": 700.0}
        rows = dry_run_rows(args)
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit("bench_gpu: no CUDA device (use --dry-run to exercise the script without one)")
        if args.device == "cpu":
            meta["device"] = "cpu (a check of the script, not a benchmark)"
        elif "flare" in args.impls and not meta.get("flare_has_cuda"):
            sys.exit(f"bench_gpu: libflare has no CUDA backend or was not found: {meta}")
        torch.manual_seed(args.seed)
        time_ms = timer(args)
        meta["ceilings"] = measure_ceilings(time_ms) if args.ceilings else {}
        print(f"{meta.get('device')}: ceilings {meta['ceilings']}; torch {torch.__version__}, cuDNN "
              f"{meta.get('cudnn')}; flare {meta.get('flare_version')} ({meta.get('flare_library')})")
        print(f"{meta['timing']}; flare via {meta['flare_via']}\n", flush=True)
        table = Table(args.impls)
        rows = []
        for headdim in args.headdims:
            for causal in args.causals:
                for seqlen in args.seqlens:
                    rows += run_shape(seqlen, headdim, causal, args, time_ms, table)
                    gc.collect()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
        if args.memory:
            rows += run_memory(args.memory_seqlens, args)
    add_ratios(rows)

    trial = args.quick or args.dry_run or args.device == "cpu"  # never into bench/results by default
    out_dir = args.out or (REPO / "build" / "bench" if trial else REPO / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    # A forward-only run is its own topic: it does not supersede the last run with the backward rows.
    topic = ("gpu-fwd" if args.passes == ["fwd"] else "gpu-fwd-bwd") + (
        "-dry-run" if args.dry_run else "-cpu-check" if args.device == "cpu" else "")
    path = run_meta.write_result(run_meta.default_result_path(out_dir, topic, quick=args.quick),
                                 {"meta": meta, "rows": rows})
    flare_rows = [r for r in rows if r["impl"] == "flare" and r.get("vs_fa2") and "peak_mib" not in r]
    if flare_rows:
        worst = min(flare_rows, key=lambda r: r["vs_fa2"])
        below = sum(r["vs_fa2"] < 1.0 for r in flare_rows)
        print(f"\nflare vs FA2: {len(flare_rows) - below} of {len(flare_rows)} rows >= 1.0x; worst "
              f"{worst['vs_fa2']:.2f}x ({worst['pass']} hd{worst['headdim']} seqlen {worst['seqlen_q']} "
              f"{'causal' if worst['causal'] else 'full'})")
    failed = [r for r in rows if r.get("check_failed") or r.get("error")]
    print(f"wrote {path} ({len(rows)} rows)" + (f"; {len(failed)} flare rows FAILED (accuracy check or error)"
                                                 if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
