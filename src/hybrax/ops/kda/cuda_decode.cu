// KDA decode step on NVIDIA GPUs, CUDA C++ behind the XLA FFI (built by cuda_decode.py with nvcc at first use).
//
// Same math as pallas_decode.py, one token per request:
//     q, k  <- L2-normalized (x * rsqrt(sum x^2 + 1e-6)) when asked, q scaled
//     g     <- the fused gate (activated, softplus or bounded), beta <- sigmoid(beta) when logits
//     S' = Diag(exp g) S;  e = beta (v - S'^T k);  S = S' + k e^T;  o = S'^T q + (k . q) e
//
// Why CUDA and not another Pallas variant: the step is a stream of the fp32 state (read once, written once), and
// the Triton-lowered kernels stayed at 83-88% of the copy bandwidth on the H200 whatever their tiles, orders and
// cache hints (BENCHMARKS.md), while XLA's own in-place fusion streams at 94-96%. Here each thread issues all of
// its state loads (16-byte vectors) before any other work, so they are in flight while the block loads and
// normalizes the vectors, and the block's only barriers are the three the reductions need.
//
// Two kernels share the step (load_head, update_tile). kda_decode_kernel: one block per (value column tile of BV,
// value head, request); THREADS threads, each holding 4 adjacent columns of PASSES key rows in registers.
// kda_decode_pipelined_kernel: a persistent block per SM over whole (request, value head) tiles, their loads and
// stores on Hopper's bulk copy engine through a few shared-memory stages. The state is aliased to the output
// (updated in place); slot -1 marks a padded request: it reads and writes no state and outputs zeros.

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

// How a block's THREADS threads cover a tile of K key rows x BV value columns: 4 adjacent columns (16 bytes)
// each, LANES_PER_ROW threads across a row, ROWS_PER_PASS rows at a time, PASSES passes down the keys.
template <int K, int BV, int THREADS>
struct TileLayout {
  static constexpr int LANES_PER_ROW = BV / 4;
  static constexpr int ROWS_PER_PASS = THREADS / LANES_PER_ROW;
  static constexpr int PASSES = K / ROWS_PER_PASS;
  static constexpr int WARPS = THREADS / 32;
  // A block of one warp joins its partial sums with shuffles alone: no shared staging and no barrier.
  static constexpr bool ONE_WARP = WARPS == 1;
  static_assert(LANES_PER_ROW <= 32 && THREADS % 32 == 0 && THREADS >= BV, "launch shape");
  static_assert(K % ROWS_PER_PASS == 0, "the key rows split evenly over the passes");
  __device__ static int col() { return (threadIdx.x % LANES_PER_ROW) * 4; }
  __device__ static int row(int pass) { return threadIdx.x / LANES_PER_ROW + pass * ROWS_PER_PASS; }
};

// What a block's threads share for one (request, value head): the vectors, the decay and the reductions' staging.
template <int K, int BV, int WARPS>
struct StepShared {
  float q[K], k[K], decay[K];
  float norms[WARPS][3];
  __align__(16) float update[BV];  // read and written as float4: 16-byte aligned
  __align__(16) float partial[WARPS][2][BV];
};

// One (request, value head)'s scalars, held by every thread once its vectors are in shared memory.
struct Head {
  float beta, inverse_k, q_factor, k_dot_q;
  float4 values;  // one warp: the lane's 4 columns of v; a larger block: column threadIdx.x of the tile in .x
};

// The state row of a request (-1: padded, or, traced past the checks, a row the pool lacks: no write). Without
// slots no index is loaded: a dependent memory round trip before the state's loads could issue.
__device__ __forceinline__ int slot_of(const Params& p, int request) {
  const int slot = p.has_slots ? p.slots[request] : request;
  return slot < 0 || slot >= p.num_slots ? -1 : slot;
}

