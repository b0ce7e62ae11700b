// KDA decode step on NVIDIA GPUs, CUDA C++ behind the XLA FFI (built by cuda.py with nvcc at first use).
//
// Same math as pallas_gpu.py, one token per request:
//     q, k  <- L2-normalized (x * rsqrt(sum x^2 + 1e-6)) when asked, q scaled
//     g     <- the fused gate (activated, softplus or bounded), beta <- sigmoid(beta) when logits
//     S' = Diag(exp g) S;  e = beta (v - S'^T k);  S = S' + k e^T;  o = S'^T q + (k . q) e
//
// Why CUDA and not another Pallas variant: the step is a stream of the fp32 state (read once, written once), and
// the Triton-lowered kernels stayed at 83-88% of the copy bandwidth on the H200 whatever their tiles, orders and
// cache hints (H200 measurements), while XLA's own in-place fusion streams at 94-96%. Here each thread issues all of
// its state loads (16-byte vectors) before any other work, so they are in flight while the block loads and
// normalizes the vectors, and the block's only barriers are the three the reductions need.
//
// One block per (value column tile of BV, value head, request); THREADS threads, each holding 4 adjacent columns
// of PASSES key rows in registers. The state is aliased to the output (updated in place); slot -1 marks a padded
// request: it reads and writes no state and outputs zeros.
//
// On Hopper and later the step is launched as a programmatic dependent of the kernel before it in the stream: its
// blocks are scheduled while that kernel still runs and wait (griddepcontrol.wait) for its writes before reading
// anything, so a chain of decode steps (a model's layers) overlaps each launch with the step before.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kL2Eps = 1e-6f;  // reference.L2_EPS
constexpr unsigned kFullMask = 0xffffffffu;
enum Gate : int32_t { kActivated = 0, kSoftplus = 1, kBounded = 2 };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

struct Params {
  const void* q;          // [B, 1, H, K]
  const void* k;          // [B, 1, H, K]
  const void* v;          // [B, 1, HV, V]
  const float* g;         // [B, 1, HV, gate_dim]: raw gate (or the log decay when activated)
  const float* beta;      // [B, 1, HV]
  const float* a_log;     // [HV]
  const float* dt_bias;   // [HV, K]
  const float* scalars;   // [2]: scale, lower_bound
  const int32_t* slots;   // [B]: state row of each request, -1 padded (when has_slots; else request b owns row b)
  void* o;                // [B, 1, HV, V] in q's dtype
  float* state;           // [num_slots, HV, K, V], read and written in place
  int heads, value_heads, dv, gate_dim, gate, num_slots;
  bool beta_is_logits, use_qk_l2norm, has_slots;
};

__device__ __forceinline__ float log_decay(float raw, float a_log, float bias, int gate, float lower_bound) {
  if (gate == kActivated) return raw;
  raw += bias;
  const float rate = expf(a_log);
  if (gate == kSoftplus) return -rate * (raw > 20.f ? raw : log1pf(expf(raw)));
  return lower_bound / (1.f + expf(-rate * raw));
}

