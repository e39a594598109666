/*
 * flare.h — the stable C ABI of flare, exact attention without the n×n matrix.
 *
 * This header owns the contract between flare and every caller (the C++ API in flare.hpp, the Python
 * package, other languages): status codes, tensor views, one params struct per pass, entry points and the
 * thread-local error text. Semantics follow FlashAttention; docs/semantics.md states them in full.
 *
 * Conventions
 *  - Every entry point returns a flare_status. On anything but FLARE_OK, flare_last_error() names the
 *    argument, the value and the rule, and no output (nor, for the KV-cache pass, the cache) was written.
 *  - Nothing crosses this boundary as an exception; the library never prints, exits or synchronises a device
 *    on the success path.
 *  - A params struct is made with its *_params_init() function, which sets struct_size and every default;
 *    then the caller fills in what it needs. struct_size lets later versions append fields safely: a struct
 *    from an older flare.h (a smaller struct_size) is read up to its size, the appended fields at their
 *    defaults.
 *  - An optional tensor is "absent" when its rank is 0 (a zero-initialised flare_tensor is absent).
 *  - Strides are in elements, not bytes. The last dimension of every tensor must be contiguous (stride 1);
 *    any other strides are allowed.
 */
#ifndef FLARE_FLARE_H
#define FLARE_FLARE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#  if defined(FLARE_BUILDING_SHARED)
#    define FLARE_API __declspec(dllexport)
#  elif defined(FLARE_SHARED)
#    define FLARE_API __declspec(dllimport)
#  else
#    define FLARE_API
#  endif
#else
#  define FLARE_API __attribute__((visibility("default")))
#endif

#define FLARE_VERSION_MAJOR 0
#define FLARE_VERSION_MINOR 1
#define FLARE_VERSION_PATCH 0

/* ------------------------------------------------------------------------------------------------ */
/* Status codes and errors                                                                            */
/* ------------------------------------------------------------------------------------------------ */

typedef enum flare_status {
  FLARE_OK = 0,
  FLARE_INVALID_ARGUMENT = 1, /* a shape, dtype, device, stride, value or index breaks a rule */
  FLARE_UNSUPPORTED = 2,      /* valid input this build or device cannot run (e.g. no CUDA backend) */
  FLARE_OUT_OF_MEMORY = 3,    /* scratch memory could not be allocated, or the workspace is too small */
  FLARE_CUDA_ERROR = 4,       /* the CUDA runtime reported an error */
  FLARE_INTERNAL_ERROR = 5    /* a bug in flare; the message says where */
} flare_status;

/* The message of the last failed call on this thread ("" if none). Valid until the next flare call on
 * this thread. */
FLARE_API const char* flare_last_error(void);

/* A short constant name for a status ("FLARE_INVALID_ARGUMENT"). */
FLARE_API const char* flare_status_string(flare_status status);

/* The library version as "major.minor.patch". */
FLARE_API const char* flare_version(void);

/* ------------------------------------------------------------------------------------------------ */
/* Tensor views                                                                                       */
/* ------------------------------------------------------------------------------------------------ */

typedef enum flare_dtype {
  FLARE_DTYPE_F32 = 0,
  FLARE_DTYPE_F16 = 1,
  FLARE_DTYPE_BF16 = 2,
  FLARE_DTYPE_F64 = 3,   /* CPU only: computed in fp64 (for gradient checks) */
  FLARE_DTYPE_I32 = 4,   /* index tensors: cu_seqlens, seqused_k, block_table, cache_seqlens, ... */
  FLARE_DTYPE_E4M3 = 5   /* FP8 inputs (forward on sm90); not accepted by the CPU backend */
} flare_dtype;

typedef enum flare_device_type {
  FLARE_DEVICE_CPU = 0,
  FLARE_DEVICE_CUDA = 1
} flare_device_type;

typedef struct flare_device {
  int32_t type;  /* flare_device_type */
  int32_t index; /* CUDA ordinal; 0 for the CPU */
} flare_device;

#define FLARE_MAX_RANK 4

