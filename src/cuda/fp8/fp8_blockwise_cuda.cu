// The CUDA backend of the FP8 recipe (ops/fp8_blockwise_backend.h): the quantizers of
// fp8_quantize_cuda.cuh, the dequantizers (the exact inverses: the rowwise one tiled as the
// quantizer, the others plain elementwise, for tests and debugging), and the three GEMMs through
// the sm90 FP8 grouped GEMMs (built in ALL builds; elsewhere they are refused with an error that
// says so). Outputs are bf16, the recipe's layer dtype. No host sync: group offsets stay on the
// device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/dispatch_dtype.h"
#include "common/fp8_blockwise.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_stream.h"
#include "cuda/element.cuh"
#include "cuda/fp8/fp8_quantize_cuda.cuh"
#include "cuda/grouped_linear/grouped_gemm_fp8_params.h"
#include "cuda/runtime_cuda.h"
#include "ops/fp8_blockwise_backend.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

using cuda::Fp8GemmArgs;
using cuda::Fp8Variant;
using cuda::as_cuda;

unsigned blocks_for(int64_t work, int per_block) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, 65535)));
}

// The rowwise dequantizer, fp8_saved_activations' restore in backward (and the tests'): the
// quantizer's tiling, grid (max tiles, KB), block 256, the block's (128-token tile of one expert,
// 128-column tile) sixteen threads a row, eight codes each, a thread's eight rows all loaded before
// any is written; the tile's expert from expert_tile, no search per row. Each value is
// fp8_dequantize's, the reference's (a code times a power of two: exact in fp32 and bf16, fp16
// rounds at its range's ends), stored in D (fp32, bf16 or fp16). Rows past the experts' (the tail
// below T) are left as they are. kVec (2-byte D): 8-byte code loads and 16-byte stores (K and the
// destination's row stride multiples of 8, its columns contiguous, the bases aligned).
template <class D, bool kVec>
__global__ void __launch_bounds__(256) dequantize_rowwise_kernel(const int64_t* offsets, int64_t G, const uint8_t* q,
                                                                 const float* scale, int64_t K, D* dst, int64_t ld0,
                                                                 int64_t ld1) {
  using cuda::fp8::kRowThreads;
  using cuda::fp8::kTile;
  constexpr int kRowsPerPass = 256 / kRowThreads, kPasses = kTile / kRowsPerPass;
  const cuda::fp8::ExpertTile et = cuda::fp8::expert_tile(offsets, G, blockIdx.x);  // the whole warp
  if (et.g == G) return;
  const int64_t begin = offsets[et.g], rows = offsets[et.g + 1] - begin, t = blockIdx.x - et.base;
  const int64_t KB = fp8_tiles(K), kb = blockIdx.y, k = kb * kTile + (threadIdx.x % kRowThreads) * 8;
  if (k >= K) return;
  uint2 codes[kPasses];
  float s[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t r = begin + t * kTile + threadIdx.x / kRowThreads + kRowsPerPass * p;
    if (r >= begin + rows) break;
    s[p] = scale[fp8_rowwise_scale_index(begin, rows, KB, r, kb)];
    const uint8_t* row = q + r * K + k;
    if constexpr (kVec) {
      codes[p] = *reinterpret_cast<const uint2*>(row);
    } else {
      uint64_t w = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (k + j < K) w |= uint64_t(row[j]) << (8 * j);
      codes[p] = make_uint2(uint32_t(w), uint32_t(w >> 32));
    }
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t r = begin + t * kTile + threadIdx.x / kRowThreads + kRowsPerPass * p;
    if (r >= begin + rows) break;
    cuda::Pack<D, 8> v;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      v.v[j] = fp8_dequantize(uint8_t((j < 4 ? codes[p].x : codes[p].y) >> (8 * (j % 4))), s[p]);
    if constexpr (kVec) {
      v.store(dst + r * ld0 + k);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (k + j < K) cuda::store_f32(dst, r * ld0 + (k + j) * ld1, v.v[j]);
    }
  }
}

