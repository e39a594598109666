#!/usr/bin/env python3
"""GPU benchmark of wide heads (head dims above 256: the sm80 tiles 384, 512 and 576, whose output and gradient
columns are split across CTAs), forward and backward, by shared/BENCH.md's protocol.

Shapes: head dims 256 (the yardstick: flare's widest head dim with a whole-row kernel), 384, 512 and MLA's 576 /
512 (query and key head dim 576, value head dim 512), seqlens 1K / 4K / 16K at 16K tokens (batch = 16384 //
seqlen), 16 heads, causal and not; and the MLA prefill shape with one key/value head (MQA, as absorbed MLA
runs). Peers: torch SDPA's EFFICIENT backend (the one torch kernel that takes these head dims, where it does)
and MATH (materialises the scores; where it fits). FlashAttention 2 and cuDNN take head dims up to 256 only.

FLOPs: forward 2 * batch * heads * seqlen_q * seqlen_k * (headdim + headdim_v), backward the same with
(3 * headdim + 2 * headdim_v), halved when causal (BENCH.md's count with the products' widths apart). Each
shape's flare output is checked before timing: the last query rows of heads 0 and 1 against an fp32 reference,
within 2x the error of the bf16 peer (EFFICIENT, else MATH) plus one bf16 ulp; the backward's dq, dk and dv of
sequence 0, head 0 likewise (MHA shapes up to 4K; EFFICIENT's gradients the peer). A failure marks flare's rows
("check_failed") and makes the exit status 1. Timing: triton's do_bench (CUDA
events, L2 flushed, median). Ceilings of the run: an 8192^3 bf16 matmul and a 1 GiB copy.

  python3 bench/gpu/bench_wide.py --out $OUT                  -> gpu-wide-<date>-<sha>.json
  python3 bench/gpu/bench_wide.py --device cpu --small        the code path on the CPU, tiny shapes, no timing
                                                              claims (checks the script without a GPU)
"""

import argparse
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "bench"), str(REPO / "python")]

import bench_gpu  # noqa: E402
import meta as run_meta  # noqa: E402

DIMS = [(256, 256), (384, 384), (512, 512), (576, 512)]
SEQLENS = [1024, 4096, 16384]
CHECK_ROWS = 128
MATH_MAX_SCORES = 2 ** 33  # MATH materialises batch x heads x seqlen^2 fp32 scores (and more): up to ~32 GiB


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for the result JSON (default bench/results)")
    p.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS)
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen")
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (a check of the script, with --device cpu)")
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--timer", choices=["events", "cudagraph"], default="events")
    args = p.parse_args(argv)
    if args.small:
        args.seqlens, args.tokens, args.nheads = [96], 192, 2
    return args


def flops(pass_, b, h, s, d, dv, causal):
    f = 2.0 * b * h * s * s * ((d + dv) if pass_ == "fwd" else (3 * d + 2 * dv))
    return f / 2 if causal else f


def reference_rows(q, k, v, causal):
    """fp32 attention of the last CHECK_ROWS query rows of heads 0 and 1 (batch 0): (rows, (2, rows, dv))."""
    s, group = q.shape[1], q.shape[2] // k.shape[2]
    rows = torch.arange(max(0, s - CHECK_ROWS), s, device=q.device)
    outs = []
    for h in range(min(2, q.shape[2])):
        qh, kh, vh = q[0, rows, h].float(), k[0, :, h // group].float(), v[0, :, h // group].float()
        scores = qh @ kh.T / math.sqrt(q.shape[-1])
        if causal:
            keys = torch.arange(s, device=q.device)
            scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ vh)
    return rows, torch.stack(outs)


def reference_grads(q, k, v, dout, causal):
    """fp32 dq, dk, dv of sequence 0, head 0 (MHA): each (s, d)."""
    leaves = [x[0, :, 0].float().detach().requires_grad_() for x in (q, k, v)]
    scores = leaves[0] @ leaves[1].T / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ leaves[2]
    return torch.autograd.grad(out, leaves, dout[0, :, 0].float())


