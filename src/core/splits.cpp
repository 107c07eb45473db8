// Splits: host values are copied at construction; device values are only referenced.
#include "sparsetrain/splits.h"

#include "sparsetrain/error.h"

namespace sparsetrain {

Splits Splits::host(std::vector<int64_t> values) {
  Splits s;
  s.has_host_ = true;
  s.host_values_ = std::move(values);
  return s;
}

Splits Splits::host(const TensorView& values) {
  ST_CHECK_ARG(values.defined(), "splits", "a host tensor of shape [G]", "no tensor");
  ST_CHECK_ARG(values.device().is_cpu(), "splits",
               "host splits in host memory (use Splits::device for a device tensor)", values.str());
  ST_CHECK_ARG(values.dtype() == DType::kInt64 || values.dtype() == DType::kInt32, "splits",
               "dtype int64 or int32", dtype_name(values.dtype()));
  ST_CHECK_ARG(values.dim() == 1, "splits", "shape [G]", values.shape_str());
  ST_CHECK_ARG(values.data() != nullptr || values.numel() == 0, "splits", "non-null data", "a null pointer");
  std::vector<int64_t> v(static_cast<size_t>(values.size(0)));
  for (int64_t i = 0; i < values.size(0); ++i) {
    const int64_t at = i * values.stride(0);
    v[size_t(i)] = values.dtype() == DType::kInt64 ? values.data_as<const int64_t>()[at]
                                                   : values.data_as<const int32_t>()[at];
  }
  return host(std::move(v));
}

Splits Splits::device(const TensorView& values, const TensorView& status) {
  Splits s;
  s.on_device_ = true;
  s.device_values_ = values;
  s.status_ = status;
  return s;
}

}  // namespace sparsetrain
