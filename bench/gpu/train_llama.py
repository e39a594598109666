#!/usr/bin/env python3
"""Training end to end with transformers: a randomly initialised LlamaForCausalLM (about 200M parameters:
hidden 1024, 12 layers, 16 query heads over 4 KV heads, head dim 64, MLP 2816, vocab 32000) trained with
AdamW in bf16 on synthetic tokens, at context 4096 (batch 2) and 8192 (batch 1), once per attention
implementation: "eager", "sdpa" and "flare" (flare.integrations.transformers.register()).

Every implementation starts from the same initial weights and sees the same batches. The data are repeated
random segments (a segment of 16..512 random tokens, repeated to fill the context), so the loss can fall
within a few steps by copying from the previous repetition: attention over long distances has to work.
Per run: step times (the median after --warmup steps), tokens/s, peak allocated memory, the loss of every
step. Running out of memory (eager at 8K may) is recorded as a result. At the end flare's losses are compared
with sdpa's step by step; flare tracks sdpa when every step is within 0.02 + 2% of sdpa's loss.

  python3 bench/gpu/train_llama.py --out $OUT                   -> $OUT/train-<date>-<sha>.json
  python3 bench/gpu/train_llama.py --device cpu --tiny          a tiny model for 2 steps (checks the script)
Exit status 1 when flare fails (not by running out of memory) or does not track sdpa.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

import meta as run_meta  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192, rope_theta=10000.0,
             tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
IMPLS = ["eager", "sdpa", "flare"]


def parse_runs(text):
    """"4096x2,8192x1" -> [(4096, 2), (8192, 1)] (context x batch)."""
    runs = []
    for part in text.split(","):
        ctx, _, batch = part.partition("x")
        runs.append((int(ctx), int(batch or 1)))
    return runs


def synthetic_batches(steps, batch, context, vocab, seed):
    """steps batches of (batch, context) token ids: repeated random segments, see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            seg = int(torch.randint(16, 513, (1,), generator=gen))
            segment = torch.randint(0, vocab, (seg,), generator=gen)
            reps = context // seg + 2
            offset = int(torch.randint(0, seg, (1,), generator=gen))
            rows.append(segment.repeat(reps)[offset:offset + context])
        out.append(torch.stack(rows))
    return out


def make_model(transformers, config, impl, device, init_state):
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                             dtype=torch.bfloat16)
    model.load_state_dict(init_state)
    model.config.use_cache = False
    return model.train()


def train_run(transformers, config, impl, context, batch, batches, init_state, args):
    """One implementation at one context: a row with times, memory and losses (or why it stopped)."""
    device = args.device
    cuda = device == "cuda"
    row = {"pass": "train", "impl": impl, "dtype": "bf16", "batch": batch, "seqlen_q": context, "seqlen_k": context,
           "nheads": config.num_attention_heads, "nheads_k": config.num_key_value_heads,
           "headdim": config.hidden_size // config.num_attention_heads, "causal": True}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = opt = None
    losses, step_ms = [], []
    try:
        model = make_model(transformers, config, impl, device, init_state)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=cuda)
        # Linear warm-up of the learning rate: without it AdamW's first steps (each parameter moved by ~lr)
        # threw the loss above its starting value, and the runs' bf16 rounding differences grew into spikes.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, args.lr_warmup)))
        for step, ids in enumerate(batches):
            ids = ids.to(device)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 5))  # .item() waits for the step
            step_ms.append(round((time.perf_counter() - start) * 1e3, 3))
            print(f"  {impl:<6} ctx {context:>5} x {batch}: step {step + 1:>3} loss {losses[-1]:8.4f} "
                  f"{step_ms[-1]:9.1f} ms", flush=True)
        row["status"] = "ok"
    except torch.OutOfMemoryError as e:
        row["status"] = "out of memory"
        row["error"] = str(e).splitlines()[0][:300]
    except Exception as e:  # recorded, and the other runs still happen
        row["status"] = "error"
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"
    timed = step_ms[args.warmup:]
    row["ms"] = round(statistics.median(timed), 3) if timed and row["status"] == "ok" else None
    if row["ms"]:
        row["tokens_per_s"] = round(batch * context / (row["ms"] * 1e-3))
    row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2 ** 20, 1) if cuda else None
    row["steps"] = len(losses)
    row["losses"] = losses
    row["step_ms"] = step_ms
    print(f"  {impl:<6} ctx {context:>5} x {batch}: {row['status']}" +
          (f", median step {row['ms']} ms, peak {row['peak_mib']} MiB" if row["ms"] else "") +
          (f" ({row['error']})" if row.get("error") else ""), flush=True)
    del model, opt
    gc.collect()
    return row


