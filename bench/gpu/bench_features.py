#!/usr/bin/env python3
"""GPU forward benchmark of the shapes the plain sweep (bench_gpu.py) leaves out, by shared/BENCH.md's protocol:

  gqa      long-context GQA: batch 1, 32 query heads over 8 KV heads, head dim 128, causal, seqlen 32K-128K;
           flare (auto, sm90, sm80), torch FLASH (FA2) and CUDNN (with enable_gqa, or on K/V expanded to 32
           heads where the backend refuses it, said in the row), and FlexAttention
  window   a causal sliding window of 4096 keys, 16 heads of 128, 16K tokens (batch = 16384 // seqlen)
  softcap  causal with softcap 50, the same shapes
  causal   flare's plain causal rate on the window/softcap shapes: the yardstick for both (the goal is >= 0.95x)
  training the cost of the training features on flare's own calls, forward and backward, causal and not: dropout
           0.1 (goal <= 1.15x the time without) and one sink per head (goal <= 1.03x); head dims 64 and 128,
           seqlen 2K and 8K, 16K tokens, width 2048. The forward with dropout runs on the sm80 path (the sm90
           path leaves dropout to it), so its rows also carry the ratio to a forced-sm80 call without dropout.

torch SDPA has no window or softcap: there FlexAttention (torch.compile'd, block mask + score_mod) is the peer.
Each shape's flare output is checked before timing: the last query rows of heads 0 and 1 against an fp32
reference, within 2x the error of the bf16 peer (FlexAttention, else FA2) plus one bf16 ulp; a failure marks
flare's rows ("check_failed") and makes the exit status 1. Timing: triton's do_bench (CUDA events, L2 flushed,
median). Ceilings of the run: an 8192^3 bf16 matmul and a 1 GiB copy.

  python3 bench/gpu/bench_features.py --out $OUT                  -> gpu-features-<date>-<sha>.json
  python3 bench/gpu/bench_features.py --device cpu --small        the code path on the CPU, tiny shapes, no timing
                                                                  claims (checks the script without a GPU)
"""

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "bench"), str(REPO / "python")]

import bench_gpu  # noqa: E402
import meta as run_meta  # noqa: E402
from flops import attention_flops  # noqa: E402

GQA_SEQLENS = [32768, 65536, 131072]
FEATURE_SEQLENS = [4096, 8192, 16384]
WINDOW = 4096
SOFTCAP = 50.0
CHECK_ROWS = 128  # query rows (the last ones) per checked head
GROUPS = ["gqa", "window", "softcap", "training"]
TRAINING_GOALS = {"dropout": 1.15, "sinks": 1.03}
TRAINING_HEADDIMS = [64, 128]
TRAINING_SEQLENS = [2048, 8192]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for the result JSON (default bench/results)")
    p.add_argument("--groups", nargs="+", choices=GROUPS, default=GROUPS)
    p.add_argument("--gqa-seqlens", type=int, nargs="+", default=GQA_SEQLENS)
    p.add_argument("--seqlens", type=int, nargs="+", default=FEATURE_SEQLENS, help="window / softcap seqlens")
    p.add_argument("--tokens", type=int, default=16384, help="window / softcap: batch = tokens // seqlen")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (a check of the script, with --device cpu)")
    p.add_argument("--no-flex", dest="flex", action="store_false", help="leave FlexAttention out")
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--timer", choices=["events", "cudagraph"], default="events")
    args = p.parse_args(argv)
    args.training_shapes = [(d, s, args.tokens, 2048) for d in TRAINING_HEADDIMS for s in TRAINING_SEQLENS]
    if args.small:
        args.gqa_seqlens, args.seqlens, args.tokens = [384], [256], 512
        args.training_shapes = [(64, 256, 512, 128)]
    return args


