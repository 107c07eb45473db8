// The weight-grad disposition table of docs/DESIGN.md section 4, row by row.
#include <gtest/gtest.h>

#include "sparsetrain/weight_grad.h"

namespace st = sparsetrain;
using K = st::WeightGradKind;

TEST(WeightGradDisposition, TheSixRowsOfTheTable) {
  struct Row { bool delay, fuse, attr; K weight; bool bias_now; };
  const Row rows[] = {
      {false, false, false, K::kWgrad, true},  {true, false, false, K::kNone, false},
      {false, true, false, K::kNone, true},    {false, true, true, K::kDummy, true},
      {true, true, false, K::kNone, false},    {true, true, true, K::kDummy, false},
  };
  for (const Row& r : rows) {
    const st::WeightGradDisposition d = st::weight_grad_disposition(r.delay, r.fuse, r.attr);
    EXPECT_EQ(d.weight, r.weight) << "delay=" << r.delay << " fuse=" << r.fuse << " attr=" << r.attr;
    EXPECT_EQ(d.bias_grad_now, r.bias_now) << "delay=" << r.delay << " fuse=" << r.fuse;
  }
  // Without fusion the attribute does not matter.
  EXPECT_EQ(st::weight_grad_disposition(false, false, true).weight, K::kWgrad);
  EXPECT_EQ(st::weight_grad_disposition(true, false, true).weight, K::kNone);
}