__device__ __forceinline__ float warp_sum(float x, int from_offset = 1) {
#pragma unroll
  for (int offset = 16; offset >= from_offset; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// Lets the next programmatic kernel in the stream be scheduled now, then waits until the grid before this one has
// finished and its writes are visible. Without a programmatic launch (or before Hopper) the wait returns at once.
__device__ __forceinline__ void await_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename In, int K, int BV, int THREADS, int BLOCKS_PER_SM>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM) kda_decode_kernel(Params p) {
  constexpr int LANES_PER_ROW = BV / 4;  // threads across a key row's BV columns, 4 columns (16 bytes) each
  constexpr int ROWS_PER_PASS = THREADS / LANES_PER_ROW;
  constexpr int PASSES = K / ROWS_PER_PASS;
  constexpr int WARPS = THREADS / 32;
  static_assert(LANES_PER_ROW <= 32 && THREADS % 32 == 0 && THREADS >= BV, "launch shape");
  static_assert(K % ROWS_PER_PASS == 0, "the key rows split evenly over the passes");

  __shared__ float q_s[K], k_s[K], decay_s[K];
  __shared__ float norms_s[WARPS][3];
  __shared__ __align__(16) float update_s[BV];  // read and written as float4: 16-byte aligned
  __shared__ __align__(16) float partial_s[WARPS][2][BV];

  await_previous_grid();  // before any global read or write
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int col0 = blockIdx.x * BV, head = blockIdx.y, request = blockIdx.z;
  const size_t head_row = static_cast<size_t>(request) * p.value_heads + head;  // row of v, g, beta and o
  In* out = static_cast<In*>(p.o) + head_row * p.dv + col0;
  // Without slots no index is loaded: a dependent memory round trip before the state's loads could issue.
  const int slot = p.has_slots ? p.slots[request] : request;
  if (slot < 0 || slot >= p.num_slots) {  // padded (and, traced past the checks, a row the pool lacks: no write)
    if (tid < BV) out[tid] = from_float<In>(0.f);
    return;
  }

  // The state tile first: every load issued before anything waits.
  float* tile = p.state + (static_cast<size_t>(slot) * p.value_heads + head) * K * p.dv + col0;
  const int col = (tid % LANES_PER_ROW) * 4, row0 = tid / LANES_PER_ROW;
  float4 state[PASSES];
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass)
    state[pass] =
        *reinterpret_cast<const float4*>(tile + static_cast<size_t>(row0 + pass * ROWS_PER_PASS) * p.dv + col);

  // The vectors, the gate and the norms' sums.
  const size_t qk_row = static_cast<size_t>(request) * p.heads + head / (p.value_heads / p.heads);
  const In* q = static_cast<const In*>(p.q) + qk_row * K;
  const In* k = static_cast<const In*>(p.k) + qk_row * K;
  const float* g = p.g + head_row * p.gate_dim;
  const float scale = p.scalars[0], lower_bound = p.scalars[1], a_log = p.a_log[head];
  const float v_col = tid < BV ? to_float(static_cast<const In*>(p.v)[head_row * p.dv + col0 + tid]) : 0.f;
  float beta = p.beta[head_row];
  if (p.beta_is_logits) beta = 1.f / (1.f + expf(-beta));
  float q_square = 0.f, k_square = 0.f, k_dot_q = 0.f;
  for (int i = tid; i < K; i += THREADS) {
    const float qi = to_float(q[i]), ki = to_float(k[i]);
    const float raw = g[p.gate_dim == 1 ? 0 : i];
    q_s[i] = qi;
    k_s[i] = ki;
    decay_s[i] = expf(log_decay(raw, a_log, p.dt_bias[static_cast<size_t>(head) * K + i], p.gate, lower_bound));
    q_square += qi * qi;
    k_square += ki * ki;
    k_dot_q += ki * qi;
  }
  q_square = warp_sum(q_square), k_square = warp_sum(k_square), k_dot_q = warp_sum(k_dot_q);
  if (lane == 0) norms_s[warp][0] = q_square, norms_s[warp][1] = k_square, norms_s[warp][2] = k_dot_q;
  __syncthreads();
  q_square = k_square = k_dot_q = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) q_square += norms_s[w][0], k_square += norms_s[w][1], k_dot_q += norms_s[w][2];
  const float inverse_k = p.use_qk_l2norm ? rsqrtf(k_square + kL2Eps) : 1.f;
  const float q_factor = (p.use_qk_l2norm ? rsqrtf(q_square + kL2Eps) : 1.f) * scale;
  k_dot_q *= inverse_k * q_factor;

  // Decay, then both reductions over K from the decayed state (o = S'^T q + (k . q) e needs no second pass).
  float4 sum_k = make_float4(0.f, 0.f, 0.f, 0.f), sum_q = sum_k;
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int row = row0 + pass * ROWS_PER_PASS;
    const float decay = decay_s[row], kr = k_s[row] * inverse_k, qr = q_s[row] * q_factor;
    float4& s = state[pass];
    s.x *= decay, s.y *= decay, s.z *= decay, s.w *= decay;
    sum_k.x += kr * s.x, sum_k.y += kr * s.y, sum_k.z += kr * s.z, sum_k.w += kr * s.w;
    sum_q.x += qr * s.x, sum_q.y += qr * s.y, sum_q.z += qr * s.z, sum_q.w += qr * s.w;
  }
  // Lanes LANES_PER_ROW apart hold the same columns: fold them, then the warps through shared memory.
  sum_k.x = warp_sum(sum_k.x, LANES_PER_ROW), sum_k.y = warp_sum(sum_k.y, LANES_PER_ROW);
  sum_k.z = warp_sum(sum_k.z, LANES_PER_ROW), sum_k.w = warp_sum(sum_k.w, LANES_PER_ROW);
  sum_q.x = warp_sum(sum_q.x, LANES_PER_ROW), sum_q.y = warp_sum(sum_q.y, LANES_PER_ROW);
  sum_q.z = warp_sum(sum_q.z, LANES_PER_ROW), sum_q.w = warp_sum(sum_q.w, LANES_PER_ROW);
  if (lane < LANES_PER_ROW) {
    *reinterpret_cast<float4*>(&partial_s[warp][0][col]) = sum_k;
    *reinterpret_cast<float4*>(&partial_s[warp][1][col]) = sum_q;
  }
  __syncthreads();
  if (tid < BV) {
    float decayed_k = 0.f, decayed_q = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) decayed_k += partial_s[w][0][tid], decayed_q += partial_s[w][1][tid];
    const float update = beta * (v_col - decayed_k);
    update_s[tid] = update;
    out[tid] = from_float<In>(decayed_q + k_dot_q * update);
  }
  __syncthreads();

  // The rank-1 update, stored in place.
  const float4 update = *reinterpret_cast<const float4*>(&update_s[col]);
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int row = row0 + pass * ROWS_PER_PASS;
    const float kr = k_s[row] * inverse_k;
    float4& s = state[pass];
    s.x += kr * update.x, s.y += kr * update.y, s.z += kr * update.z, s.w += kr * update.w;
    *reinterpret_cast<float4*>(tile + static_cast<size_t>(row) * p.dv + col) = s;
  }
}

