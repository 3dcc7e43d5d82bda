"""One tensor, two frameworks: `to_jax` / `to_torch` over DLPack, never silently wrong.

When memory is shared and when it is copied (measured with jax 0.10.2 and torch 2.13, CPU;
`copy_reason(tensor)` says which case a tensor falls in):

| torch tensor                                        | `to_jax`                               |
|-----------------------------------------------------|----------------------------------------|
| compact row-major, data 64-byte aligned: bf16, f16, | zero-copy                              |
| f32, i8/i16/i32, u8, bool, float8_e4m3fn/e5m2       |                                        |
| float8 where torch's DLPack has no float8 (torch    | uint8 bits shared, then one copy: a    |
| 2.8, the IPEX environment; see `FLOAT8_ZERO_COPY`)  | bit cast in JAX (same in `to_torch`)   |
| any permutation of a compact tensor (`x.t()`,       | zero-copy: XLA keeps the permuted      |
| `x.permute(2, 0, 1)`, size-1 dims with any stride)  | layout (`array.format` shows it)       |
| non-compact view (column slice, `x[::2]`, expand)   | explicit copy: XLA imports only        |
|                                                     | permutations of compact strides        |
| data not 64-byte aligned (`x[1:]` of a flat tensor) | explicit copy: XLA's CPU client would  |
|                                                     | copy anyway, silently                  |
| requires grad                                       | detached (same memory): the autograd   |
|                                                     | graph does not cross frameworks        |
| conjugate / negative bit set                        | explicit copy resolving the bit        |
| int64 / uint64, x64 off                             | range-checked, then cast to int32 /    |
|                                                     | uint32 (copy); out of range raises     |
|                                                     | `OverflowError` (DLPack would wrap)    |
| float64 / complex128, x64 off                       | cast to float32 / complex64 (copy), as |
|                                                     | `jnp.asarray` does                     |
| 64-bit types, x64 on                                | zero-copy, exact                       |
| 0-size                                              | same rules (nothing to share)          |

`to_torch` shares memory with every single-device JAX array (JAX allocates 64-byte aligned,
compact buffers; float8 only where `FLOAT8_ZERO_COPY`); `copy=True` gives an independent
tensor instead.

Aliasing: a zero-copy result is a second name for the same memory. JAX assumes its arrays are
immutable, so writing the torch tensor in place (either direction) changes the JAX array under
JAX's feet; pass `copy=True` where the torch side will be written.

CUDA: JAX's DLPack import asks torch for the tensor on JAX's stream and torch orders that after
its current stream; `to_jax` also synchronizes torch's current stream first, so the array never
sees a half-written tensor even where the handshake is skipped. `to_torch` waits for the JAX
computation that produces the array (`block_until_ready`) before exporting it.
"""

import jax
import numpy as np
import torch
from jaxtyping import Array, Shaped
from torch import Tensor

# XLA's CPU client imports external memory only at this alignment (`cpu::MinAlign()`); below
# it, it copies without saying so. The same rule is applied on every device, which is
# conservative on GPUs (torch's CUDA allocator hands out 512-byte aligned blocks).
_ALIGN_BYTES = 64

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _dlpack_carries_float8() -> bool:
    """Whether this torch exports float8 through DLPack (torch 2.8 raises "float8 types are not
    supported by dlpack"; 2.13 does it)."""
    try:
        torch.empty(1, dtype=torch.float8_e5m2).__dlpack__()
    except (RuntimeError, BufferError, TypeError):
        return False
    return True


# True where float8 tensors cross zero-copy; elsewhere they cross as uint8 bits (zero-copy)
# plus a bit cast on the JAX side, which is one copy in JAX.
FLOAT8_ZERO_COPY: bool = _dlpack_carries_float8()

