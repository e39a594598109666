#!/usr/bin/env python3
"""GPU decode benchmark by shared/BENCH.md's decode protocol: flare's KV-cache pass (flare_fwd_kvcache through the
C ABI, params built once, so a timed call is one ctypes call) against torch SDPA's FLASH_ATTENTION (FA2) and
CUDNN_ATTENTION on the same shapes, reporting KV bytes read per second and the ratio to the run's copy ceiling.

  dense    bf16, head dim 128, 32 query heads over 8 KV heads, one query token; batch 1-128 x KV 2K-128K (pairs
           above MAX_TOKENS cache tokens left out); flare (dense cache, causal), torch FLASH and CUDNN
           (enable_gqa, or K/V expanded to 32 heads where a backend refuses it, said in the row)
  spec     2, 4 and 8 query tokens (speculative decoding) on a few of those shapes: flare causal (bottom-right),
           the peers without a mask (SDPA's is_causal aligns top-left; the bytes read are the same)
  paged    flare on a paged cache with page sizes 1, 16 and 256 (block_table a random permutation of the blocks)

KV buffers are rotated: each shape allocates as many caches as make ROTATE_BYTES together (at least two), and
every timed call reads the next one, so L2 (50-60 MB) never holds the data a call reads. Peers read their own
(b, h, s, d) contiguous copies, rotated the same way. tbps = K and V bytes of the attended keys / time;
vs_copy = tbps / the run's copy ceiling (a 1 GiB device-to-device copy, bytes read + written). Each shape's
flare output is checked before timing: batch 0 against an fp32 reference, within 2x FA2's error + one bf16 ulp
(4 ulps without a peer); a failure marks flare's rows ("check_failed") and makes the exit status 1. Timing:
triton's do_bench (CUDA events, median). Budget: the whole run stays under 6 minutes on an H200.

  python3 bench/gpu/bench_decode.py --out $OUT               -> gpu-decode-<date>-<sha>.json
  python3 bench/gpu/bench_decode.py --device cpu --small     the code path on the CPU backend, tiny shapes, no
                                                             timing claims (checks the script without a GPU)
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

BATCHES = [1, 8, 32, 128]
KV_LENS = [2048, 8192, 32768, 131072]
MAX_TOKENS = 1 << 21             # batch x KV length per cache: 8 GiB of bf16 K+V at 8 heads x 128
SPEC = {"shapes": [(1, 32768), (8, 8192)], "tokens": [2, 4, 8]}
PAGED = {"shapes": [(1, 32768), (8, 8192), (32, 8192)], "pages": [1, 16, 256]}
ROTATE_BYTES = 1 << 30           # caches per shape: together at least this many bytes (and at least two)
MAX_PEER_EXPANDED_BYTES = 4 << 30  # a peer's K/V expanded to the query heads: only below this


class Geometry:
    def __init__(self, small):
        self.nheads, self.nheads_k, self.headdim = (4, 2, 64) if small else (32, 8, 128)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for the result JSON (default bench/results)")
    p.add_argument("--groups", nargs="+", choices=["dense", "spec", "paged"], default=["dense", "spec", "paged"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (a check of the script, with --device cpu)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--timer", choices=["events", "cudagraph"], default="events")
    p.add_argument("--num-splits", type=int, default=0,
                   help="flare's num_splits on every call (0: its heuristic; a fixed count is for tuning it)")
    args = p.parse_args(argv)
    if args.small:
        global BATCHES, KV_LENS, SPEC, PAGED, ROTATE_BYTES
        BATCHES, KV_LENS = [1, 3], [64, 300]
        SPEC = {"shapes": [(1, 300)], "tokens": [2]}
        PAGED = {"shapes": [(3, 300)], "pages": [1, 16]}
        ROTATE_BYTES = 1 << 16
    return args


def kv_bytes(batch, seqlen_k, g):
    return batch * seqlen_k * g.nheads_k * g.headdim * 2 * 2  # K and V, bf16


def shapes(args):
    """(group, batch, seqlen_q, seqlen_k, page) in run order."""
    out = []
    if "dense" in args.groups:
        out += [("dense", b, 1, s, None) for b in BATCHES for s in KV_LENS if b * s <= MAX_TOKENS]
    if "spec" in args.groups:
        out += [("spec", b, t, s, None) for b, s in SPEC["shapes"] for t in SPEC["tokens"]]
    if "paged" in args.groups:
        out += [("paged", b, 1, s, page) for b, s in PAGED["shapes"] for page in PAGED["pages"]]
    return out


class Caches:
    """`count` KV caches of one shape, dense (batch, seqlen_k, nheads_k, d) or paged (blocks, page, nheads_k, d)
    with one block_table per cache."""

    def __init__(self, batch, seqlen_k, page, g, count, device):
        self.k, self.v, self.tables = [], [], []
        for _ in range(count):
            if page is None:
                shape = (batch, seqlen_k, g.nheads_k, g.headdim)
                table = None
            else:
                per_seq = -(-seqlen_k // page)
                shape = (batch * per_seq, page, g.nheads_k, g.headdim)
                table = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).to(torch.int32)
            self.k.append(torch.randn(shape, device=device, dtype=torch.bfloat16))
            self.v.append(torch.randn(shape, device=device, dtype=torch.bfloat16))
            self.tables.append(table)

    def dense_keys(self, i, b, seqlen_k):
        """Sequence b's keys and values of cache i, (seqlen_k, nheads_k, d)."""
        k, v, table = self.k[i], self.v[i], self.tables[i]
        if table is None:
            return k[b, :seqlen_k], v[b, :seqlen_k]
        blocks = table[b].long()
        return (k[blocks].flatten(0, 1)[:seqlen_k], v[blocks].flatten(0, 1)[:seqlen_k])