/* A non-owning view of a strided tensor. rank 0 means "absent" (for optional arguments). */
typedef struct flare_tensor {
  void* data;
  int32_t dtype; /* flare_dtype */
  flare_device device;
  int32_t rank;
  int64_t shape[FLARE_MAX_RANK];
  int64_t strides[FLARE_MAX_RANK]; /* in elements */
} flare_tensor;

/* A contiguous (row-major) view: strides are derived from shape. rank must be 1..FLARE_MAX_RANK. */
FLARE_API flare_tensor flare_tensor_contiguous(void* data, flare_dtype dtype, flare_device device,
                                               int32_t rank, const int64_t* shape);

/* ------------------------------------------------------------------------------------------------ */
/* Options shared by every pass                                                                       */
/* ------------------------------------------------------------------------------------------------ */

/* Dropout (training, flare_fwd_params and flare_bwd_params): with dropout_p > 0 each probability
 * P_ij = exp(s_ij - lse_i) of the forward is kept with probability 1 - dropout_p and then scaled by
 * 1 / (1 - dropout_p), or dropped (set to 0), before out = sum_j P_ij v_j; softmax_lse is the undropped one.
 * The mask is a pure function of (dropout_seed, dropout_offset) and the element's coordinates — sequence b
 * (the batch index, or the varlen sequence), query head h, query i and key j counted within the sequence —
 * the same on every backend, tiling and thread count: element (b, h, i, j) is kept when byte j % 16 of the
 * 16 bytes (words w0..w3, each little-endian) of
 *   Philox4x32-7(counter = {j / 16, i, b * nheads + h, (uint32) dropout_offset},
 *                key = {(uint32) dropout_seed, (uint32)(dropout_seed >> 32) ^ (uint32)(dropout_offset >> 32)})
 * is >= min(round(256 dropout_p), 255) (counter words modulo 2^32): the keep probability has a resolution of
 * 1/256, and Philox runs seven rounds, as in FlashAttention 2. The backward must be given the
 * forward's dropout_p, dropout_seed and dropout_offset: it draws the same mask again. flare_dropout_mask
 * writes the mask of one sequence. CUDA devices: the sm80 kernels run it (a forced sm90 forward refuses it). */

/* Sinks (learnable attention sinks, GPT-OSS's s_aux): an optional fp32 tensor of shape (nheads) on the
 * device of q, one logit per query head, in the units of the final scores. It joins every row's softmax
 * denominator without a value: with s the row's scores, out = sum_j exp(s_j) v_j / (sum_j exp(s_j) +
 * exp(sinks[h])), and softmax_lse = log(sum_j exp(s_j) + exp(sinks[h])). A row that sees no key then gets
 * out = 0 and lse = sinks[h]. A sink of -inf is no sink. */

/* How scores are formed and masked. Query i of a sequence sees key j when
 *   causal:  j <= i + seqlen_k - seqlen_q                       (bottom-right alignment)
 *   window:  i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right
 * where a window side of -1 is unbounded. causal equals window_right = 0 with its window_left.
 * score = softmax_scale * q·k; if softcap > 0: score = softcap * tanh(score / softcap);
 * with ALiBi: score += -slope[h] * |i + seqlen_k - seqlen_q - j|. */
typedef struct flare_attn_options {
  float softmax_scale;  /* 0 means 1/sqrt(headdim), resolved in fp64; otherwise finite and > 0 */
  float softcap;        /* 0 means off; otherwise finite and > 0 */
  int32_t causal;       /* 0 or 1 */
  int32_t window_left;  /* -1 or >= 0 */
  int32_t window_right; /* -1 or >= 0 */
  /* optional fp32 slopes, shape (nheads) or (batch, nheads), applied as above */
  flare_tensor alibi_slopes;
} flare_attn_options;

