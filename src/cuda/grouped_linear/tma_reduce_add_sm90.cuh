// A TMA reduce-add store (gmem += smem tile, cp.reduce.async.bulk.tensor .add) that CUTLASS's
// ptr-array epilogue can use in place of its TMA store: that epilogue retargets the store at each
// group through `with(descriptor)`, which CuTe's SM90_TMA_REDUCE_ADD traits lack (SM90_TMA_STORE's
// have it). These traits are SM90_TMA_REDUCE_ADD's with that member: the same instruction, the
// descriptor held by value as made on the host, or (after `with`) by pointer, as the store's.
//
// The L2's fp32 add rounds to nearest even. The PTX ISA (cp.reduce.async.bulk) says .add.f32
// flushes subnormal inputs and results to zero; on an H200 it kept them, giving the register
// epilogue's bits (tests/cpp/test_grouped_linear_cuda.cpp pins that on the GPU it runs on).
#pragma once

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"

namespace sparsetrain::cuda::sm90 {

struct TmaReduceAdd : cute::SM90_TMA_REDUCE_ADD {};     // the host-made descriptor
struct TmaReduceAddPtr : cute::SM90_TMA_REDUCE_ADD {};  // a descriptor in memory (per group)

// The instruction, for a shared-memory tile and the TMA coordinates of its destination.
template <class TS, class SLayout, class TD, class DLayout>
CUTE_HOST_DEVICE void tma_reduce_add(cute::TmaDescriptor const* desc, cute::Tensor<TS, SLayout> const& src,
                                     cute::Tensor<TD, DLayout>& dst) {
  static_assert(cute::is_smem<TS>::value, "a TMA reduce-add reads shared memory");
  auto dst_coord = dst.data().coord_;
  cute::detail::explode_tuple(cute::detail::CallCOPY<cute::SM90_TMA_REDUCE_ADD>{},
                              cute::make_tuple(static_cast<void const*>(desc),
                                               static_cast<void const*>(cute::raw_pointer_cast(src.data()))),
                              cute::seq<0, 1>{}, dst_coord, cute::tuple_seq<decltype(dst_coord)>{});
}

}  // namespace sparsetrain::cuda::sm90

namespace cute {

template <class NumBitsPerTMA>
struct Copy_Traits<sparsetrain::cuda::sm90::TmaReduceAddPtr, NumBitsPerTMA> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;  // (src-thr, src-val) -> bit
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;  // (dst-thr, dst-val) -> bit
  using RefLayout = SrcLayout;

  TmaDescriptor const* tma_desc_;

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    sparsetrain::cuda::sm90::tma_reduce_add(traits.tma_desc_, src, dst);
  }
};

template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<sparsetrain::cuda::sm90::TmaReduceAdd, NumBitsPerTMA, AuxParams_> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor tma_desc_;
  using AuxParams = AuxParams_;
  AuxParams aux_params_;

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }

  template <class GShape>
  CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
    static_assert(is_congruent<decltype(g_shape), decltype(aux_params_.g_stride_)>::value);
    return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
  }

  // The same reduce-add through another descriptor (a group's, in global memory).
  CUTE_HOST_DEVICE constexpr Copy_Traits<sparsetrain::cuda::sm90::TmaReduceAddPtr, NumBitsPerTMA> with(
      TmaDescriptor const* new_tma_desc) const {
    return {new_tma_desc};
  }

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    sparsetrain::cuda::sm90::tma_reduce_add(&traits.tma_desc_, src, dst);
  }
};

}  // namespace cute