def run_training(args, time_ms, log):
    """Rows of group "training": each feature's time over the same flare call without it (interleaved twice)."""
    dev, rows = args.device, []
    for (d, s, tokens, width) in args.training_shapes:
        b, h = max(1, tokens // s), width // d
        q, k, v, dout = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
        sinks = torch.randn(h, device=dev, dtype=torch.float32)
        for causal in (False, True):
            base = bench_gpu.FlareAbi(q, k, v, dout, causal)
            base80 = bench_gpu.FlareAbi(q, k, v, dout, causal, "sm80" if dev == "cuda" else "auto")
            variants = {"dropout": bench_gpu.FlareAbi(q, k, v, dout, causal, dropout_p=0.1),
                        "sinks": bench_gpu.FlareAbi(q, k, v, dout, causal, sinks=sinks)}
            for pass_ in ("fwd", "bwd"):
                for feature, with_ in variants.items():
                    fns = {"base": getattr(base, pass_), "with": getattr(with_, pass_)}
                    if feature == "dropout" and pass_ == "fwd":
                        fns["base_sm80"] = base80.fwd
                    times = {name: [] for name in fns}
                    for _ in range(2):
                        for name, fn in fns.items():
                            times[name].append(time_ms(fn))
                    ms = {name: statistics.median(t) for name, t in times.items()}
                    ratio = ms["with"] / ms["base"]
                    row = {"pass": pass_, "group": "training", "feature": feature, "impl": "flare", "dtype": "bf16",
                           "batch": b, "seqlen_q": s, "seqlen_k": s, "nheads": h, "nheads_k": h, "headdim": d,
                           "causal": causal, "base_ms": round(ms["base"], 5), "with_ms": round(ms["with"], 5),
                           "ratio": round(ratio, 3), "goal": TRAINING_GOALS[feature],
                           "meets_goal": ratio <= TRAINING_GOALS[feature],
                           "tflops": round(attention_flops(pass_, b, h, s, s, d, causal) / (ms["with"] * 1e-3) / 1e12,
                                           2)}
                    if "base_sm80" in ms:
                        row["base_sm80_ms"] = round(ms["base_sm80"], 5)
                        row["ratio_vs_sm80"] = round(ms["with"] / ms["base_sm80"], 3)
                    rows.append(row)
                    extra = f"  (vs sm80 {row['ratio_vs_sm80']:.3f})" if "ratio_vs_sm80" in row else ""
                    log(f"training {feature:<7} {pass_} b{b} s{s} h{h} d{d} causal={int(causal)}: "
                        f"{ms['base']:.3f} -> {ms['with']:.3f} ms, ratio {ratio:.3f} (goal <= "
                        f"{TRAINING_GOALS[feature]}){extra}")
            del base, base80, variants
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


class Shape:
    """One benchmarked problem: (b, s, h, d) with h_k KV heads, causal, window left (or None), softcap (or 0)."""

    def __init__(self, group, batch, seqlen, nheads, nheads_k, headdim, window=None, softcap=0.0):
        self.group, self.batch, self.seqlen = group, batch, seqlen
        self.nheads, self.nheads_k, self.headdim = nheads, nheads_k, headdim
        self.window, self.softcap = window, softcap

    def flops(self):
        """BENCH.md's count; under a window, 4·b·h·d times the (query, key) pairs the mask leaves visible."""
        if self.window is None:
            return attention_flops("fwd", self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim, True)
        s, w = self.seqlen, self.window  # row i sees min(i + 1, w + 1) keys
        ramp = min(s, w + 1)
        visible = ramp * (ramp + 1) // 2 + (s - ramp) * (w + 1)
        return 4.0 * self.batch * self.nheads * visible * self.headdim

    def row(self, impl, ms, **extra):
        row = {"pass": "fwd", "group": self.group, "impl": impl, "dtype": "bf16", "batch": self.batch,
               "seqlen_q": self.seqlen, "seqlen_k": self.seqlen, "nheads": self.nheads, "nheads_k": self.nheads_k,
               "headdim": self.headdim, "causal": True, "window_left": self.window, "softcap": self.softcap or None,
               "ms": None if ms is None else round(ms, 5)}
        if ms is not None:
            row["tflops"] = round(self.flops() / (ms * 1e-3) / 1e12, 2)
        row.update(extra)
        return row


def shapes(args):
    out = []
    if "gqa" in args.groups:
        h, hk = (4, 2) if args.small else (32, 8)
        out += [Shape("gqa", 1, s, h, hk, 128 if not args.small else 64) for s in args.gqa_seqlens]
    for group in ("window", "softcap"):
        if group in args.groups:
            h, d = (2, 64) if args.small else (16, 128)
            window = (WINDOW if not args.small else 100) if group == "window" else None
            for s in args.seqlens:
                out.append(Shape(group, max(1, args.tokens // s), s, h, h, d, window=window,
                                 softcap=SOFTCAP if group == "softcap" else 0.0))
    return out


def reference_rows(q, k, v, shape):
    """fp32 attention of the last CHECK_ROWS query rows of heads 0 and 1 (batch 0): (2, rows, d)."""
    s, group = shape.seqlen, shape.nheads // shape.nheads_k
    rows = torch.arange(max(0, s - CHECK_ROWS), s, device=q.device)
    outs = []
    for h in range(min(2, shape.nheads)):
        qh, kh, vh = q[0, rows, h].float(), k[0, :, h // group].float(), v[0, :, h // group].float()
        scores = qh @ kh.T / math.sqrt(shape.headdim)
        if shape.softcap:
            scores = shape.softcap * torch.tanh(scores / shape.softcap)
        keys = torch.arange(s, device=q.device)
        hidden = keys[None, :] > rows[:, None]
        if shape.window is not None:
            hidden |= keys[None, :] < rows[:, None] - shape.window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ vh)
    return rows, torch.stack(outs)


def check(out_bshd, peer_bshd, q, k, v, shape):
    """(ok, message, errors): flare's checked rows within 2x the peer's error + one bf16 ulp of the reference."""
    rows, ref = reference_rows(q, k, v, shape)
    nh = ref.shape[0]
    mine = out_bshd[0, rows, :nh].transpose(0, 1).float()
    err = (mine - ref).abs().max().item()
    if peer_bshd is None:
        bound = bench_gpu.BF16_ULP_AT_1 * 4 * max(1.0, ref.abs().max().item())
        peer_err = None
    else:
        peer_err = (peer_bshd[0, rows, :nh].transpose(0, 1).float() - ref).abs().max().item()
        bound = 2 * peer_err + bench_gpu.BF16_ULP_AT_1 * max(1.0, ref.abs().max().item())
    errors = {"flare": float(f"{err:.3e}"), "peer": None if peer_err is None else float(f"{peer_err:.3e}")}
    ok = err <= bound
    return ok, "" if ok else f"flare error {err:.3e} > {bound:.3e}", errors


def flex_runner(q, k, v, shape, device):
    """FlexAttention (compiled) on (b, h, s, d) inputs with the shape's mask and softcap; returns a callable."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    window = shape.window

    def mask_mod(b, h, qi, ki):
        visible = ki <= qi
        return visible & (ki >= qi - window) if window is not None else visible

    block_mask = create_block_mask(mask_mod, None, None, shape.seqlen, shape.seqlen, device=device)
    cap = shape.softcap
    score_mod = (lambda score, b, h, qi, ki: cap * torch.tanh(score / cap)) if cap else None
    compiled = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    gqa = shape.nheads != shape.nheads_k
    return lambda: compiled(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


def sdpa_runner(impl, q, k, v, shape):
    """torch SDPA backend `impl` (causal), with enable_gqa; (callable, note) or (None, why refused)."""
    backend = bench_gpu.sdpa_backends()[impl]
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    qt, kt, vt = bench_gpu.torch_inputs(impl, q, k, v, q)[:3]
    gqa = shape.nheads != shape.nheads_k

    def make(kk, vv, enable_gqa):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=enable_gqa)
        return run

    run = make(kt, vt, gqa)
    why = bench_gpu.refusal_reason(run)
    if why is None:
        return run, "enable_gqa" if gqa else None
    if not gqa:
        return None, why
    group = shape.nheads // shape.nheads_k
    ke, ve = (x.repeat_interleave(group, dim=1) for x in (kt, vt))
    run = make(ke, ve, False)
    why2 = bench_gpu.refusal_reason(run)
    return (run, f"K/V expanded to {shape.nheads} heads (enable_gqa refused: {why[:200]})") if why2 is None else (None, why2)


def run_shape(shape, args, time_ms, log):
    dev = args.device
    b, s, h, hk, d = shape.batch, shape.seqlen, shape.nheads, shape.nheads_k, shape.headdim
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    window = (shape.window, 0) if shape.window is not None else (-1, 0)
    impls = {}
    paths = bench_gpu.FLARE_PATHS if shape.group == "gqa" else {"flare": "auto"}
    for impl, path in paths.items():
        if dev == "cpu" and path != "auto":
            continue
        try:
            runner = bench_gpu.FlareAbi(q, k, v, q, True, path, window=window, softcap=shape.softcap)
            impls[impl] = (runner.fwd, None, runner)
        except Exception as e:  # a failing flare is a result of the run
            impls[impl] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}", None)
    if shape.group != "gqa":  # flare's plain causal rate on the same shape: the yardstick
        try:
            plain = bench_gpu.FlareAbi(q, k, v, q, True, "auto")
            impls["flare-causal"] = (plain.fwd, None, None)
        except Exception as e:
            impls["flare-causal"] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}", None)
    if shape.group == "gqa" and dev == "cuda":
        for impl in ("torch-flash", "torch-cudnn"):
            run, note = sdpa_runner(impl, q, k, v, shape)
            impls[impl] = (run, note, None) if run is not None else (None, note, None)
    if args.flex:
        try:
            run = flex_runner(q, k, v, shape, dev)
            run()
            impls["flex"] = (run, None, None)
        except Exception as e:
            impls["flex"] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}", None)

    rows, extra = [], {}
    if impls.get("flare", (None,))[0] is not None:
        impls["flare"][2].fwd()
        peer = None
        if impls.get("flex", (None,))[0] is not None:
            peer = impls["flex"][0]().transpose(1, 2)
        elif impls.get("torch-flash", (None,))[0] is not None:
            peer = impls["torch-flash"][0]().transpose(1, 2)
        ok, message, errors = check(impls["flare"][2].out, peer, q, k, v, shape)
        extra["max_abs_err"] = errors
        if not ok:
            extra["check_failed"] = message
            log(f"  ACCURACY CHECK FAILED {shape.group} seqlen {s}: {message}")
    times = {}
    for impl, (fn, note, _) in impls.items():
        if fn is None:
            rows.append(shape.row(impl, None, skipped=note))
            continue
        ms = time_ms(fn)
        times[impl] = ms
        row_extra = dict(extra) if impl.startswith("flare") and impl != "flare-causal" else {}
        if note:
            row_extra["note"] = note
        rows.append(shape.row(impl, ms, **row_extra))
    base = {name: times.get(name) for name in ("flex", "torch-cudnn", "torch-flash", "flare-causal")}
    for r in rows:
        if r["impl"] == "flare" and r.get("ms"):
            for field, peer in (("vs_flex", "flex"), ("vs_cudnn", "torch-cudnn"), ("vs_fa2", "torch-flash"),
                                ("vs_plain_causal", "flare-causal")):
                if base[peer]:
                    r[field] = round(base[peer] / r["ms"], 3)
    cells = "  ".join(f"{impl} {shape.flops() / (ms * 1e-3) / 1e12:6.1f}" for impl, ms in times.items())
    log(f"{shape.group:<8} b{b} s{s} h{h}/{hk} d{d}  TFLOP/s: {cells}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    run_meta.prefer_cuda_build()
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(),
            "groups": args.groups, "layouts": "flare (b, s, h, d); FlexAttention (b, h, s, d) contiguous; torch "
                                                "SDPA as bench_gpu.TORCH_LAYOUT",
            "timer": "perf_counter median (CPU)" if args.device == "cpu" else f"triton {args.timer}, median"}
    torch.manual_seed(0)
    if args.device == "cuda":
        time_ms = bench_gpu.timer(args)
        meta["ceilings"] = bench_gpu.measure_ceilings(time_ms)
        print(f"ceilings: {meta['ceilings']}", flush=True)
    else:
        time_ms = bench_gpu.timer(args)
    rows, failed = [], False
    for shape in shapes(args):
        shape_rows = run_shape(shape, args, time_ms, lambda m: print(m, flush=True))
        failed |= any("check_failed" in r or ("error" in r) for r in shape_rows)
        rows += shape_rows
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if "training" in args.groups:
        rows += run_training(args, time_ms, lambda m: print(m, flush=True))
    out_dir = args.out or REPO / "bench" / "results"
    path = run_meta.write_result(run_meta.default_result_path(out_dir, "gpu-features" if args.device == "cuda"
                                                              else "cpu-features-check"), {"meta": meta, "rows": rows})
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