// Plain elementwise dequantizers of the other layouts (the exact inverses, for tests and
// debugging): one thread an element, rows below S.
__global__ void dequantize_columnwise_kernel(const int64_t* offsets, int64_t G, const uint8_t* q, const float* scale,
                                             int64_t T, int64_t C, int64_t columns, float* dst, int64_t ld0,
                                             int64_t ld1) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < T * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    if (r >= offsets[G]) return;
    const int64_t g = group_of_row(offsets, G, r), base = fp8_columnwise_tile_base(offsets, g);
    const float s = scale[fp8_columnwise_scale_index(base, (r - offsets[g]) / kFp8Tile, C, c)];
    dst[r * ld0 + c * ld1] = fp8_dequantize(q[fp8_columnwise_data_index(columns, base, offsets[g], r, c)], s);
  }
}

__global__ void dequantize_blocks_kernel(const uint8_t* q, const float* scale, int64_t R, int64_t C, float* dst,
                                         int64_t ld0, int64_t ld1) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < R * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    dst[r * ld0 + c * ld1] = fp8_dequantize(q[i], scale[fp8_block_scale_index(C, r, c)]);
  }
}

// The quantizers' 16-byte loads of 2-byte elements: rows of a multiple of 8 elements (K and the
// stride), 16-byte aligned bases (then the codes' rows, K bytes each, are 8-byte aligned).
bool vector_loads(const TensorView& src, int64_t K, const void* codes) {
  return K % 8 == 0 && src.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(src.data()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(codes) % 16 == 0;
}

// 16 codes a store: columns and tile bases are multiples of 128, the base must be 16-byte aligned.
void check_columnwise_codes(const Fp8Tensor& codes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(codes.data.data());
  ST_CHECK_ARG(a % 16 == 0, "columnwise codes", "a 16-byte aligned base",
               "an address of " + std::to_string(a % 16) + " mod 16");
}

// Nothing to quantize: no channels, or no 128-token tile (no rows).
bool no_tiles(const TensorView& src, const TensorView& src_rows, const Fp8Groups& groups) {
  return src.size(1) == 0 || fp8_columnwise_max_tiles(fp8_operand_rows(src, src_rows), groups.num_groups) == 0;
}

const int32_t* rows_of(const TensorView& src_rows) {
  return src_rows.defined() ? src_rows.data_as<const int32_t>() : nullptr;
}

// The tile kernel for the layouts asked for (codes where non-null; columnwise: 2-byte elements).
template <typename E>
void launch_tile(const Fp8Groups& groups, const TensorView& src, const TensorView& src_rows, const Fp8Tensor* rowwise,
                 const Fp8Tensor* columnwise, cudaStream_t s) {
  const int64_t T = fp8_operand_rows(src, src_rows), K = src.size(1), G = groups.num_groups;
  if (columnwise) check_columnwise_codes(*columnwise);
  const dim3 grid(unsigned(fp8_columnwise_max_tiles(T, G)), unsigned(fp8_tiles(K)));
  auto launch = [&](auto vec, auto row, auto col) {
    cuda::fp8::quantize_tile_kernel<E, decltype(vec)::value, decltype(row)::value, decltype(col)::value>
        <<<grid, 256, 0, s>>>(groups.offsets, G, src.data_as<const E>(), src.stride(0), rows_of(src_rows), K,
                              row ? rowwise->data.data_as<uint8_t>() : nullptr,
                              row ? rowwise->scale.data_as<float>() : nullptr, col ? columnwise->data.size(1) : 0,
                              col ? columnwise->data.data_as<uint8_t>() : nullptr,
                              col ? columnwise->scale.data_as<float>() : nullptr);
  };
  auto layouts = [&](auto vec) {
    if constexpr (sizeof(E) == 2) {
      if (rowwise && columnwise) return launch(vec, std::true_type{}, std::true_type{});
      if (columnwise) return launch(vec, std::false_type{}, std::true_type{});
    }
    launch(vec, std::true_type{}, std::false_type{});
  };
  if (sizeof(E) == 2 && vector_loads(src, K, (rowwise ? rowwise : columnwise)->data.data()))
    return layouts(std::true_type{});
  layouts(std::false_type{});
}

template <typename E>
void launch_columnwise(const Fp8QuantizeParams& p, cudaStream_t s) {
  if constexpr (sizeof(E) == 2) {
    launch_tile<E>(p.groups, p.src, p.src_rows, nullptr, &p.dst, s);
  } else {
    const int64_t T = fp8_operand_rows(p.src, p.src_rows), C = p.src.size(1), G = p.groups.num_groups;
    check_columnwise_codes(p.dst);
    const dim3 grid(unsigned(fp8_columnwise_max_tiles(T, G)),
                    unsigned((C + cuda::fp8::kColChannels - 1) / cuda::fp8::kColChannels));
    cuda::fp8::quantize_columnwise_kernel<E><<<grid, 256, 0, s>>>(p.groups.offsets, G, p.src.data_as<const E>(),
                                                                   p.src.stride(0), rows_of(p.src_rows), C,
                                                                   p.dst.data.size(1),
                                                                   p.dst.data.data_as<uint8_t>(),
                                                                   p.dst.scale.data_as<float>());
  }
}

template <typename E>
void launch_both(const Fp8QuantizeBothParams& p, cudaStream_t s) {
  if constexpr (sizeof(E) == 2) {
    launch_tile<E>(p.groups, p.src, p.src_rows, &p.rowwise, &p.columnwise, s);
  } else {  // fp32: no staged tile; two passes
    launch_tile<E>(p.groups, p.src, p.src_rows, &p.rowwise, nullptr, s);
    launch_columnwise<E>({p.groups, p.src, p.columnwise, p.src_rows}, s);
  }
}

template <typename E>
void launch_weights(const Fp8WeightQuantizeParams& p, cudaStream_t s) {
  const int64_t G = int64_t(p.w.size()), out = p.w[0].size(0), in = p.w[0].size(1);
  cuda::with_group_cap(G, [&](auto cap) {
    constexpr int kCap = decltype(cap)::value;
    cuda::fp8::WeightTables<kCap> t;
    for (int64_t g = 0; g < G; ++g) {
      t.w[g] = p.w[g].data();
      t.q[g] = p.wq[g].data.data_as<uint8_t>();
      t.qt[g] = p.wtq[g].data.data_as<uint8_t>();
      t.s[g] = p.wq[g].scale.data_as<float>();
      t.st[g] = p.wtq[g].scale.data_as<float>();
    }
    const dim3 grid(unsigned(fp8_tiles(out)), unsigned(fp8_tiles(in)), unsigned(G));
    bool vec = false;
    if constexpr (sizeof(E) == 2) {
      vec = in % 8 == 0;
      for (int64_t g = 0; g < G; ++g)
        vec = vec && p.w[g].stride(0) == in && reinterpret_cast<uintptr_t>(p.w[g].data()) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(t.q[g]) % 8 == 0;
    }
    if (vec)
      cuda::fp8::quantize_weights_kernel<E, kCap, (sizeof(E) == 2)><<<grid, 256, 0, s>>>(t, out, in);
    else
      cuda::fp8::quantize_weights_kernel<E, kCap, false><<<grid, 256, 0, s>>>(t, out, in);
  });
}

// The GEMMs' group limit: the per-group tables are kernel parameters.
void check_groups(int64_t G) {
  ST_CHECK_ARG(G <= cuda::kMaxGroups, "num_groups", "<= " + std::to_string(cuda::kMaxGroups) + " (CUDA FP8 GEMMs)",
               G);
}

void check_bf16(DType dtype) {
  ST_CHECK_ARG(dtype == DType::kBF16, "dtype", "bf16 (the FP8 recipe's layer dtype on CUDA)", dtype_name(dtype));
}

#if SPARSETRAIN_WITH_FP8_GEMMS
template <Fp8Variant V>
void run_gemm(const Fp8GemmArgs& a, void* scratch, size_t bytes, cudaStream_t s) {
  cuda::sm90::run_fp8<V>(a, scratch, bytes, s);
}
size_t gemm_workspace(int64_t G) {
  return std::max({cuda::sm90::fp8_workspace_bytes<Fp8Variant::kActWeight>(G),
                   cuda::sm90::fp8_workspace_bytes<Fp8Variant::kWgrad>(G),
                   cuda::sm90::fp8_workspace_bytes<Fp8Variant::kWgradF32>(G)});
}
#else
template <Fp8Variant>
void run_gemm(const Fp8GemmArgs&, void*, size_t, cudaStream_t) {
  ST_FAIL("CUDA FP8 GEMMs: not in this build (SPARSETRAIN_SM90_KERNELS=ALL builds them)");
}
size_t gemm_workspace(int64_t) { return 0; }
#endif

class CudaFp8Backend final : public Fp8BlockwiseBackend {
 public:
  void quantize_rowwise(const Fp8QuantizeParams& p, Stream stream) override {
    if (no_tiles(p.src, p.src_rows, p.groups)) return;
    cuda::DeviceGuard guard(p.src.device().index);
    dispatch_dtype(p.src.dtype(), "CUDA FP8 quantize", [&](auto e) {
      launch_tile<decltype(e)>(p.groups, p.src, p.src_rows, &p.dst, nullptr, as_cuda(stream));
    });
    ST_CUDA_CHECK(cudaGetLastError(), "quantize_rowwise launch");
  }
  void quantize_columnwise(const Fp8QuantizeParams& p, Stream stream) override {
    if (no_tiles(p.src, p.src_rows, p.groups)) return;
    cuda::DeviceGuard guard(p.src.device().index);
    dispatch_dtype(p.src.dtype(), "CUDA FP8 quantize",
                   [&](auto e) { launch_columnwise<decltype(e)>(p, as_cuda(stream)); });
    ST_CUDA_CHECK(cudaGetLastError(), "quantize_columnwise launch");
  }
  void quantize_both(const Fp8QuantizeBothParams& p, Stream stream) override {
    if (no_tiles(p.src, p.src_rows, p.groups)) return;
    cuda::DeviceGuard guard(p.src.device().index);
    dispatch_dtype(p.src.dtype(), "CUDA FP8 quantize", [&](auto e) { launch_both<decltype(e)>(p, as_cuda(stream)); });
    ST_CUDA_CHECK(cudaGetLastError(), "quantize_both launch");
  }
  void quantize_weights(const Fp8WeightQuantizeParams& p, Stream stream) override {
    if (p.w.empty() || p.w[0].numel() == 0) return;
    check_groups(int64_t(p.w.size()));
    cuda::DeviceGuard guard(p.w[0].device().index);
    dispatch_dtype(p.w[0].dtype(), "CUDA FP8 quantize",
                   [&](auto e) { launch_weights<decltype(e)>(p, as_cuda(stream)); });
    ST_CUDA_CHECK(cudaGetLastError(), "quantize_weights_kernel launch");
  }

  void dequantize_rowwise(const Fp8DequantizeParams& p, Stream stream) override {
    const int64_t T = p.dst.size(0), K = p.dst.size(1), G = p.groups.num_groups;
    if (K == 0 || fp8_columnwise_max_tiles(T, G) == 0) return;
    cuda::DeviceGuard guard(p.dst.device().index);
    const dim3 grid(unsigned(fp8_columnwise_max_tiles(T, G)), unsigned(fp8_tiles(K)));
    dispatch_dtype(p.dst.dtype(), "CUDA FP8 dequantize", [&](auto e) {
      using D = decltype(e);
      const uint8_t* q = p.src.data.data_as<const uint8_t>();
      D* dst = static_cast<D*>(p.dst.data());
      auto launch = [&](auto vec) {
        dequantize_rowwise_kernel<D, decltype(vec)::value><<<grid, 256, 0, as_cuda(stream)>>>(
            p.groups.offsets, G, q, p.src.scale.data_as<const float>(), K, dst, p.dst.stride(0), p.dst.stride(1));
      };
      if constexpr (sizeof(D) == 2) {
        if (K % 8 == 0 && p.dst.stride(1) == 1 && p.dst.stride(0) % 8 == 0 &&
            reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0)
          return launch(std::true_type{});
      }
      launch(std::false_type{});
    });
    ST_CUDA_CHECK(cudaGetLastError(), "dequantize_rowwise_kernel launch");
  }
  void dequantize_columnwise(const Fp8DequantizeParams& p, Stream stream) override {
    const int64_t T = p.dst.size(0), C = p.dst.size(1);
    if (T * C == 0) return;
    cuda::DeviceGuard guard(p.dst.device().index);
    dequantize_columnwise_kernel<<<blocks_for(T * C, 256), 256, 0, as_cuda(stream)>>>(
        p.groups.offsets, p.groups.num_groups, p.src.data.data_as<const uint8_t>(), p.src.scale.data_as<const float>(),
        T, C, p.src.data.size(1), p.dst.data_as<float>(), p.dst.stride(0), p.dst.stride(1));
    ST_CUDA_CHECK(cudaGetLastError(), "dequantize_columnwise_kernel launch");
  }
  void dequantize_blocks(const Fp8Tensor& src, const TensorView& dst, Stream stream) override {
    const int64_t R = dst.size(0), C = dst.size(1);
    if (R * C == 0) return;
    cuda::DeviceGuard guard(dst.device().index);
    dequantize_blocks_kernel<<<blocks_for(R * C, 256), 256, 0, as_cuda(stream)>>>(
        src.data.data_as<const uint8_t>(), src.scale.data_as<const float>(), R, C, dst.data_as<float>(),
        dst.stride(0), dst.stride(1));
    ST_CUDA_CHECK(cudaGetLastError(), "dequantize_blocks_kernel launch");
  }

  size_t gemm_scratch_bytes(DType, int64_t num_groups, int64_t, int64_t, int64_t) const override {
    return gemm_workspace(num_groups);
  }

  void fprop(const Fp8FpropParams& p, void* scratch, Stream stream) override {
    act_weight(p.problem, p.x, p.weight, p.y, p.problem.out, p.problem.in, p.zero_tail, scratch, stream);
  }
  void dgrad(const Fp8DgradParams& p, void* scratch, Stream stream) override {
    act_weight(p.problem, p.dy, p.weight_t, p.dx, p.problem.in, p.problem.out, p.zero_tail, scratch, stream);
  }
  void wgrad(const Fp8WgradParams& p, void* scratch, Stream stream) override {
    const GroupedProblem& pr = p.problem;
    check_bf16(pr.dtype);
    check_groups(pr.num_groups);
    cuda::DeviceGuard guard(p.x.data.device().index);
    Fp8GemmArgs a{};
    a.wgrad_store = p.target == WgradTarget::kWeightGrad           ? cuda::WgradStore::kWeightGrad
                    : p.target == WgradTarget::kMainGradAccumulate ? cuda::WgradStore::kMainGradAccumulate
                                                                   : cuda::WgradStore::kMainGradOverwrite;
    a.num_groups = pr.num_groups, a.m = pr.out, a.n = pr.in, a.k = 0;
    a.offsets = pr.offsets;
    a.a = p.dy.data.data(), a.sfa = p.dy.scale.data_as<const float>(), a.a_ld = p.dy.data.size(1);
    a.b = p.x.data.data(), a.sfb = p.x.scale.data_as<const float>(), a.b_ld = p.x.data.size(1);
    for (int64_t g = 0; g < pr.num_groups; ++g) a.dw[g] = p.dw[size_t(g)].data();
    const size_t bytes = gemm_workspace(pr.num_groups);
    if (p.target == WgradTarget::kWeightGrad) run_gemm<Fp8Variant::kWgrad>(a, scratch, bytes, as_cuda(stream));
    else run_gemm<Fp8Variant::kWgradF32>(a, scratch, bytes, as_cuda(stream));
  }

 private:
  // D [rows, n] = A [rows, k] . B_g^T per group, then the tail rows' zeros where asked.
  void act_weight(const GroupedProblem& pr, const Fp8Tensor& act, const std::vector<Fp8Tensor>& weight,
                  const TensorView& d, int64_t n, int64_t k, bool zero_tail, void* scratch, Stream stream) {
    check_bf16(pr.dtype);
    check_groups(pr.num_groups);
    cuda::DeviceGuard guard(d.device().index);
    Fp8GemmArgs a{};
    a.num_groups = pr.num_groups, a.n = n, a.k = k;
    a.offsets = pr.offsets;
    a.a = act.data.data(), a.sfa = act.scale.data_as<const float>(), a.a_ld = act.data.stride(0);
    a.d = d.data(), a.d_ld = d.stride(0);
    for (int64_t g = 0; g < pr.num_groups; ++g) {
      a.weight[g] = weight[size_t(g)].data.data();
      a.weight_scale[g] = weight[size_t(g)].scale.data_as<const float>();
    }
    run_gemm<Fp8Variant::kActWeight>(a, scratch, gemm_workspace(pr.num_groups), as_cuda(stream));
    if (zero_tail)
      cuda::launch_zero_tail<bf16_t>(pr.offsets, pr.num_groups, d.data(), d.size(0), n, as_cuda(stream));
  }
};

}  // namespace

Fp8BlockwiseBackend& fp8_blockwise_cuda_backend() {
  static CudaFp8Backend backend;
  return backend;
}

}  // namespace sparsetrain::backend