// Loads q, k, v, the gate and beta of (request, head) for the tile at col0, and the norms: the step's first barrier.
template <typename In, int K, int BV, int THREADS>
__device__ __forceinline__ Head load_head(const Params& p, int request, int head, int col0,
                                          StepShared<K, BV, THREADS / 32>& shared) {
  using Layout = TileLayout<K, BV, THREADS>;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, col = Layout::col();
  const size_t head_row = static_cast<size_t>(request) * p.value_heads + head;  // row of v, g, beta and o
  const size_t qk_row = static_cast<size_t>(request) * p.heads + head / (p.value_heads / p.heads);
  const In* q = static_cast<const In*>(p.q) + qk_row * K;
  const In* k = static_cast<const In*>(p.k) + qk_row * K;
  const float* g = p.g + head_row * p.gate_dim;
  const float scale = p.scalars[0], lower_bound = p.scalars[1], a_log = p.a_log[head];
  Head h;
  const In* v_row = static_cast<const In*>(p.v) + head_row * p.dv + col0;
  h.values = make_float4(0.f, 0.f, 0.f, 0.f);
  if (Layout::ONE_WARP)
    h.values = make_float4(to_float(v_row[col]), to_float(v_row[col + 1]), to_float(v_row[col + 2]),
                           to_float(v_row[col + 3]));
  else if (tid < BV)
    h.values.x = to_float(v_row[tid]);
  h.beta = p.beta[head_row];
  if (p.beta_is_logits) h.beta = 1.f / (1.f + expf(-h.beta));
  float q_square = 0.f, k_square = 0.f, k_dot_q = 0.f;
  for (int i = tid; i < K; i += THREADS) {
    const float qi = to_float(q[i]), ki = to_float(k[i]);
    const float raw = g[p.gate_dim == 1 ? 0 : i];
    shared.q[i] = qi;
    shared.k[i] = ki;
    shared.decay[i] = expf(log_decay(raw, a_log, p.dt_bias[static_cast<size_t>(head) * K + i], p.gate, lower_bound));
    q_square += qi * qi;
    k_square += ki * ki;
    k_dot_q += ki * qi;
  }
  q_square = warp_sum(q_square), k_square = warp_sum(k_square), k_dot_q = warp_sum(k_dot_q);
  if constexpr (Layout::ONE_WARP) {
    __syncwarp();  // q, k and decay were written by other lanes
  } else {
    if (lane == 0) shared.norms[warp][0] = q_square, shared.norms[warp][1] = k_square, shared.norms[warp][2] = k_dot_q;
    __syncthreads();
    q_square = k_square = k_dot_q = 0.f;
#pragma unroll
    for (int w = 0; w < Layout::WARPS; ++w)
      q_square += shared.norms[w][0], k_square += shared.norms[w][1], k_dot_q += shared.norms[w][2];
  }
  h.inverse_k = p.use_qk_l2norm ? rsqrtf(k_square + kL2Eps) : 1.f;
  h.q_factor = (p.use_qk_l2norm ? rsqrtf(q_square + kL2Eps) : 1.f) * scale;
  h.k_dot_q = k_dot_q * h.inverse_k * h.q_factor;
  return h;
}

// The step on a tile held in registers: decay it, reduce it against k and q (o = S'^T q + (k . q) e needs no
// second pass), write the tile's outputs to `out` and add the rank-1 update. The step's second and third
// barriers (none for one warp).
template <typename In, int K, int BV, int THREADS>
__device__ __forceinline__ void update_tile(float4 (&state)[TileLayout<K, BV, THREADS>::PASSES], const Head& h,
                                            In* out, StepShared<K, BV, THREADS / 32>& shared) {
  using Layout = TileLayout<K, BV, THREADS>;
  constexpr int LANES_PER_ROW = Layout::LANES_PER_ROW;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, col = Layout::col();
  float4 sum_k = make_float4(0.f, 0.f, 0.f, 0.f), sum_q = sum_k;
#pragma unroll
  for (int pass = 0; pass < Layout::PASSES; ++pass) {
    const int row = Layout::row(pass);
    const float decay = shared.decay[row], kr = shared.k[row] * h.inverse_k, qr = shared.q[row] * h.q_factor;
    float4& s = state[pass];
    s.x *= decay, s.y *= decay, s.z *= decay, s.w *= decay;
    sum_k.x += kr * s.x, sum_k.y += kr * s.y, sum_k.z += kr * s.z, sum_k.w += kr * s.w;
    sum_q.x += qr * s.x, sum_q.y += qr * s.y, sum_q.z += qr * s.z, sum_q.w += qr * s.w;
  }
  // Lanes LANES_PER_ROW apart hold the same columns: fold them (every lane gets its columns' warp sums).
  sum_k.x = warp_sum(sum_k.x, LANES_PER_ROW), sum_k.y = warp_sum(sum_k.y, LANES_PER_ROW);
  sum_k.z = warp_sum(sum_k.z, LANES_PER_ROW), sum_k.w = warp_sum(sum_k.w, LANES_PER_ROW);
  sum_q.x = warp_sum(sum_q.x, LANES_PER_ROW), sum_q.y = warp_sum(sum_q.y, LANES_PER_ROW);
  sum_q.z = warp_sum(sum_q.z, LANES_PER_ROW), sum_q.w = warp_sum(sum_q.w, LANES_PER_ROW);
  float4 update;
  if constexpr (Layout::ONE_WARP) {  // the warp's sums are the block's
    const float4& v = h.values;
    update = make_float4(h.beta * (v.x - sum_k.x), h.beta * (v.y - sum_k.y), h.beta * (v.z - sum_k.z),
                         h.beta * (v.w - sum_k.w));
    if (tid < LANES_PER_ROW) {
      out[col] = from_float<In>(sum_q.x + h.k_dot_q * update.x);
      out[col + 1] = from_float<In>(sum_q.y + h.k_dot_q * update.y);
      out[col + 2] = from_float<In>(sum_q.z + h.k_dot_q * update.z);
      out[col + 3] = from_float<In>(sum_q.w + h.k_dot_q * update.w);
    }
  } else {  // then the warps' through shared memory
    if (lane < LANES_PER_ROW) {
      *reinterpret_cast<float4*>(&shared.partial[warp][0][col]) = sum_k;
      *reinterpret_cast<float4*>(&shared.partial[warp][1][col]) = sum_q;
    }
    __syncthreads();
    if (tid < BV) {
      float decayed_k = 0.f, decayed_q = 0.f;
#pragma unroll
      for (int w = 0; w < Layout::WARPS; ++w)
        decayed_k += shared.partial[w][0][tid], decayed_q += shared.partial[w][1][tid];
      const float column_update = h.beta * (h.values.x - decayed_k);
      shared.update[tid] = column_update;
      out[tid] = from_float<In>(decayed_q + h.k_dot_q * column_update);
    }
    __syncthreads();
    update = *reinterpret_cast<const float4*>(&shared.update[col]);
  }
#pragma unroll
  for (int pass = 0; pass < Layout::PASSES; ++pass) {
    const float kr = shared.k[Layout::row(pass)] * h.inverse_k;
    float4& s = state[pass];
    s.x += kr * update.x, s.y += kr * update.y, s.z += kr * update.z, s.w += kr * update.w;
  }
}

