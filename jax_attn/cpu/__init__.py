"""Native CPU kernels through XLA's FFI (issue 10): paged decode and ragged paged attention.

Importing this package never builds or raises. The kernels (csrc/*.cc) are compiled on first
use with the system C++ compiler and cached (see `_build`); `unavailable_reason()` says why
they cannot be used, `available()` whether they can, and `shape_problem(...)` why given dtypes
or sizes are refused.

Environment: `JAX_ATTN_CPU_THREADS` sets the worker count (default: XLA's intra-op pool size),
`JAX_ATTN_CPU_DISABLE=1` turns the kernels off (to exercise the XLA fallback),
`JAX_ATTN_CACHE_DIR` moves the build cache (default ~/.cache/jax-attn),
`JAX_ATTN_CPU_EXTRA_FLAGS` adds compiler flags (e.g. `-march=x86-64-v3` for the AVX2
kernels, `-fsanitize=address,undefined`), `JAX_ATTN_CPU_PREFETCH=0` turns the decode kernel's
prefetches off (on vLLM's split layout, N sets their distance in kv-head tiles for keys,
values twice as far; jax_attn's own cache prefetches the next tile),
`JAX_ATTN_CPU_NTA_LIMIT=N` prefetches decode's next tiles of up to N bytes (keys and values;
on vLLM's split layout, the head blocks requested ahead and the one being read) NTA and larger
ones into L2 (default: 1.5x the L1d on AMD CPUs whose L1d holds 48 KiB or more, else 0),
`JAX_ATTN_CPU_BF16_DOT=0` makes decode widen bf16 and fp8 keys (under bf16 queries) to
float32 instead of dotting them with vdpbf16ps and `JAX_ATTN_CPU_DECODE_QUADS=0` keeps
decode's groups of 4 query rows or more on the tile path instead of the quads,
`JAX_ATTN_CPU_SPLIT_LANES=1` reads vLLM's split layout at blocks of 128 or more with the
per-dimension lanes of `csrc/decode_split.h` (faster from cache, slower from memory), and
`JAX_ATTN_CPU_DECODE_AMX=1` / `0` puts decode on the AMX tiles at every GQA group size / none
(all read per call: for A/B timing and the AMX decode's tests),
`JAX_ATTN_CPU_AMX=0` keeps the bf16 products of the ragged kernel and of decode off the AMX
tiles (read once per process; `decode_path(...)` says what decode runs). `isa()` names what
the kernels run here: the bf16 products' instruction set (AMX tiles where the CPU has them and
Linux grants the tile state), the vector code built (avx512, avx2, portable) and the prefetch
level.
`python -m jax_attn.cpu.build` builds eagerly. `fma_peak.measure()` times the vector FMA peak
on the kernels' workers (what `jax-attn bench` reports compute against), `amx_peak.measure()`
the AMX tiles' bf16 peak beside it (where they run: `amx_peak.unavailable_reason()`),
`read_floor.Reader` reads arrays once with vector loads on them (the bench's read floor).
"""

from jax_attn.cpu import amx_peak, fma_peak, read_floor
from jax_attn.cpu._build import isa, unavailable_reason
from jax_attn.cpu._shapes import shape_problem
from jax_attn.cpu.paged_decode import decode_path, paged_decode
from jax_attn.cpu.ragged_paged_attention import ragged_paged_attention


def available() -> bool:
    """Whether the native kernels are built and registered (building them on first call)."""
    return unavailable_reason() is None


__all__ = [
    "amx_peak",
    "available",
    "decode_path",
    "fma_peak",
    "isa",
    "paged_decode",
    "ragged_paged_attention",
    "read_floor",
    "shape_problem",
    "unavailable_reason",
]
