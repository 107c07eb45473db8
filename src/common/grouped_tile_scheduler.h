// Tile scheduling for grouped GEMMs whose M dimension is the ragged row dimension (fprop and
// dgrad): a linear tile index -> (group, first row, last row) of an M tile that lies inside one
// group. Each group g of n_g rows owns ceil(n_g / tile_m) tiles, so no tile mixes two groups'
// weights. The grid is sized from shapes only: total tiles <= ceil(T / tile_m) + G for any
// splits, which keeps launches (and CUDA graphs) independent of split values.
// Plain host/device code, tested on the CPU (tests/cpp/test_grouped_tile_scheduler.cpp).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace sparsetrain {

struct RowTile {
  int64_t group;  // -1: no work for this tile index
  int64_t row_begin;
  int64_t row_end;
};

ST_HOST_DEVICE inline int64_t max_row_tiles(int64_t num_rows, int64_t num_groups, int64_t tile_m) {
  return (num_rows + tile_m - 1) / tile_m + num_groups;
}

// Walks the groups in order; O(G) per call, fine for G in the hundreds.
ST_HOST_DEVICE inline RowTile map_row_tile(const int64_t* offsets, int64_t num_groups, int64_t tile_m,
                                           int64_t tile) {
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t rows = offsets[g + 1] - offsets[g];
    const int64_t tiles = (rows + tile_m - 1) / tile_m;
    if (tile < tiles) {
      const int64_t begin = offsets[g] + tile * tile_m;
      const int64_t end = begin + tile_m < offsets[g + 1] ? begin + tile_m : offsets[g + 1];
      return {g, begin, end};
    }
    tile -= tiles;
  }
  return {-1, 0, 0};
}

}  // namespace sparsetrain