class FlareKvCache:
    """flare_fwd_kvcache through the C ABI, one params struct per cache (built once); call() runs the next."""

    def __init__(self, q, caches, seqlen_k, causal, num_splits=0):
        from flare import _capi
        lib = _capi.library()
        tv = _capi.tensor_view
        batch = q.shape[0]
        self.lib, self.params, self.keep, self.next = lib, [], [q], 0
        self.out = torch.empty_like(q)
        self.seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=q.device)
        stream = torch.cuda.current_stream().cuda_stream if q.is_cuda else None
        for k, v, table in zip(caches.k, caches.v, caches.tables):
            p = lib.kvcache_params()
            p.q, p.k_cache, p.v_cache, p.out = tv(q), tv(k), tv(v), tv(self.out)
            p.cache_seqlens = tv(self.seqlens)
            if table is not None:
                p.block_table = tv(table)
            p.attn.causal = int(causal)
            p.num_splits = num_splits
            p.exec.stream = stream
            if q.is_cuda:
                nbytes = lib.kvcache_workspace_size(p)
                if nbytes:
                    ws = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
                    self.keep.append(ws)
                    p.exec.workspace, p.exec.workspace_size = ws.data_ptr(), nbytes
            self.params.append(p)

    def call(self):
        self.lib.fwd_kvcache(self.params[self.next])
        self.next = (self.next + 1) % len(self.params)

    def output_of(self, i):
        self.lib.fwd_kvcache(self.params[i])
        return self.out


