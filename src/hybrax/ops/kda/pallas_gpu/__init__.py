"""KDA chunked on the GPU: Pallas kernels (Triton lowering), one file per stage, named as fla names them.

    chunked          "pallas:chunked": the registered implementation (supports, heuristic, the call)
    chunk            forward and backward joined by a custom VJP, packed sequences laid out; shared with gated
                     linear attention (`ops/recurrent/pallas_chunked.py`, the delta rule off)
    chunk_fwd        the forward end to end: stages 0-2, padding and cropping
    chunk_cumsum     stage 0: the chunk-local gate cumsum G (and its backward, a suffix sum)
    chunk_gates      how the kernels exponentiate log decays exactly for every gate <= 0 (steep chunks)
    chunk_intra      stage 1: A_kk, A_qk, T = (I + A_kk)^-1, the WY form w, u and the decayed kg, qg
    chunk_wy         stage 1's second half from a stored T (the backward's recompute)
    chunk_state      stage 2: the inter-chunk state pass h' = decay h + kg^T (u - w h), and o = qg h + A_qk v_new
    chunk_bwd        the backward end to end: recompute, then stages 2', 1', 1'', 0'
    chunk_state_bwd  stage 2': the state pass in reverse (dh per chunk, dv_new, d initial state)
    chunk_grad       stage 1': the chunk-local gradients, dA_qk and dA_kk
    chunk_intra_bwd  stage 1'': the gradients through A_qk and A_kk (pairwise decays)
    tiles            register-tile helpers: masked windows, launch order, packed-sequence chunks
"""