template <typename In>
__device__ __forceinline__ void write_zeros(In* out, int count) {
  if (threadIdx.x < count) out[threadIdx.x] = from_float<In>(0.f);
}

// One block per (value column tile of BV, value head, request); each thread loads its part of the state tile
// into registers before any other work.
template <typename In, int K, int BV, int THREADS, int BLOCKS_PER_SM>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM) kda_decode_kernel(Params p) {
  using Layout = TileLayout<K, BV, THREADS>;
  __shared__ StepShared<K, BV, Layout::WARPS> shared;
  const int col0 = blockIdx.x * BV, head = blockIdx.y, request = blockIdx.z;
  In* out = static_cast<In*>(p.o) + (static_cast<size_t>(request) * p.value_heads + head) * p.dv + col0;
  const int slot = slot_of(p, request);
  if (slot < 0) return write_zeros(out, BV);

  float* tile = p.state + (static_cast<size_t>(slot) * p.value_heads + head) * K * p.dv + col0;
  const int col = Layout::col();
  float4 state[Layout::PASSES];
#pragma unroll
  for (int pass = 0; pass < Layout::PASSES; ++pass)
    state[pass] = *reinterpret_cast<const float4*>(tile + static_cast<size_t>(Layout::row(pass)) * p.dv + col);
  const Head h = load_head<In, K, BV, THREADS>(p, request, head, col0, shared);
  update_tile<In, K, BV, THREADS>(state, h, out, shared);
#pragma unroll
  for (int pass = 0; pass < Layout::PASSES; ++pass)
    *reinterpret_cast<float4*>(tile + static_cast<size_t>(Layout::row(pass)) * p.dv + col) = state[pass];
}