def sdpa_peer(impl, q, caches, g, budget_bytes):
    """torch SDPA backend `impl` over contiguous (b, h, s, d) copies of the caches (enable_gqa, else K/V expanded
    to the query heads when that fits budget_bytes); (runner with .call() and .output_of(i), note) or
    (None, why refused)."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    backend = bench_gpu.sdpa_backends()[impl]
    qt = q.transpose(1, 2).contiguous()
    group = g.nheads // g.nheads_k

    def attempt(expand):
        ks = [k.transpose(1, 2).contiguous() for k in caches.k]
        vs = [v.transpose(1, 2).contiguous() for v in caches.v]
        if expand:
            ks = [k.repeat_interleave(group, dim=1) for k in ks]
            vs = [v.repeat_interleave(group, dim=1) for v in vs]

        class Runner:
            next = 0

            def output_of(self, i):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, ks[i], vs[i], enable_gqa=not expand and group > 1)

            def call(self):
                self.output_of(self.next)
                self.next = (self.next + 1) % len(ks)

        runner = Runner()
        return runner, bench_gpu.refusal_reason(lambda: runner.output_of(0))

    runner, why = attempt(False)
    if why is None:
        return runner, "enable_gqa" if group > 1 else None
    del runner
    if group == 1 or sum(k.numel() * 2 * group * 2 for k in caches.k) > budget_bytes:
        return None, why
    runner, why2 = attempt(True)
    if why2 is None:
        return runner, f"K/V expanded to {g.nheads} heads (enable_gqa refused: {why[:200]})"
    return None, why2


def reference_out(q, caches, seqlen_k, causal, g):
    """fp32 attention of batch 0 against cache 0: (seqlen_q, nheads, d)."""
    k, v = caches.dense_keys(0, 0, seqlen_k)
    group = g.nheads // g.nheads_k
    qf = q[0].float().transpose(0, 1)                                   # (h, sq, d)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)      # (h, sk, d)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) / math.sqrt(g.headdim)
    sq = q.shape[1]
    if causal and sq > 1:
        i = torch.arange(sq, device=q.device).view(-1, 1) + seqlen_k - sq
        j = torch.arange(seqlen_k, device=q.device).view(1, -1)
        scores = scores.masked_fill(j > i, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).transpose(0, 1)


def check(flare_out, peer_out, ref):
    err = (flare_out.float() - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    if peer_out is None:
        peer_err, bound = None, 4 * bench_gpu.BF16_ULP_AT_1 * scale
    else:
        peer_err = (peer_out.float() - ref).abs().max().item()
        bound = 2 * peer_err + bench_gpu.BF16_ULP_AT_1 * scale
    errors = {"flare": float(f"{err:.3e}"), "peer": None if peer_err is None else float(f"{peer_err:.3e}")}
    return err <= bound, "" if err <= bound else f"flare error {err:.3e} > {bound:.3e}", errors


def run_shape(shape, g, args, time_ms, copy_tbps, log):
    group_name, batch, seqlen_q, seqlen_k, page = shape
    dev = args.device
    nbytes = kv_bytes(batch, seqlen_k, g)
    count = max(2, -(-ROTATE_BYTES // nbytes))
    caches = Caches(batch, seqlen_k, page, g, count, dev)
    q = torch.randn(batch, seqlen_q, g.nheads, g.headdim, device=dev, dtype=torch.bfloat16)
    causal = True
    base = {"pass": "decode", "group": group_name, "dtype": "bf16", "batch": batch, "seqlen_q": seqlen_q,
            "seqlen_k": seqlen_k, "nheads": g.nheads, "nheads_k": g.nheads_k, "headdim": g.headdim,
            "page_size": page, "kv_bytes": nbytes, "rotated_caches": count}
    impls = {}
    try:
        impls["flare"] = (FlareKvCache(q, caches, seqlen_k, causal, args.num_splits), None)
    except Exception as e:  # a failing flare is a result of the run
        impls["flare"] = (None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}")
    if dev == "cuda" and page is None:
        for impl in ("torch-flash", "torch-cudnn"):
            impls[impl] = sdpa_peer(impl, q, caches, g, MAX_PEER_EXPANDED_BYTES)

    extra = {}
    if impls["flare"][0] is not None:
        mine = impls["flare"][0].output_of(0)[0]
        peer = impls.get("torch-flash", (None,))[0]
        # The peers attend without a mask: their error means something only for one query token.
        peer_out = None if peer is None or seqlen_q > 1 else peer.output_of(0)[0].transpose(0, 1)
        ok, message, errors = check(mine, peer_out, reference_out(q, caches, seqlen_k, causal, g))
        extra["max_abs_err"] = errors
        if not ok:
            extra["check_failed"] = message
            log(f"  ACCURACY CHECK FAILED {group_name} b{batch} sq{seqlen_q} sk{seqlen_k} page {page}: {message}")
    rows, cells = [], []
    for impl, (runner, note) in impls.items():
        row = dict(base, impl=impl, causal=causal if impl == "flare" else False)
        if runner is None:
            rows.append(dict(row, ms=None, skipped=note))
            continue
        ms = time_ms(runner.call)
        tbps = nbytes / (ms * 1e-3) / 1e12
        row.update(ms=round(ms, 5), tbps=round(tbps, 3))
        if copy_tbps:
            row["vs_copy"] = round(tbps / copy_tbps, 3)
        if impl == "flare":
            row.update(extra, num_splits=args.num_splits)
        if note:
            row["note"] = note
        rows.append(row)
        cells.append(f"{impl} {tbps:5.2f}")
    flare_ms = next((r["ms"] for r in rows if r["impl"] == "flare" and r.get("ms")), None)
    for r in rows:
        if r["impl"] == "flare" and flare_ms:
            for field, peer in (("vs_fa2", "torch-flash"), ("vs_cudnn", "torch-cudnn")):
                peer_ms = next((p["ms"] for p in rows if p["impl"] == peer and p.get("ms")), None)
                if peer_ms:
                    r[field] = round(peer_ms / flare_ms, 3)
    log(f"{group_name:<6} b{batch:<4} sq{seqlen_q} sk{seqlen_k:<7} page {str(page):<5} TB/s: {'  '.join(cells)}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    run_meta.prefer_cuda_build()
    g = Geometry(args.small)
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(),
            "groups": args.groups, "rotate_bytes": ROTATE_BYTES,
            "layouts": "flare: q (b, sq, h, d), cache (b, s, h_k, d) or paged (blocks, page, h_k, d); torch SDPA: "
                       "contiguous (b, h, s, d) copies",
            "timer": "perf_counter median (CPU)" if args.device == "cpu" else f"triton {args.timer}, median"}
    torch.manual_seed(0)
    time_ms = bench_gpu.timer(args)
    copy_tbps = None
    if args.device == "cuda":
        meta["ceilings"] = bench_gpu.measure_ceilings(time_ms)
        copy_tbps = meta["ceilings"]["copy_tbps"]
        print(f"ceilings: {meta['ceilings']}", flush=True)
    rows, failed = [], False
    for shape in shapes(args):
        shape_rows = run_shape(shape, g, args, time_ms, copy_tbps, lambda m: print(m, flush=True))
        failed |= any("check_failed" in r for r in shape_rows)
        failed |= any(r["impl"] == "flare" and r.get("ms") is None for r in shape_rows)
        rows += shape_rows
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out_dir = args.out or REPO / "bench" / "results"
    topic = "gpu-decode" if args.device == "cuda" else "cpu-decode-check"
    path = run_meta.write_result(run_meta.default_result_path(out_dir, topic), {"meta": meta, "rows": rows})
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
