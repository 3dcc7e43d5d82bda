// The decode kernel's item functions for bfloat16 caches (decode_kernel.h): a unit of its own,
// so that the kernel's instantiations compile in parallel.
#include "decode_kernel.h"

namespace jax_attn_cpu {
namespace decode {

ItemFn item_fn_bf16(DType query_type, int64_t head_size) {
  return pick_item_fn_dot<bf16_t, kBf16DotBuilt>(query_type, head_size);
}

}  // namespace decode
}  // namespace jax_attn_cpu