// Hopper's bulk copy engine (cp.async.bulk, sm_90): global <-> shared copies that complete on an mbarrier (loads)
// or in bulk groups (stores), issued by one thread while the block computes. Compiled for sm_90 and newer only.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define HYBRAX_BULK_COPY 1
namespace bulk {
__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}
__device__ __forceinline__ void init(uint64_t* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barrier)) : "memory");
}
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void load(float* destination, const float* source, unsigned bytes, uint64_t* barrier) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(destination)), "l"(source), "r"(bytes), "r"(shared_address(barrier))
               : "memory");
}
__device__ __forceinline__ void arrive(uint64_t* barrier) {  // completes the phase with no copy (a padded request)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
}
__device__ __forceinline__ void wait(uint64_t* barrier, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
}
// Orders this thread's ordinary shared-memory writes before the copy engine's reads of them.
__device__ __forceinline__ void fence_writes() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void store(float* destination, const float* source, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(destination),
               "r"(shared_address(source)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void wait_stores_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void wait_stores() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
}  // namespace bulk
#endif

// A persistent block per SM over whole (request, value head) tiles of K x DV (contiguous in the state, one bulk
// copy each), STAGES deep: thread 0 keeps the next tiles' loads in flight on the copy engine while the block
// steps the current one in registers and stores it back through shared memory. Tile i of the block is
// blockIdx.x + i * gridDim.x; the grid divides the tiles as evenly as it can, so no block runs a ragged last round.
template <typename In, int K, int DV, int THREADS, int STAGES>
__global__ void __launch_bounds__(THREADS, 1) kda_decode_pipelined_kernel(Params p, int tiles) {
#ifdef HYBRAX_BULK_COPY
  using Layout = TileLayout<K, DV, THREADS>;
  constexpr int TILE = K * DV;
  extern __shared__ __align__(128) float stages_s[];  // [STAGES][K][DV]
  __shared__ StepShared<K, DV, Layout::WARPS> shared;
  __shared__ __align__(8) uint64_t loaded[STAGES];
  const int tid = threadIdx.x, col = Layout::col();
  const int count = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto issue = [&](int i) {  // thread 0: tile i's state into stage i % STAGES
    const int tile = blockIdx.x + i * gridDim.x, slot = slot_of(p, tile / p.value_heads);
    uint64_t* barrier = &loaded[i % STAGES];
    if (slot < 0) return bulk::arrive(barrier);
    const float* source = p.state + (static_cast<size_t>(slot) * p.value_heads + tile % p.value_heads) * TILE;
    bulk::load(stages_s + (i % STAGES) * TILE, source, TILE * 4, barrier);
  };
  if (tid == 0) {
    for (int stage = 0; stage < STAGES; ++stage) bulk::init(&loaded[stage]);
    bulk::fence_init();
    for (int i = 0; i < STAGES && i < count; ++i) issue(i);
  }
  __syncthreads();
  for (int i = 0; i < count; ++i) {
    // Refill the stage the previous tile left once the copy engine has read it out.
    if (tid == 0 && i > 0 && i - 1 + STAGES < count) {
      bulk::wait_stores_read();
      issue(i - 1 + STAGES);
    }
    const int tile = blockIdx.x + i * gridDim.x, request = tile / p.value_heads, head = tile % p.value_heads;
    In* out = static_cast<In*>(p.o) + (static_cast<size_t>(request) * p.value_heads + head) * DV;
    const int slot = slot_of(p, request);
    if (slot < 0) {
      write_zeros(out, DV);
      continue;
    }
    const Head h = load_head<In, K, DV, THREADS>(p, request, head, 0, shared);
    float* stage = stages_s + (i % STAGES) * TILE;
    bulk::wait(&loaded[i % STAGES], (i / STAGES) & 1);
    float4 state[Layout::PASSES];
#pragma unroll
    for (int pass = 0; pass < Layout::PASSES; ++pass)
      state[pass] = *reinterpret_cast<const float4*>(stage + Layout::row(pass) * DV + col);
    update_tile<In, K, DV, THREADS>(state, h, out, shared);
#pragma unroll
    for (int pass = 0; pass < Layout::PASSES; ++pass)
      *reinterpret_cast<float4*>(stage + Layout::row(pass) * DV + col) = state[pass];
    bulk::fence_writes();
    __syncthreads();
    if (tid == 0) bulk::store(p.state + (static_cast<size_t>(slot) * p.value_heads + head) * TILE, stage, TILE * 4);
  }
  if (tid == 0) bulk::wait_stores();
#endif
}

// A launch: value columns per block, threads per block, and either the blocks each SM must hold at once (0: the
// compiler's register choice; more resident blocks cap the registers) or, with stages > 0, the pipelined kernel
// that deep (block_v then covers the whole value axis).
struct Launch {
  int block_v, threads, blocks_per_sm, stages;
};

int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&value, attribute, device);
  return value;
}

