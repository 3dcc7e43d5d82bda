// The decode kernel's item functions for float32 and float16 caches (decode_kernel.h): a unit
// of its own, so that the kernel's instantiations compile in parallel.
#include "decode_kernel.h"

namespace jax_attn_cpu {
namespace decode {

ItemFn item_fn_f32(int64_t head_size) { return pick_item_fn<float, false>(head_size); }

ItemFn item_fn_f16(int64_t head_size) { return pick_item_fn<f16_t, false>(head_size); }

}  // namespace decode
}  // namespace jax_attn_cpu