# 64-bit dtypes JAX narrows when x64 is off: (narrow dtype, range-check needed).
_NARROW_WITHOUT_X64: dict[torch.dtype, tuple[torch.dtype, bool]] = {
    torch.int64: (torch.int32, True),
    torch.uint64: (torch.uint32, True),
    torch.float64: (torch.float32, False),
    torch.complex128: (torch.complex64, False),
}


def to_jax(tensor: Shaped[Tensor, "*shape"], *, copy: bool = False) -> Shaped[Array, "*shape"]:
    """`tensor` as a JAX array on the same device, sharing its memory where the layout allows.

    Copies (always explicitly, see `copy_reason` and the module table): when `copy=True`; for
    views XLA cannot import (non-compact strides), data not 64-byte aligned, a conjugate or
    negative bit; and for 64-bit dtypes while x64 is off, which are cast to their 32-bit twins
    (int64 / uint64 only after checking every value fits, else `OverflowError`).
    A tensor that requires grad is detached (no copy): gradients do not flow back to torch.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor.layout={tensor.layout} must be torch.strided (dense)")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor.device={tensor.device} must be a cpu or cuda device")
    tensor = tensor.detach()  # a no-op view without grad; DLPack refuses tensors with grad
    if not jax.config.jax_enable_x64 and tensor.dtype in _NARROW_WITHOUT_X64:
        tensor = _narrow(tensor)
    if copy or copy_reason(tensor) is not None:
        # torch's allocator returns compact, 64-byte aligned memory.
        tensor = tensor.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    if tensor.dtype in _FLOAT8 and not FLOAT8_ZERO_COPY:
        bits = jax.dlpack.from_dlpack(tensor.view(torch.uint8))
        return jax.lax.bitcast_convert_type(bits, _jax_dtype(tensor.dtype))
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array: Shaped[Array, "*shape"], *, copy: bool = False) -> Shaped[Tensor, "*shape"]:
    """`array` as a torch tensor on the same device, sharing its memory unless `copy=True`.

    The shared tensor is writable to torch but JAX arrays are immutable: take `copy=True` (one
    device copy) before writing it in place. Waits for the computation producing `array`.
    float8 arrays are bit cast to uint8 first (a copy) where torch's DLPack has no float8.
    """
    if isinstance(array, jax.core.Tracer):
        raise TypeError(
            "array must be a concrete jax.Array, got a tracer: to_torch cannot run under "
            "jax.jit / vmap / grad"
        )
    if not isinstance(array, jax.Array):
        raise TypeError(f"array must be a jax.Array, got {type(array).__name__}")
    if array.is_deleted():
        raise ValueError("array was deleted (donated to a jitted call?); nothing to export")
    devices = array.sharding.device_set
    if len(devices) != 1:
        raise ValueError(
            f"array must live on one device, got {len(devices)} ({array.sharding}); "
            "jax.device_put it onto one device first"
        )
    array.block_until_ready()
    dtype = _torch_dtype(array.dtype)
    if dtype in _FLOAT8 and not FLOAT8_ZERO_COPY:
        bits = jax.lax.bitcast_convert_type(array, np.uint8).block_until_ready()
        return torch.from_dlpack(bits).view(dtype)  # the bit cast made a fresh buffer already
    tensor = torch.from_dlpack(array)
    return tensor.clone() if copy else tensor


def index_to_jax(tensor: Shaped[Tensor, "*shape"], name: str) -> Shaped[Array, "*shape"]:
    """An index tensor (ids, lengths, offsets; any integer dtype) as a JAX int32 array, the
    index dtype of `jax_attn`'s metadata, whatever x64 says.

    A value outside int32 raises `OverflowError` naming `name`: a plain cast would wrap it
    (2**32 + 3 becomes 3, a valid-looking block id). int32 tensors cross as `to_jax` does.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if tensor.dtype != torch.int32:
        if tensor.numel():
            if tensor.dtype == torch.uint64:  # no min/max kernels: int64 bits, >= 2**63 < 0
                wide = tensor.view(torch.int64)
                lo, hi = int(wide.min()), int(wide.max())
                if lo < 0:
                    lo = hi = lo + 2**64
            else:
                wide = tensor.to(torch.int64)
                lo, hi = int(wide.min()), int(wide.max())
            info = torch.iinfo(torch.int32)
            if lo < info.min or hi > info.max:
                bad = hi if hi > info.max else lo
                wrapped = (bad - info.min) % 2**32 + info.min
                raise OverflowError(
                    f"{name} holds {bad}, outside int32 [{info.min}, {info.max}] (the index "
                    f"dtype of jax_attn's metadata); a cast would wrap it to {wrapped}"
                )
        tensor = tensor.to(torch.int32)
    return to_jax(tensor)


