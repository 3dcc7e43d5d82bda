"""The tensor shapes in the torch backends' signatures (jaxtyping), each named once.

T   num_tokens     query tokens of a step, prefill tokens first, then one per decode
Tk  num_kv_tokens  tokens whose K/V are given (T for self-attention, encoder tokens for
                   cross and encoder attention)
Hq, Hkv, D         num_heads, num_kv_heads, head_size
"""

from jaxtyping import Float, Int
from torch import Tensor

Queries = Float[Tensor, "num_tokens num_heads head_size"]  # [T, Hq, D], also outputs
KeysValues = Float[Tensor, "num_kv_tokens num_kv_heads head_size"]  # [Tk, Hkv, D]
FlatQueries = Float[Tensor, "num_tokens num_heads_x_head_size"]  # [T, Hq * D] (layer view)
FlatKeysValues = Float[Tensor, "num_kv_tokens num_kv_heads_x_head_size"]  # [Tk, Hkv * D]
SlotMapping = Int[Tensor, " num_kv_tokens"]  # cache slot of each new K/V row; < 0: none
BlockTables = Int[Tensor, "num_seqs max_blocks"]