bool supports_programmatic_launch() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, const Params& p, dim3 grid, int threads, bool programmatic, cudaStream_t stream) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic && supports_programmatic_launch() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p);
}

template <typename In, int K>
cudaError_t launch_for_dim(const Params& p, dim3 grid, int block_v, int threads, bool programmatic,
                           cudaStream_t stream) {
  // BLOCKS_PER_SM > 0 caps the registers so that many blocks fit on an SM at once: bv64 w4 at 128 registers keeps
  // 4 blocks per SM (nvcc has given it 131-141 uncapped, 3 blocks: 9.45 against 8.61 us at B = 8 on the H200).
#define HYBRAX_LAUNCH(BV, THREADS, BLOCKS_PER_SM)                                                             \
  if (block_v == BV && threads == THREADS)                                                                   \
    return launch(kda_decode_kernel<In, K, BV, THREADS, BLOCKS_PER_SM>, p, grid, THREADS, programmatic, stream);
  HYBRAX_LAUNCH(32, 64, 0)
  HYBRAX_LAUNCH(32, 128, 0)
  HYBRAX_LAUNCH(64, 128, 4)
  HYBRAX_LAUNCH(64, 256, 0)
  HYBRAX_LAUNCH(128, 256, 0)
#undef HYBRAX_LAUNCH
  return cudaErrorInvalidConfiguration;
}

template <typename In>
cudaError_t launch_for_type(const Params& p, int dk, dim3 grid, int block_v, int threads, bool programmatic,
                            cudaStream_t stream) {
  if (dk == 64) return launch_for_dim<In, 64>(p, grid, block_v, threads, programmatic, stream);
  if (dk == 128) return launch_for_dim<In, 128>(p, grid, block_v, threads, programmatic, stream);
  return cudaErrorInvalidValue;
}

