// The scalar build of the matmul family: the reference. qmm_body.h over lanes_scalar.h (16 lanes in a plain array,
// std::fmaf for the fused multiply-add, exactly rounded on any CPU). It runs where neither vector build can, and the
// tests hold both vector builds to its bits (qmm.h documents the order all three share).
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "qmm.h"

namespace steady_qmm {
namespace scalar {
namespace {

#include "lanes_scalar.h"

constexpr int kSmallM = 1;
constexpr int fused_nr(int) { return 1; }
constexpr int kMR = 1;
constexpr int kNR = 1;
constexpr int64_t kMB = 96;  // rows per pass over a dequantized panel
constexpr int64_t kPrefetchTiles = 0;

#include "qmm_body.h"

}  // namespace scalar
}  // namespace steady_qmm
