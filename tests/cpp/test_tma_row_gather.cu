// The assumption a row-gathering grouped GEMM rests on (issue 18: fc1 reading x's rows through the
// token -> row permutation, with no gathered copy of x): Hopper's TMA has no row gather, but a
// 128-byte-swizzled tile can be filled one row at a time. TMA applies the 128-byte swizzle by the
// shared-memory address it writes (16-byte chunk c of a 128-byte line L lands at chunk c ^ (L % 8)
// within a 1024-byte aligned tile), so a {64 x 1} box of bf16 written at line L's address should
// land exactly where one {64 x 128} box of the gathered matrix puts it. Checked on the GPU: a tile
// box from the gathered matrix (materialised on the host) and 128 row boxes from x through the
// index give the same shared-memory image, and both equal the swizzle formula (the oracle). The row
// box also covers the other layout a gathering GEMM needs, rows along K (MN-major A or B: a line is
// 64 consecutive elements of one row there too, only its line index differs).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "device_tensor.h"

namespace {

constexpr int kRows = 128, kCols = 64;                    // one A tile: 128 rows x 64 bf16 (K-major)
constexpr int kLineBytes = kCols * 2, kTileBytes = kRows * kLineBytes;  // 128-byte lines, 16 KiB

// A 2-d bf16 tensor map over [rows, cols] (row-major, row stride in elements), box {kCols, box_rows},
// 128-byte swizzle.
CUtensorMap tensor_map(const void* base, uint64_t rows, uint64_t cols, uint64_t stride, uint32_t box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {stride * 2};
  const cuuint32_t box[2] = {uint32_t(kCols), box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  EXPECT_EQ(r, CUDA_SUCCESS) << "cuTensorMapEncodeTiled";
  return map;
}

// One warp fills a tile at column k0: with index == nullptr one {kCols x kRows} box at row 0, else
// kRows {kCols x 1} boxes, row r from index[r] (4 a lane), each at line r's address. The image goes
// to out as it lies in shared memory.
__global__ void fill_tile(const __grid_constant__ CUtensorMap map, const int32_t* index, int k0, uint8_t* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ alignas(1024) uint8_t tile[kTileBytes];
  __shared__ alignas(8) uint64_t bar;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const int lane = threadIdx.x;
  if (lane == 0) {
    Barrier::init(&bar, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncwarp();
  if (lane == 0) Barrier::arrive_and_expect_tx(&bar, kTileBytes);  // before any copy may complete
  __syncwarp();
  constexpr uint64_t kHint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  if (index == nullptr) {
    if (lane == 0) cute::SM90_TMA_LOAD_2D::copy(&map, &bar, kHint, tile, k0, 0);
  } else {
    for (int r = lane; r < kRows; r += 32)
      cute::SM90_TMA_LOAD_2D::copy(&map, &bar, kHint, tile + r * kLineBytes, k0, index[r]);
  }
  Barrier::wait(&bar, 0);
  for (int i = lane; i < kTileBytes / 16; i += 32) reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<uint4*>(tile)[i];
#endif
}

std::vector<uint8_t> run(const CUtensorMap& map, const int32_t* index, int k0) {
  uint8_t* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, kTileBytes), cudaSuccess);
  EXPECT_EQ(cudaMemset(d, 0xFF, kTileBytes), cudaSuccess);  // poisoned
  fill_tile<<<1, 32>>>(map, index, k0, d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> h(kTileBytes);
  EXPECT_EQ(cudaMemcpy(h.data(), d, kTileBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d);
  return h;
}

TEST(TmaRowGather, RowBoxesLandWhereTheTileBoxPutsTheGatheredRows) {
  REQUIRE_HOPPER();
  // x: [N, H] bf16 bits, a row stride past H (a strided x), H spanning several k tiles.
  const int N = 1000, H = 3 * kCols, stride = H + 8;
  std::mt19937 rng(7);
  std::vector<uint16_t> x(size_t(N) * stride);
  for (auto& v : x) v = uint16_t(rng());
  std::vector<int32_t> index(kRows);
  for (auto& i : index) i = int32_t(rng() % N);
  index[5] = index[6];  // a token twice (top_k rows of one token never share an expert, but rows may repeat)
  index[0] = N - 1;
  std::vector<uint16_t> gathered(size_t(kRows) * H);  // the gathered matrix the tile box reads
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < H; ++c) gathered[size_t(r) * H + c] = x[size_t(index[r]) * stride + c];

  uint16_t *dx = nullptr, *dg = nullptr;
  int32_t* di = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, x.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dg, gathered.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&di, index.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dg, gathered.data(), gathered.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(di, index.data(), index.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const CUtensorMap tile_map = tensor_map(dg, kRows, H, H, kRows), row_map = tensor_map(dx, N, H, stride, 1);
  for (int k0 = 0; k0 < H; k0 += kCols) {
    SCOPED_TRACE("k0 " + std::to_string(k0));
    const std::vector<uint8_t> tile = run(tile_map, nullptr, k0), rows = run(row_map, di, k0);
    // The oracle: line r, 16-byte chunk c of the unswizzled tile at chunk c ^ (r % 8).
    std::vector<uint8_t> want(kTileBytes);
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kLineBytes / 16; ++c)
        for (int b = 0; b < 16; ++b) {
          const int col_byte = c * 16 + b;
          const uint16_t v = gathered[size_t(r) * H + k0 + col_byte / 2];
          want[size_t(r) * kLineBytes + size_t((c ^ (r % 8)) * 16 + b)] = uint8_t(col_byte % 2 ? v >> 8 : v & 0xFF);
        }
    EXPECT_EQ(tile, want) << "the tile box against the swizzle formula";
    EXPECT_EQ(rows, want) << "the row boxes against the swizzle formula";
  }
  cudaFree(dx);
  cudaFree(dg);
  cudaFree(di);
}

}  // namespace