std::string shape_text(ffi::AnyBuffer::Dimensions dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error KdaDecodeImpl(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32> g,
    ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> a_log, ffi::Buffer<ffi::F32> dt_bias,
    ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer /*state_in: aliased to state*/,
    ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> state, int32_t block_v, int32_t threads,
    int32_t gate, bool beta_is_logits, bool use_qk_l2norm, bool has_slots, bool programmatic) {
  // The Python wrapper checks every shape; these guard the memory the kernel touches.
  const auto q_dims = q.dimensions(), v_dims = v.dimensions(), state_dims = state->dimensions();
  if (q_dims.size() != 4 || v_dims.size() != 4 || state_dims.size() != 4 || q_dims[1] != 1)
    return ffi::Error::InvalidArgument("kda_decode_cuda: q " + shape_text(q_dims) + ", v " + shape_text(v_dims) +
                                       ", state " + shape_text(state_dims) + " must be [B, 1, H, K], [B, 1, HV, V] "
                                       "and [S, HV, K, V]");
  const int64_t batch = q_dims[0], heads = q_dims[2], dk = q_dims[3], value_heads = v_dims[2], dv = v_dims[3];
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      o->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("kda_decode_cuda: q, k, v and o must share one dtype");
  if (state_dims[1] != value_heads || state_dims[2] != dk || state_dims[3] != dv || dv % block_v)
    return ffi::Error::InvalidArgument("kda_decode_cuda: state " + shape_text(state_dims) + " does not match q " +
                                       shape_text(q_dims) + " and v " + shape_text(v_dims));
  Params p{q.untyped_data(), k.untyped_data(), v.untyped_data(), g.typed_data(), beta.typed_data(),
           a_log.typed_data(), dt_bias.typed_data(), scalars.typed_data(), slots.typed_data(), o->untyped_data(),
           state->typed_data(), static_cast<int>(heads), static_cast<int>(value_heads), static_cast<int>(dv),
           static_cast<int>(g.dimensions()[3]), gate, static_cast<int>(state_dims[0]), beta_is_logits,
           use_qk_l2norm, has_slots};
  const dim3 grid(static_cast<unsigned>(dv / block_v), static_cast<unsigned>(value_heads),
                  static_cast<unsigned>(batch));
  if (batch == 0) return ffi::Error::Success();
  cudaError_t (*launch_for_q)(const Params&, int, dim3, int, int, bool, cudaStream_t);
  switch (q.element_type()) {
    case ffi::DataType::BF16: launch_for_q = launch_for_type<__nv_bfloat16>; break;
    case ffi::DataType::F16: launch_for_q = launch_for_type<__half>; break;
    case ffi::DataType::F32: launch_for_q = launch_for_type<float>; break;
    default: return ffi::Error::InvalidArgument("kda_decode_cuda: q must be bfloat16, float16 or float32");
  }
  const cudaError_t status = launch_for_q(p, dk, grid, block_v, threads, programmatic, stream);
  if (status != cudaSuccess)
    return ffi::Error::Internal(std::string("kda_decode_cuda launch (K=") + std::to_string(dk) + ", block_v=" +
                                std::to_string(block_v) + ", threads=" + std::to_string(threads) +
                                "): " + cudaGetErrorString(status));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybraxKdaDecode, KdaDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // q
                                  .Arg<ffi::AnyBuffer>()             // k
                                  .Arg<ffi::AnyBuffer>()             // v
                                  .Arg<ffi::Buffer<ffi::F32>>()      // g
                                  .Arg<ffi::Buffer<ffi::F32>>()      // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()      // a_log
                                  .Arg<ffi::Buffer<ffi::F32>>()      // dt_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()      // scalars
                                  .Arg<ffi::Buffer<ffi::S32>>()      // slots
                                  .Arg<ffi::AnyBuffer>()             // state (aliased to the second result)
                                  .Ret<ffi::AnyBuffer>()             // o
                                  .Ret<ffi::Buffer<ffi::F32>>()      // state
                                  .Attr<int32_t>("block_v")
                                  .Attr<int32_t>("threads")
                                  .Attr<int32_t>("gate")
                                  .Attr<bool>("beta_is_logits")
                                  .Attr<bool>("use_qk_l2norm")
                                  .Attr<bool>("has_slots")
                                  .Attr<bool>("programmatic"),
                              {ffi::Traits::kCmdBufferCompatible});