def copy_reason(tensor: Tensor) -> str | None:
    """Why DLPack cannot share `tensor`'s memory with JAX as it stands, or None if it can.

    Only the memory layout counts here: dtype narrowing without x64 is `to_jax`'s business.
    """
    if tensor.is_conj() or tensor.is_neg():
        return "conjugate/negative bit set (DLPack cannot express it)"
    if not _is_permuted_compact(tensor):
        return f"non-compact strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
    if tensor.data_ptr() % _ALIGN_BYTES:
        return f"data pointer {tensor.data_ptr():#x} is not {_ALIGN_BYTES}-byte aligned"
    return None


def shares_memory(tensor: Tensor, array: Array) -> bool:
    """Whether `tensor` and `array` start at the same address (the zero-copy proof)."""
    return tensor.data_ptr() == array.unsafe_buffer_pointer()


def _is_permuted_compact(tensor: Tensor) -> bool:
    """Strides are a permutation of a row-major compact layout (what XLA imports).

    Size-1 dims may have any stride. E.g. shape (4, 5, 6) permuted (2, 0, 1) has strides
    (1, 30, 6): sorted by stride they are 1, 6, 30 = 1, 1*6, 6*5, so it is compact.
    """
    expected = 1
    dims = zip(tensor.shape, tensor.stride(), strict=True)
    for stride, size in sorted((stride, size) for size, stride in dims if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _jax_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(getattr(jax.numpy, str(dtype).removeprefix("torch.")))


def _torch_dtype(dtype) -> torch.dtype | None:
    return getattr(torch, np.dtype(dtype).name, None)


def _narrow(tensor: Tensor) -> Tensor:
    """A 64-bit `tensor` as its 32-bit twin, as JAX holds it without x64 (a copy).

    DLPack would hand JAX the 64-bit buffer and JAX would reinterpret it as 32-bit values,
    wrapping large integers silently; integers are range-checked here first.
    """
    narrow, check = _NARROW_WITHOUT_X64[tensor.dtype]
    if check and tensor.numel():
        info = torch.iinfo(narrow)
        # torch has no min/max kernels for uint64; int64 bits read values >= 2**63 as negative.
        wide = tensor.view(torch.int64)
        lo, hi = int(wide.min()), int(wide.max())
        if tensor.dtype == torch.uint64 and lo < 0:
            lo = hi = lo + 2**64  # a value past int64's range is certainly past uint32's
        if lo < info.min or hi > info.max:
            bad = hi if hi > info.max else lo
            raise OverflowError(
                f"tensor ({str(tensor.dtype).removeprefix('torch.')}) holds {bad}, outside "
                f"{str(narrow).removeprefix('torch.')} [{info.min}, {info.max}], JAX's integer "
                "type without x64; enable x64 (`with jax.enable_x64(True):`) to keep 64 bits"
            )
        if tensor.dtype == torch.uint64:
            return wide.to(torch.int64).to(narrow)
    return tensor.to(narrow)


__all__ = [
    "FLOAT8_ZERO_COPY",
    "copy_reason",
    "index_to_jax",
    "shares_memory",
    "to_jax",
    "to_torch",
]