/* How the work runs. */
typedef struct flare_exec_options {
  void* stream;           /* CUDA: a cudaStream_t (NULL = the default stream). CPU: ignored. */
  int32_t num_threads;    /* CPU: worker threads; 0 = OpenMP's default, fewer for small problems
                             (about one thread per 16 MFLOP of work or 512 KiB of q, k, v and out, whichever
                             asks more); at most the larger of 1024 and the processor count, and at most
                             OMP_THREAD_LIMIT (else FLARE_INVALID_ARGUMENT) */
  void* workspace;        /* optional scratch; NULL = flare's own (on the CPU kept between calls: docs/api.md) */
  size_t workspace_size;  /* bytes available at workspace */
} flare_exec_options;

/* Which family of CUDA kernels runs a forward or backward call (flare_fwd_params / flare_bwd_params
 * arch_path; docs/cuda-backend.md). The CPU ignores it.
 *  AUTO  the sm90 kernels where the GPU and the call allow them (compute capability 9.0, a forward the sm90
 *        path covers, a build with them) and they are the faster (varlen batches of short sequences run on
 *        the sm80 ones), else the sm80 ones; a forward of few query rows (decode and speculative steps,
 *        short chunks; the rule is src/cuda/heuristics.hpp's) runs on the KV-cache kernels, which pack the
 *        query heads that share a kv head, and a paged varlen forward always does (not under SM90). The
 *        environment variable
 *        FLARE_CUDA_ARCH_PATH=sm80|sm90|auto, read per call, replaces AUTO in forward calls (never a value
 *        set in the params, and never in the backward, which has one path).
 *  SM80  the sm80 (FlashAttention-2-class) kernels: run on every GPU of compute capability 8.0 or newer.
 *  SM90  the sm90a (FlashAttention-3-class) forward: FLARE_UNSUPPORTED, naming the reason, where the GPU is
 *        not compute capability 9.0, the build has no sm90 kernels or the call is not one they cover (the
 *        backward always runs the sm80 kernels). */
typedef enum flare_arch_path {
  FLARE_ARCH_PATH_AUTO = 0,
  FLARE_ARCH_PATH_SM80 = 80,
  FLARE_ARCH_PATH_SM90 = 90
} flare_arch_path;

/* ------------------------------------------------------------------------------------------------ */
/* Forward                                                                                            */
/* ------------------------------------------------------------------------------------------------ */

/* Dense layout:  q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
 *                v (batch, seqlen_k, nheads_k, headdim_v), out (batch, seqlen_q, nheads, headdim_v),
 *                softmax_lse fp32 (batch, nheads, seqlen_q), optional.
 * Varlen layout: q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim[_v]), out (total_q, ...),
 *                cu_seqlens_q/k int32 (batch + 1), nondecreasing from 0, ending at total_q / total_k;
 *                optional seqused_k int32 (batch): only the first seqused_k[b] keys of sequence b are used;
 *                softmax_lse fp32 (nheads, total_q), optional.
 * Paged varlen (flare_fwd_varlen with block_table; forward only): k (num_blocks, block_size, nheads_k,
 *                headdim), v (..., headdim_v), block_table int32 (batch, max_blocks), any block_size >= 1:
 *                key j of sequence b lives in block block_table[b][j / block_size], row j % block_size.
 *                Sequence b has seqused_k[b] keys when seqused_k is given, else cu_seqlens_k[b + 1] -
 *                cu_seqlens_k[b]; one of the two is required; cu_seqlens_k (optional) then starts at 0 and
 *                is nondecreasing but its end is free. Every sequence fits in max_blocks * block_size keys
 *                and the blocks holding its keys are in 0..num_blocks-1. Forward only (no backward).
 * Head dims (every entry point): headdim (q, k) in 1..576 and headdim_v (v, out) in 1..512, in any
 *                combination (DeepSeek MLA: 576 / 512); outside, FLARE_INVALID_ARGUMENT. The CPU runs them
 *                all, and so does CUDA (fp16 / bf16, multiples of 8).
 * q, k, v and out share one dtype (fp32, fp16, bf16; fp64 on the CPU) and one device. */
