"""KDA on XLA: plain JAX, every device (the CPU's implementations, the fallback elsewhere).

    chunked   "xla:chunked": the chunked WY / UT form (A_kk, A_qk, T = (I + A_kk)^-1, a state pass over chunks)
              with its custom VJP (`chunked_backward`)
    scan      "xla:scan": the token-by-token recurrence S' = Diag(exp g) S + k (beta (v - S'^T k))^T, o = S^T q;
              "xla:single_step": the same step once, for T = 1 decode with a state (`common/delta.py`)
"""
