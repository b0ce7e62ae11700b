"""KDA on the TPU: Pallas Mosaic kernels, one file per stage.

    chunk_gates     the gate sums within a chunk (prefix / suffix sums, never a difference of cumsums)
    chunk_intra     A_qk, A_kk and the triangular solve T = (I + A_kk)^-1 on [C, C] tiles
    chunk_state     the inter-chunk step of the fp32 state
    chunk_fwd       the forward kernel (grid, blocks, layout) joining them
    chunk_state_bwd the inter-chunk step in reverse: dv_new and the state's cotangent
    chunk_grad      one chunk's gradients through the WY form (dL = -T^T dT T^T), the gates' suffix sums, the L2 norm
    chunk_intra_bwd the gradients through the pairwise decays of A_qk and A_kk
    chunk_bwd       the backward kernel (grid walked from the last chunk, blocks, layout) joining them
    dots            the MXU products' operand dtypes and passes
    layout          the kernels' rows: dense, or packed sequences from chunk boundaries with each chunk's sequence
                    scalar-prefetched; the vmap rule
    register        the "pallas_tpu:chunked" implementation of kernel_delta_attention (forward and backward)
    decode          the decode kernel on rows of a state pool, and "pallas_tpu:decode" (kernel_delta_attention, T = 1)
    pool_register   the "pallas_tpu:fused_recurrent" implementation of kda_decode_pool

Gated linear attention runs the same kernels, forward and backward, without the delta rule:
`ops/recurrent/pallas_tpu_chunked.py`.
"""