typedef struct flare_fwd_params {
  size_t struct_size;
  flare_tensor q, k, v;
  flare_tensor out;          /* written */
  flare_tensor softmax_lse;  /* written if present */
  /* varlen only (flare_fwd_varlen); must be absent for flare_fwd */
  flare_tensor cu_seqlens_q, cu_seqlens_k, seqused_k;
  int32_t max_seqlen_q, max_seqlen_k; /* upper bounds of the sequence lengths; 0 = derive them */
  flare_attn_options attn;
  flare_exec_options exec;
  /* Appended after 0.1.0, read only when struct_size covers it (an older caller's struct runs as AUTO). */
  int32_t arch_path; /* flare_arch_path; FLARE_ARCH_PATH_AUTO by default */
  /* Appended after 0.1.0, read only when struct_size covers it (absent otherwise): the paged varlen layout
   * above, flare_fwd_varlen only. CUDA devices: FLARE_UNSUPPORTED in this release. */
  flare_tensor block_table;
  /* Appended after 0.1.0, read only when struct_size covers it (absent otherwise): learnable attention
   * sinks, see "Sinks" above flare_attn_options. */
  flare_tensor sinks;
  /* Appended after 0.1.0, read only when struct_size covers them (0 otherwise): dropout, see "Dropout" above
   * flare_attn_options. dropout_p in [0, 1); 0 is off. */
  float dropout_p;
  uint64_t dropout_seed;
  uint64_t dropout_offset;
} flare_fwd_params;