def sdpa_runner(impl, q, k, v, causal):
    """torch SDPA backend `impl` on (b, h, s, d) inputs (K/V expanded for MQA); (callable, None) or (None, why)."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F
    backend = bench_gpu.sdpa_backends()[impl]
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    if group > 1:
        kt, vt = (x.repeat_interleave(group, dim=1) for x in (kt, vt))

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    why = bench_gpu.refusal_reason(run)
    return (run, None) if why is None else (None, why)


def run_backward(args, time_ms, log, q, k, v, causal, base):
    """Rows of the backward: flare (C ABI) and torch EFFICIENT (autograd), checked on sequence 0, head 0."""
    b, s, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    dout = torch.randn(b, s, h, dv, device=q.device, dtype=q.dtype)
    impls, extra = {}, {}
    try:
        runner = bench_gpu.FlareAbi(q, k, v, dout, causal)
        impls["flare"] = (runner.bwd, None)
    except Exception as e:
        runner = None
        impls["flare"] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}")
    peer = None
    if args.device == "cuda":
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        backend = bench_gpu.sdpa_backends()["torch-efficient"]
        group = h // hk
        qt, kt, vt, dt = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
        if group > 1:
            kt, vt = (x.repeat_interleave(group, dim=1) for x in (kt, vt))

        def attend(qq, kk, vv):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        peer = bench_gpu.Autograd(attend, qt, kt, vt, dt)
        why = bench_gpu.refusal_reason(peer.bwd)
        impls["torch-efficient"] = (peer.bwd, None) if why is None else (None, why)
    if runner is not None and hk == h and s <= 4096:
        runner.bwd()
        ref = reference_grads(q, k, v, dout, causal)
        mine = [g[0, :, 0].float() for g in (runner.dq, runner.dk, runner.dv)]
        theirs = None
        if impls.get("torch-efficient", (None,))[0] is not None:
            theirs = [g[0, 0].float() for g in peer.bwd()]
        errors = {}
        for name, r, m, t in zip(("dq", "dk", "dv"), ref, mine, theirs or [None] * 3):
            err = (m - r).abs().max().item()
            scale = max(1.0, r.abs().max().item())
            bound = (2 * (t - r).abs().max().item() if t is not None else 0.0) + 4 * bench_gpu.BF16_ULP_AT_1 * scale
            errors[name] = float(f"{err:.3e}")
            if err > bound:
                extra["check_failed"] = f"{name}: flare error {err:.3e} > {bound:.3e}"
                log(f"  ACCURACY CHECK FAILED bwd d{d}/{dv} s{s} causal={int(causal)}: {extra['check_failed']}")
        extra["max_abs_err"] = errors
    rows, times = [], {}
    for impl, (fn, note) in impls.items():
        if fn is None:
            rows.append({**base, "pass": "bwd", "impl": impl, "ms": None, "skipped": note})
            continue
        ms = time_ms(fn)
        times[impl] = ms
        row = {**base, "pass": "bwd", "impl": impl, "ms": round(ms, 5),
               "tflops": round(flops("bwd", b, h, s, d, dv, causal) / (ms * 1e-3) / 1e12, 2)}
        if impl == "flare":
            row.update(extra)
        rows.append(row)
    for r in rows:
        if r["impl"] == "flare" and r.get("ms") and "torch-efficient" in times:
            r["vs_efficient"] = round(times["torch-efficient"] / r["ms"], 3)
    cells = "  ".join(f"{impl} {flops('bwd', b, h, s, d, dv, causal) / (ms * 1e-3) / 1e12:6.1f}"
                      for impl, ms in times.items())
    log(f"{base['group']:<5} b{b} s{s} h{h}/{hk} d{d}/{dv} causal={int(causal)} bwd  TFLOP/s: {cells}")
    return rows


def run_shape(args, time_ms, log, b, s, h, hk, d, dv, causal, group):
    dev = args.device
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, dv, device=dev, dtype=torch.bfloat16)
    base = {"pass": "fwd", "group": group, "dtype": "bf16", "batch": b, "seqlen_q": s, "seqlen_k": s, "nheads": h,
            "nheads_k": hk, "headdim": d, "headdim_v": dv, "causal": causal}
    rows = run_backward(args, time_ms, log, q, k, v, causal, base) if "bwd" in args.passes else []
    if "fwd" not in args.passes:
        return rows
    impls = {}
    try:
        runner = bench_gpu.FlareAbi(q, k, v, None, causal, backward=False)
        impls["flare"] = (runner.fwd, None)
    except Exception as e:  # a failing flare is a result of the run
        runner = None
        impls["flare"] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}")
    if dev == "cuda" and d <= 256:  # the yardstick's sm80 kernel too (auto runs the sm90 forward there on Hopper)
        try:
            impls["flare-sm80"] = (bench_gpu.FlareAbi(q, k, v, None, causal, "sm80", backward=False).fwd, None)
        except Exception as e:
            impls["flare-sm80"] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}")
    if dev == "cuda":
        impls["torch-efficient"] = sdpa_runner("torch-efficient", q, k, v, causal)
        if b * h * s * s <= MATH_MAX_SCORES:
            impls["torch-math"] = sdpa_runner("torch-math", q, k, v, causal)
        else:
            impls["torch-math"] = (None, f"not run: {b * h} x {s}^2 materialised scores")
    extra = {}
    if runner is not None:
        runner.fwd()
        peer = None
        for name in ("torch-efficient", "torch-math"):
            if impls.get(name, (None,))[0] is not None:
                peer = impls[name][0]().transpose(1, 2)
                break
        rows_idx, ref = reference_rows(q, k, v, causal)
        nh = ref.shape[0]
        err = (runner.out[0, rows_idx, :nh].transpose(0, 1).float() - ref).abs().max().item()
        scale = max(1.0, ref.abs().max().item())
        if peer is None:
            bound, peer_err = bench_gpu.BF16_ULP_AT_1 * 4 * scale, None
        else:
            peer_err = (peer[0, rows_idx, :nh].transpose(0, 1).float() - ref).abs().max().item()
            bound = 2 * peer_err + bench_gpu.BF16_ULP_AT_1 * scale
        extra["max_abs_err"] = {"flare": float(f"{err:.3e}"),
                                "peer": None if peer_err is None else float(f"{peer_err:.3e}")}
        if err > bound:
            extra["check_failed"] = f"flare error {err:.3e} > {bound:.3e}"
            log(f"  ACCURACY CHECK FAILED d{d}/{dv} s{s} causal={int(causal)}: {extra['check_failed']}")
        del peer
    times = {}
    for impl, (fn, note) in impls.items():
        if fn is None:
            rows.append({**base, "impl": impl, "ms": None, "skipped": note})
            continue
        ms = time_ms(fn)
        times[impl] = ms
        row = {**base, "impl": impl, "ms": round(ms, 5),
               "tflops": round(flops("fwd", b, h, s, d, dv, causal) / (ms * 1e-3) / 1e12, 2)}
        if impl == "flare":
            row.update(extra)
        rows.append(row)
    for r in rows:
        if r["pass"] == "fwd" and r["impl"] == "flare" and r.get("ms"):
            for field, peer in (("vs_efficient", "torch-efficient"), ("vs_math", "torch-math")):
                if peer in times:
                    r[field] = round(times[peer] / r["ms"], 3)
    cells = "  ".join(f"{impl} {flops('fwd', b, h, s, d, dv, causal) / (ms * 1e-3) / 1e12:6.1f}"
                      for impl, ms in times.items())
    log(f"{group:<5} b{b} s{s} h{h}/{hk} d{d}/{dv} causal={int(causal)}  TFLOP/s: {cells}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    run_meta.prefer_cuda_build()
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(),
            "flops": "fwd 2 * b * h * sq * sk * (headdim + headdim_v), bwd 2 * b * h * sq * sk * (3 * headdim + "
                     "2 * headdim_v), halved when causal",
            "layouts": "flare (b, s, h, d); torch SDPA (b, h, s, d) contiguous, K/V expanded to h heads for MQA",
            "timer": "perf_counter median (CPU)" if args.device == "cpu" else f"triton {args.timer}, median"}
    torch.manual_seed(0)
    time_ms = bench_gpu.timer(args)
    if args.device == "cuda":
        meta["ceilings"] = bench_gpu.measure_ceilings(time_ms)
        print(f"ceilings: {meta['ceilings']}", flush=True)
    dims = DIMS if not args.small else [(64, 64), (320, 320), (576, 512)]
    log = lambda m: print(m, flush=True)  # noqa: E731
    rows = []
    for d, dv in dims:
        for s in args.seqlens:
            for causal in (False, True):
                rows += run_shape(args, time_ms, log, max(1, args.tokens // s), s, args.nheads, args.nheads, d, dv,
                                  causal, "mha")
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    # MLA prefill as absorbed MLA runs it: 576 / 512 with one key/value head.
    for s in args.seqlens:
        rows += run_shape(args, time_ms, log, max(1, args.tokens // s), s, args.nheads, 1, *dims[-1], True, "mqa")
    # The share of the run's matmul ceiling, and the rate against head dim 256's same shape: flare on auto
    # (the sm90 forward on Hopper) and the sm80 kernels (the family the wide tiles belong to; the backward is
    # sm80's on either).
    for r in rows:
        if r["impl"] == "flare" and r.get("tflops") and "ceilings" in meta:
            r["of_matmul"] = round(r["tflops"] / meta["ceilings"]["matmul_bf16_tflops"], 3)
        if r["impl"] != "flare" or not r.get("tflops") or r["headdim"] == dims[0][0]:
            continue
        for field, impl in (("vs_hd256_tflops", "flare"), ("vs_hd256_sm80_tflops", "flare-sm80")):
            yard = [x for x in rows if x["headdim"] == dims[0][0] and x.get("tflops") and x["group"] == "mha"
                    and x["seqlen_q"] == r["seqlen_q"] and x["causal"] == r["causal"] and x["pass"] == r["pass"]
                    and x["impl"] == (impl if r["pass"] == "fwd" else "flare")]
            if yard:
                r[field] = round(r["tflops"] / yard[0]["tflops"], 3)
    failed = any("check_failed" in r for r in rows) or any(r["impl"] == "flare" and r.get("ms") is None
                                                             for r in rows)
    out_dir = args.out or REPO / "bench" / "results"
    topic = "gpu-wide" if args.device == "cuda" else "cpu-wide-check"
    path = run_meta.write_result(run_meta.default_result_path(out_dir, topic), {"meta": meta, "rows": rows})
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
