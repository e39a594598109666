// validate_merge.cpp — flare_merge_params to a checked MergeProblem (the rules are in flare.h and
// docs/api.md#merging-attention-states).
#include <cstddef>

#include "api/checks.hpp"
#include "api/validate.hpp"

namespace flare::detail {

flare_status validate_merge(const flare_merge_params* params, MergeProblem* problem) {
  return run_checks([&] {
    check_struct_size(params, params ? params->struct_size : 0, sizeof(flare_merge_params), "flare_merge_params");
    const flare_merge_params& m = *params;
    const std::pair<const flare_tensor*, const char*> outs[] = {{&m.out_a, "out_a"}, {&m.out_b, "out_b"},
                                                               {&m.out, "out"}};
    const std::pair<const flare_tensor*, const char*> lses[] = {{&m.lse_a, "lse_a"}, {&m.lse_b, "lse_b"},
                                                               {&m.lse, "lse"}};
    for (const auto& [t, name] : outs) require_present(*t, name);
    require_present(m.lse_a, "lse_a");
    require_present(m.lse_b, "lse_b");
    for (const auto* group : {outs, lses}) {
      for (int i = 0; i < 3; ++i) {
        const auto& [t, name] = group[i];
        if (!is_present(*t)) continue;
        check_tensor(*t, name);
        require_same_device(*t, name, m.out_a, "out_a");
      }
    }
    if (m.out_a.device.type != FLARE_DEVICE_CPU) {
      reject_unsupported(cat("out_a is on ", device_name(m.out_a.device),
                             ": flare_merge_states runs on the CPU only (merge CUDA tensors with the framework's "
                             "own elementwise ops, as flare.merge_attention_states does)"));
    }
    const flare_tensor& a = m.out_a;
    if (a.rank != 3 && a.rank != 4) {
      reject(cat("out_a has shape ", shape_string(a),
                 ": it must be (batch, seqlen, nheads, headdim) or varlen (total, nheads, headdim)"));
    }
    const bool varlen = a.rank == 3;
    if (a.dtype != FLARE_DTYPE_F32 && a.dtype != FLARE_DTYPE_F16 && a.dtype != FLARE_DTYPE_BF16 &&
        a.dtype != FLARE_DTYPE_F64) {
      reject(cat("out_a has dtype ", a.dtype, ": merged outputs are fp32, fp16, bf16 or fp64"));
    }
    const int64_t batch = varlen ? 1 : a.shape[0];
    const int64_t seqlen = varlen ? a.shape[0] : a.shape[1];
    const int64_t nheads = a.shape[a.rank - 2];
    const int64_t headdim = a.shape[a.rank - 1];
    for (int i = 1; i < 3; ++i) {
      const auto& [t, name] = outs[i];
      require_same_dtype(*t, name, a, "out_a");
      if (varlen) {
        require_shape(*t, name, {seqlen, nheads, headdim}, "(total, nheads, headdim) of out_a");
      } else {
        require_shape(*t, name, {batch, seqlen, nheads, headdim}, "(batch, seqlen, nheads, headdim) of out_a");
      }
    }
    for (const auto& [t, name] : lses) {
      if (!is_present(*t)) continue;
      require_dtype(*t, name, FLARE_DTYPE_F32, "softmax_lse is fp32");
      if (varlen) {
        require_shape(*t, name, {nheads, seqlen}, "(nheads, total) for varlen outputs");
      } else {
        require_shape(*t, name, {batch, nheads, seqlen}, "(batch, nheads, seqlen)");
      }
    }
    require_no_overlap(m.out, "out");
    if (is_present(m.lse)) require_no_overlap(m.lse, "lse");
    Problem exec;
    check_exec_options(m.exec, m.out_a.device, &exec);

    MergeProblem p;
    p.dtype = static_cast<flare_dtype>(a.dtype);
    p.batch = batch;
    p.seqlen = seqlen;
    p.nheads = nheads;
    p.headdim = headdim;
    const auto operand = varlen ? varlen_operand : dense_operand;
    p.out_a = operand(m.out_a);
    p.out_b = operand(m.out_b);
    p.out = operand(m.out);
    const auto rows = [&](const flare_tensor& t) {
      if (!is_present(t)) return LseRows{};
      if (varlen) return LseRows{static_cast<float*>(t.data), 0, t.strides[0]};
      return LseRows{static_cast<float*>(t.data), t.strides[0], t.strides[1]};
    };
    p.lse_a = rows(m.lse_a);
    p.lse_b = rows(m.lse_b);
    p.lse = rows(m.lse);
    p.num_threads = exec.num_threads;
    *problem = p;
  });
}

}  // namespace flare::detail
