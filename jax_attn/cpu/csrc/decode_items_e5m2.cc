// The decode kernel's item functions for fp8 e5m2 caches (decode_kernel.h): a unit of its own,
// so that the kernel's instantiations compile in parallel.
#include "decode_kernel.h"

namespace jax_attn_cpu {
namespace decode {

ItemFn item_fn_e5m2(DType query_type, int64_t head_size) {
  return pick_item_fn_dot<e5m2_t, kFp8DotBuilt>(query_type, head_size);
}

}  // namespace decode
}  // namespace jax_attn_cpu