FLARE_API void flare_fwd_params_init(flare_fwd_params* params);
FLARE_API flare_status flare_fwd(const flare_fwd_params* params);
FLARE_API flare_status flare_fwd_varlen(const flare_fwd_params* params);
/* Bytes of scratch flare_fwd / flare_fwd_varlen would allocate for these params (validates them). */
FLARE_API flare_status flare_fwd_workspace_size(const flare_fwd_params* params, int32_t varlen,
                                                size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Backward                                                                                           */
/* ------------------------------------------------------------------------------------------------ */

/* Inputs q, k, v, out, dout (like out) and softmax_lse from the forward with the same options;
 * outputs dq (like q), dk (like k), dv (like v); dk/dv are summed over the query heads of a group.
 * Varlen as in the forward. */
typedef struct flare_bwd_params {
  size_t struct_size;
  flare_tensor q, k, v, out, dout, softmax_lse;
  flare_tensor dq, dk, dv; /* written */
  flare_tensor cu_seqlens_q, cu_seqlens_k, seqused_k;
  int32_t max_seqlen_q, max_seqlen_k;
  int32_t deterministic; /* 1: bitwise-identical results across runs (the CPU always is for a fixed
                            num_threads) */
  flare_attn_options attn;
  flare_exec_options exec;
  /* Appended after 0.1.0, as in flare_fwd_params. The backward runs the sm80 kernels (SM90: UNSUPPORTED). */
  int32_t arch_path; /* flare_arch_path; FLARE_ARCH_PATH_AUTO by default */
  /* Appended after 0.1.0, read only when struct_size covers them (absent otherwise). sinks: those of the
   * forward (see "Sinks" above flare_attn_options); the lse given must be the forward's, which counts them.
   * dsinks, optional, written when present (requires sinks): fp32 (nheads), the gradient of sum(out * dout)
   * by each sink, dsinks[h] = -sum over h's rows of exp(sinks[h] - lse) * rowsum(dout * out), summed over
   * the batch. CUDA devices: dsinks is FLARE_UNSUPPORTED in this release (sinks are taken: the lse carries
   * them into dq, dk and dv). */
  flare_tensor sinks;
  flare_tensor dsinks;
  /* Appended after 0.1.0, read only when struct_size covers them (0 otherwise): the forward's dropout. */
  float dropout_p;
  uint64_t dropout_seed;
  uint64_t dropout_offset;
} flare_bwd_params;

FLARE_API void flare_bwd_params_init(flare_bwd_params* params);
FLARE_API flare_status flare_bwd(const flare_bwd_params* params);
FLARE_API flare_status flare_bwd_varlen(const flare_bwd_params* params);
FLARE_API flare_status flare_bwd_workspace_size(const flare_bwd_params* params, int32_t varlen,
                                                size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* KV-cache attention (inference)                                                                     */
/* ------------------------------------------------------------------------------------------------ */

/* q (batch, seqlen_q, nheads, headdim); head dims as for flare_fwd (1..576, headdim_v 1..512).
 * Cache, dense: k_cache (batch_cache, seqlen_cache, nheads_k, headdim), v_cache (..., headdim_v).
 * Cache, paged: k_cache (num_blocks, block_size, nheads_k, headdim), block_table int32 (batch, max_blocks):
 *               key position j of sequence b lives in block block_table[b][j / block_size], row j % block_size.
 * cache_seqlens int32 (batch), optional: keys already in the cache per sequence (absent = seqlen_cache,
 *               or max_blocks * block_size when paged).
 * cache_batch_idx int32 (batch), optional (dense only): sequence b uses cache row cache_batch_idx[b].
 * cache_leftpad int32 (batch), optional: sequence b's keys start at cache slot cache_leftpad[b]; the
 *               causal/window alignment counts keys from there.
 * k_new/v_new (batch, seqlen_new, nheads_k, headdim[_v]), optional together: written into the cache in place
 *               at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (rotated first if rotary is
 *               given), then attended to. The cache must have room.
 * rotary_cos/rotary_sin (seqlen_ro, rotary_dim / 2), optional together, same dtype as q; rotary_dim even and
 *               <= headdim; cos and sin share one row stride. Positions are cache slots, as in FlashAttention
 *               (cache_leftpad does not shift them): new key i is rotated by row cache_seqlens[b] + i; query i
 *               by row cache_seqlens[b] + i when causal or windowed, else every query by row cache_seqlens[b].
 *               rotary_interleaved: rotate pairs (0,1),(2,3)... instead of halves (i, i + rotary_dim/2).
 * After the append, sequence b attends to keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) with the
 * options in attn (causal aligned bottom-right to that range). */
typedef struct flare_kvcache_params {
  size_t struct_size;
  flare_tensor q;
  flare_tensor k_cache, v_cache;   /* read, and written when k_new/v_new are given */
  flare_tensor k_new, v_new;
  flare_tensor cache_seqlens, cache_batch_idx, cache_leftpad, block_table;
  flare_tensor rotary_cos, rotary_sin;
  int32_t rotary_interleaved;
  int32_t num_splits;              /* split-KV: each sequence's keys cut into this many parts, run apart and
                                      merged through their lse; 0 = heuristic. The CPU honours it on its
                                      decode path (query heads per kv head x seqlen_q <= 64, not fp64) */
  flare_tensor out;                /* written, (batch, seqlen_q, nheads, headdim_v) */
  flare_tensor softmax_lse;        /* written if present, fp32 (batch, nheads, seqlen_q) */
  flare_attn_options attn;
  flare_exec_options exec;
  /* Appended after 0.1.0, read only when struct_size covers it (absent otherwise): learnable attention
   * sinks as in the forward. */
  flare_tensor sinks;
} flare_kvcache_params;

FLARE_API void flare_kvcache_params_init(flare_kvcache_params* params);
FLARE_API flare_status flare_fwd_kvcache(const flare_kvcache_params* params);
FLARE_API flare_status flare_kvcache_workspace_size(const flare_kvcache_params* params, size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Merging partial attention states (cascade, prefix sharing, split-KV)                              */
/* ------------------------------------------------------------------------------------------------ */

/* Two attention results over disjoint key sets A and B, each with its softmax_lse, give the result over
 * A ∪ B:  m = max(lse_a, lse_b);  w_a = exp(lse_a - m);  w_b = exp(lse_b - m);
 *         out = (w_a out_a + w_b out_b) / (w_a + w_b);  lse = m + log(w_a + w_b).
 * A row whose two lse are -inf (no key in either set) gets out = 0, lse = -inf.
 * Layouts (flare's forward outputs): out_a, out_b, out (batch, seqlen, nheads, headdim) with lse_a, lse_b,
 * lse fp32 (batch, nheads, seqlen); or varlen out (total, nheads, headdim) with lse (nheads, total).
 * out_a, out_b and out share one dtype (fp32, fp16, bf16, fp64), computed in fp32 (fp64 for fp64).
 * out may be the very view of out_a or out_b (in place), lse of lse_a or lse_b; any other overlap between an
 * output and an input is not allowed. CPU tensors only: CUDA tensors are FLARE_UNSUPPORTED. */
typedef struct flare_merge_params {
  size_t struct_size;
  flare_tensor out_a, lse_a, out_b, lse_b;
  flare_tensor out; /* written */
  flare_tensor lse; /* written if present */
  flare_exec_options exec; /* num_threads as elsewhere; no workspace is used */
} flare_merge_params;

FLARE_API void flare_merge_params_init(flare_merge_params* params);
FLARE_API flare_status flare_merge_states(const flare_merge_params* params);

/* ------------------------------------------------------------------------------------------------ */
/* Dropout masks                                                                                      */
/* ------------------------------------------------------------------------------------------------ */

/* The keep mask a forward with these dropout parameters applies to sequence `sequence` (its batch index, or
 * its varlen index) of a call with `nheads` query heads: mask, (nheads, seqlen_q, seqlen_k) uint8 contiguous
 * host memory, gets 1 where (h, i, j) is kept and 0 where it is dropped (see "Dropout" above). For tests and
 * for FlashAttention's S_dmask; the passes never materialise it. dropout_p in [0, 1); sequence, nheads,
 * seqlen_q, seqlen_k >= 0 (nheads >= 1); mask non-null unless the mask is empty. */
FLARE_API flare_status flare_dropout_mask(float dropout_p, uint64_t dropout_seed, uint64_t dropout_offset,
                                          int64_t sequence, int64_t nheads, int64_t seqlen_q, int64_t seqlen_k,
                                          uint8_t* mask);

/* ------------------------------------------------------------------------------------------------ */
/* Introspection                                                                                      */
/* ------------------------------------------------------------------------------------------------ */

/* The SIMD level the CPU backend runs with on this machine, best first: "amx" (AVX-512 plus AMX-BF16 tiles,
 * used by bf16), "avx512bf16" (AVX-512 plus AVX512_BF16 dot products, used by bf16), "avx512", "avx2" or
 * "generic" (portable code, no ISA extension assumed). The environment variable FLARE_CPU_ISA
 * (amx | avx512bf16 | avx512 | avx2 | generic), read once per process, lowers it;
 * it never raises it past what the processor (and, for AMX, the operating system) supports. */
FLARE_API const char* flare_cpu_isa(void);

/* 1 if this build has a CUDA backend, else 0. */
FLARE_API int32_t flare_has_cuda(void);

/* How this library was built, as "key=value" lines (each ended by '\n'; the key ends at the first '='):
 *   version        the library version, as flare_version()
 *   compiler       the C++ compiler and its version, e.g. "GNU 12.2.0"
 *   cpu_isas       the CPU kernel levels compiled in, best first, e.g. "amx,avx512bf16,avx512,avx2,generic"
 *                  (flare_cpu_isa() says which of them this machine runs)
 *   cuda           1 with a CUDA backend, else 0 (as flare_has_cuda())
 *   cuda_version   nvcc's version ("" without CUDA)
 *   cuda_archs     the compute capabilities of the sm80-path kernels, e.g. "80,90" ("" without CUDA)
 *   cuda_sm90      1 when the sm90a (Hopper) forward kernels are in, else 0
 *   cuda_headdims  the head dims with CUDA kernels, e.g. "64,128" ("" without CUDA)
 *   cuda_passes    the passes with CUDA kernels: "fwd,bwd", or one of them in a kernel-development build
 *   cuda_reason    why the CUDA backend is in or out, e.g. "FLARE_CUDA=AUTO and no nvcc found (...)"
 * Keys may be added in later versions; readers should ignore keys they do not know. The string is static. */
FLARE_API const char* flare_build_config(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLARE_FLARE_H */
