"""The one FLOP count every flare benchmark table uses (BENCH.md).

forward:  4 * batch * nheads * seqlen_q * seqlen_k * headdim   (two matmuls, 2 FLOPs per multiply-add),
          halved when causal (the convention: exactly half, whatever the lengths);
backward: 2.5 times the forward (five matmuls instead of two).
"""


def attention_flops(pass_, batch, nheads, seqlen_q, seqlen_k, headdim, causal):
    """FLOPs of one attention pass ("fwd" or "bwd") by the BENCH.md convention."""
    fwd = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        fwd /= 2.0
    if pass_ == "fwd":
        return fwd
    if pass_ == "bwd":
        return 2.5 * fwd
    raise ValueError(f"pass must be 'fwd' or 'bwd', got {pass_!r}")