def compare(rows):
    """flare against sdpa, step by step, per context: max |loss difference| and whether flare tracks."""
    result = {}
    for r in rows:
        if r["impl"] != "flare":
            continue
        peer = next((p for p in rows if p["impl"] == "sdpa" and p["seqlen_q"] == r["seqlen_q"]
                     and p["batch"] == r["batch"]), None)
        key = f"{r['seqlen_q']}x{r['batch']}"
        if peer is None or r["status"] != "ok" or peer["status"] != "ok":
            result[key] = {"tracks": False if r["status"] != "ok" else None,
                           "why": f"flare {r['status']}, sdpa {peer['status'] if peer else 'not run'}"}
            continue
        diffs = [abs(a - b) for a, b in zip(r["losses"], peer["losses"])]
        tracks = all(abs(a - b) <= 0.02 + 0.02 * abs(b) for a, b in zip(r["losses"], peer["losses"]))
        result[key] = {"tracks": tracks, "max_abs_loss_diff": round(max(diffs), 5),
                       "first_step_loss_diff": round(diffs[0], 5),
                       "speedup_vs_sdpa": round(peer["ms"] / r["ms"], 3) if r["ms"] and peer["ms"] else None}
    return result


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="4096x2,8192x1", help="context x batch, comma separated")
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model, context 64 x 2, 2 steps (checks the script)")
    p.add_argument("--out", type=Path, help="directory for train-<date>-<sha>.json (default bench/results; with --tiny "
                   "or --device cpu build/bench)")
    args = p.parse_args()
    if args.tiny:
        args.runs, args.steps, args.warmup = "64x2", min(args.steps, 2), 0
    args.run_list = parse_runs(args.runs)
    return args


def main():
    args = parse_args()
    run_meta.prefer_cuda_build()
    import transformers
    import flare.integrations.transformers as flare_hf

    flare_hf.register()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("train_llama: no CUDA device (use --device cpu --tiny to check the script)")
    spec = dict(TINY if args.tiny else MODEL)
    if args.layers:
        spec["num_hidden_layers"] = args.layers
    spec["max_position_embeddings"] = max(spec["max_position_embeddings"], max(c for c, _ in args.run_list))
    config = transformers.LlamaConfig(**spec)
    torch.manual_seed(args.seed)
    init_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_state = {k: v.to(torch.bfloat16) for k, v in init_model.state_dict().items()}
    n_params = sum(p.numel() for p in init_model.parameters())
    del init_model

    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(), "transformers": transformers.__version__,
            "model": {"class": "LlamaForCausalLM", "parameters": n_params, **spec},
            "training": {"dtype": "bf16 weights, gradients and AdamW states", "optimizer": "AdamW(betas=(0.9, 0.95), "
                         f"weight_decay=0.1, lr={args.lr}, linear warm-up over {args.lr_warmup} steps), "
                         "grad-norm clip 1.0", "steps": args.steps,
                         "warmup_steps_excluded": args.warmup, "seed": args.seed},
            "data": "synthetic: per sequence, a segment of 16..512 uniform random tokens repeated to the context",
            "peak_mib": "torch.cuda.max_memory_allocated over the run (weights, gradients, optimizer, activations)",
            "tracks": "flare within 0.02 + 2% of sdpa's loss at every step"}
    if args.device == "cpu":
        meta["device"] = "cpu (a check of the script, not a measurement)"
    print(f"{meta.get('device')}: Llama {n_params / 1e6:.0f}M parameters, runs {args.runs}, {args.steps} steps, "
          f"impls {args.impls}", flush=True)

    rows = []
    for context, batch in args.run_list:
        batches = synthetic_batches(args.steps, batch, context, config.vocab_size, args.seed + context)
        for impl in args.impls:
            rows.append(train_run(transformers, config, impl, context, batch, batches, init_state, args))
    comparison = compare(rows)
    print(json.dumps(comparison, indent=1))

    trial = args.tiny or args.device == "cpu"
    out_dir = args.out or (REPO / "build" / "bench" if trial else REPO / "bench" / "results")
    path = run_meta.write_result(run_meta.default_result_path(out_dir, "train-tiny" if args.tiny else "train"),
                                 {"meta": meta, "comparison": comparison, "rows": rows})
    print(f"wrote {path}")
    flare_failed = any(r["impl"] == "flare" and r["status"] == "error" for r in rows)
    not_tracking = any(c.get("tracks") is False for c in comparison.values())
    return 1 if flare_failed or not_tracking else 0


if __name__ == "__main__":
    sys.exit(main())