template <typename In, int K, int DV, int THREADS, int STAGES>
cudaError_t launch_pipelined(const Params& p, int tiles, cudaStream_t stream) {
  constexpr int BYTES = STAGES * K * DV * 4;
  static const int multiprocessors = device_attribute(cudaDevAttrMultiProcessorCount);
  static const bool has_bulk_copy = device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9;
  if (!has_bulk_copy) return cudaErrorInvalidDeviceFunction;  // cuda_decode.py picks stages on sm_90 and newer only
  auto* kernel = kda_decode_pipelined_kernel<In, K, DV, THREADS, STAGES>;
  static const cudaError_t opted_in = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, BYTES);
  if (opted_in != cudaSuccess) return opted_in;
  const int per_block = (tiles + multiprocessors - 1) / multiprocessors;
  kernel<<<(tiles + per_block - 1) / per_block, THREADS, BYTES, stream>>>(p, tiles);
  return cudaGetLastError();
}

template <typename In, int K>
cudaError_t launch_for_dim(const Params& p, dim3 grid, Launch launch, cudaStream_t stream) {
#define HYBRAX_LAUNCH(BV, THREADS, BLOCKS_PER_SM)                                                    \
  if (launch.block_v == BV && launch.threads == THREADS && launch.blocks_per_sm == BLOCKS_PER_SM &&   \
      !launch.stages) {                                                                               \
    kda_decode_kernel<In, K, BV, THREADS, BLOCKS_PER_SM><<<grid, THREADS, 0, stream>>>(p);           \
    return cudaGetLastError();                                                                        \
  }
  HYBRAX_LAUNCH(16, 32, 0)
  HYBRAX_LAUNCH(16, 32, 16)
  HYBRAX_LAUNCH(32, 64, 0)
  HYBRAX_LAUNCH(32, 128, 0)
  HYBRAX_LAUNCH(64, 128, 0)
  HYBRAX_LAUNCH(64, 256, 0)
  HYBRAX_LAUNCH(128, 256, 0)
  HYBRAX_LAUNCH(32, 64, 12)
  HYBRAX_LAUNCH(32, 128, 6)
  HYBRAX_LAUNCH(32, 128, 8)
  HYBRAX_LAUNCH(64, 128, 4)
  HYBRAX_LAUNCH(64, 128, 5)
  HYBRAX_LAUNCH(64, 256, 3)
  HYBRAX_LAUNCH(64, 256, 4)
  HYBRAX_LAUNCH(128, 256, 2)
#undef HYBRAX_LAUNCH
  const int tiles = static_cast<int>(grid.y * grid.z);
#define HYBRAX_PIPELINED(DV, THREADS, STAGES)                                                       \
  if (p.dv == DV && launch.block_v == DV && launch.threads == THREADS && launch.stages == STAGES) \
    return launch_pipelined<In, K, DV, THREADS, STAGES>(p, tiles, stream);
  HYBRAX_PIPELINED(128, 256, 2)
  HYBRAX_PIPELINED(128, 256, 3)
  HYBRAX_PIPELINED(128, 512, 3)
#undef HYBRAX_PIPELINED
  return cudaErrorInvalidConfiguration;
}

template <typename In>
cudaError_t launch_for_type(const Params& p, int dk, dim3 grid, Launch launch, cudaStream_t stream) {
  if (dk == 64) return launch_for_dim<In, 64>(p, grid, launch, stream);
  if (dk == 128) return launch_for_dim<In, 128>(p, grid, launch, stream);
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
    int32_t blocks_per_sm, int32_t stages, int32_t gate, bool beta_is_logits, bool use_qk_l2norm, bool has_slots) {
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
  const Launch launch{block_v, threads, blocks_per_sm, stages};
  cudaError_t status;
  switch (q.element_type()) {
    case ffi::DataType::BF16: status = launch_for_type<__nv_bfloat16>(p, dk, grid, launch, stream); break;
    case ffi::DataType::F16: status = launch_for_type<__half>(p, dk, grid, launch, stream); break;
    case ffi::DataType::F32: status = launch_for_type<float>(p, dk, grid, launch, stream); break;
    default: return ffi::Error::InvalidArgument("kda_decode_cuda: q must be bfloat16, float16 or float32");
  }
  if (status != cudaSuccess)
    return ffi::Error::Internal(std::string("kda_decode_cuda launch (K=") + std::to_string(dk) + ", block_v=" +
                                std::to_string(block_v) + ", threads=" + std::to_string(threads) +
                                ", blocks_per_sm=" + std::to_string(blocks_per_sm) +
                                ", stages=" + std::to_string(stages) +
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
                                  .Attr<int32_t>("blocks_per_sm")
                                  .Attr<int32_t>("stages")
                                  .Attr<int32_t>("gate")
                                  .Attr<bool>("beta_is_logits")
                                  .Attr<bool>("use_qk_l2norm")
                                  .Attr<bool>("has_slots"),
                              {ffi::Traits::kCmdBufferCompatible});
