"""KDA decode on the GPU: the fused single-token step S' = Diag(exp g) S + k (beta (v - S'^T k))^T, o = S^T q,
the fp32 state read and written once, in place (a serving pool's rows too).

    pallas_gpu     "pallas:decode": the Pallas kernel (Triton lowering); fused gate, beta and L2 norm
    cuda           "cuda:decode": the same step in CUDA C++ behind the XLA FFI, built with nvcc at first use
    cuda_decode.cu the CUDA source `cuda` builds (package data)
    operands       what both kernels take besides the arrays: the gate's form (GATES), the scalar operand

The XLA step for T = 1 is "xla:single_step" in `xla/scan.py`; the TPU's decode kernel is in `pallas_tpu/`.
`kda_tkg` (the NKI token-generation API, `ops/kda/tkg.py`) stays at the op's root: it is a public function
in its own layouts that picks among these kernels and the XLA step, not a kernel of this family.
"""
