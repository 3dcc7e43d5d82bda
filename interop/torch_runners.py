"""Cross-check runners for the torch backends: a `harness.Problem` through vLLM's API.

Each runner converts the workload's core-layout cache to the backend's layout
(`interop.layouts`), orders the sequences as vLLM wants them (prefills first, then decodes),
builds the metadata with the backend's builder, runs `impl.forward` (which writes the new
tokens' K/V first), and returns the output in the workload's token order.

torch (and the backends) are imported when a runner runs or its availability is asked, never
at import: `jax-attn info` lists these backends, and why not, on a machine without torch.
"""

import importlib.util
from collections.abc import Callable

import numpy as np

from interop.harness import Backend, Problem, Unsupported
from torch_backends.attention_type import AttentionType

_FP8 = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}


def _torch(x: np.ndarray):
    """NumPy (ml_dtypes included) -> torch, bit for bit."""
    import torch

    name = x.dtype.name
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        bits = {1: np.uint8, 2: np.int16}[x.dtype.itemsize]
        return torch.from_numpy(np.ascontiguousarray(x).view(bits).copy()).view(
            getattr(torch, name)
        )
    return torch.from_numpy(np.ascontiguousarray(x).copy())


def _order(problem: Problem) -> list[int]:
    """Sequence order for vLLM: prefills (incl. chunked) first, then decodes."""
    w = problem.workload
    decode = [q == 1 and c > 0 for q, c in zip(w.query_lens, w.context_lens, strict=True)]
    return [i for i, d in enumerate(decode) if not d] + [i for i, d in enumerate(decode) if d]


def _token_index(query_lens: list[int], order: list[int]) -> np.ndarray:
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    return np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order]).astype(np.int64)


def _runner(backend_name: str, layout: str):
    def run(problem: Problem) -> np.ndarray:
        from torch_backends import AttentionLayer, get_attn_backend

        spec, w = problem.spec, problem.workload
        backend = get_attn_backend(backend_name)
        kv_cache_dtype = _FP8.get(spec.cache_dtype or "", "auto")
        if backend_name == "IPEX" and kv_cache_dtype == "fp8":
            raise Unsupported("IPEX 2.8 has fp8_e5m2 caches only")
        impl = backend.get_impl_cls()(
            spec.num_heads,
            spec.head_size,
            spec.softmax_scale,
            spec.num_kv_heads,
            alibi_slopes=None if problem.alibi_slopes is None else problem.alibi_slopes.tolist(),
            sliding_window=spec.sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=spec.logits_soft_cap,
            attn_type=spec.attn_type,
        )
        layer = AttentionLayer(w.k_scale, w.v_scale)
        if spec.attn_type is AttentionType.DECODER:
            return _run_decoder(problem, backend, impl, layer, layout)
        return _run_cacheless(problem, backend, impl, layer, layout)

    return run


def _pack(key_cache, value_cache, layout: str):
    """Core-layout caches -> a backend's packed `kv_cache[2, NB, BS*Hkv*D]`; fp8 caches as
    uint8 bits, as vLLM stores them (each impl views them as its float8 dtype)."""
    import torch

    from interop import layouts

    if key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if layout == "vllm":
        return layouts.nhd_to_vllm(key_cache, value_cache)
    if layout == "ipex":
        return layouts.nhd_to_ipex(key_cache, value_cache)
    num_blocks = key_cache.shape[0]  # the core's own layout, packed
    return torch.stack([key_cache.reshape(num_blocks, -1), value_cache.reshape(num_blocks, -1)])


def _run_decoder(problem, backend, impl, layer, layout) -> np.ndarray:
    w = problem.workload
    order = _order(problem)
    tokens = _token_index(w.query_lens, order)
    kv_cache = _pack(_torch(w.key_cache), _torch(w.value_cache), layout)
    seq_lens = [w.seq_lens[i] for i in order]
    q_lens = [w.query_lens[i] for i in order]
    tables = [w.block_tables[i, : -(-w.seq_lens[i] // w.block_size)].tolist() for i in order]
    md = backend.get_builder_cls()(None).build(
        seq_lens, q_lens, -1, -1, block_tables=tables, block_size=w.block_size
    )
    spec = problem.spec
    out = impl.forward(
        layer,
        _torch(w.query[tokens]).reshape(len(tokens), -1),
        _torch(w.new_key[tokens]).reshape(len(tokens), -1),
        _torch(w.new_value[tokens]).reshape(len(tokens), -1),
        kv_cache,
        md,
    )
    result = np.empty(w.query.shape, np.float64)
    result[tokens] = out.float().numpy().reshape(len(tokens), spec.num_heads, spec.head_size)
    return result


def _run_cacheless(problem, backend, impl, layer, layout) -> np.ndarray:
    """Encoder, encoder-only (no cache) and cross attention (encoder K/V through the cache)."""
    import torch

    spec, w = problem.spec, problem.workload
    dtype = w.query.dtype
    keys = _torch(np.concatenate(w.keys).astype(dtype))
    values = _torch(np.concatenate(w.values).astype(dtype))
    builder = backend.get_builder_cls()(None)
    query = _torch(w.query).reshape(w.query.shape[0], -1)
    if spec.attn_type is AttentionType.ENCODER_DECODER:
        if spec.fp8:
            raise Unsupported("cross-attention workloads here use float caches")
        blocks = [-(-n // w.block_size) for n in w.seq_lens]
        starts = np.concatenate([[0], np.cumsum(blocks)])
        cross_tables = [list(range(starts[i], starts[i + 1])) for i in range(len(blocks))]
        shape = (int(starts[-1]), w.block_size, spec.num_kv_heads, spec.head_size)
        nan = torch.full(shape, float("nan")).to(keys.dtype)
        kv_cache = _pack(nan, nan.clone(), layout)
        md = builder.build(
            w.query_lens,
            w.query_lens,
            -1,
            -1,
            # The decoder's own tables cover its tokens (unused by cross attention, but the
            # builder checks them: one block for 9 tokens of block size 8 is refused).
            block_tables=[[0] * -(-q // w.block_size) for q in w.query_lens],
            block_size=w.block_size,
            encoder_seq_lens=w.seq_lens,
            cross_block_tables=cross_tables,
        )
    else:
        kv_cache = torch.empty(0)
        md = builder.build(
            [], [], -1, -1, block_tables=[], block_size=w.block_size, encoder_seq_lens=w.seq_lens
        )
    out = impl.forward(
        layer,
        query,
        keys.reshape(keys.shape[0], -1),
        values.reshape(values.shape[0], -1),
        kv_cache,
        md,
    )
    return out.float().numpy().reshape(w.query.shape).astype(np.float64)


def _available(load: Callable[[], object], needs: str) -> Callable[[], str | None]:
    def check() -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install 'jax-attn[torch]')"
        try:
            load()
        except ImportError as e:
            # The backends' own ImportErrors say what to install: keep their first line whole.
            message = str(e).splitlines()[0]
            return message if needs.split()[0] in message else f"{needs}: {message}"
        return None

    return check


def _load_torch_sdpa():
    from torch_backends import torch_sdpa

    return torch_sdpa


def _load_xformers():
    from torch_backends import xformers

    return xformers


def _load_ipex():
    from torch_backends import ipex_attn

    return ipex_attn


def _load_torch_op():
    from interop import torch_op
    from torch_backends.registry import ENTRY_POINT_GROUP, known_backends

    if "JAX" not in known_backends():
        # get_attn_backend("JAX") finds it through the installed package's metadata only.
        raise ImportError(
            f"the JAX backend is not registered (entry-point group {ENTRY_POINT_GROUP!r}): "
            "install this package, e.g. pip install -e ."
        )
    return torch_op


def _xformers_available() -> str | None:
    if importlib.util.find_spec("xformers") is None:
        return "xformers is not installed (pip install 'jax-attn[xformers]'; needs torch >= 2.10)"
    return _available(_load_xformers, "XFORMERS backend")()


TORCH_BACKENDS = [
    Backend(
        "TORCH_SDPA",
        _available(_load_torch_sdpa, "torch"),
        _runner("TORCH_SDPA", "vllm"),
        label="SDPA",
    ),
    Backend("XFORMERS", _xformers_available, _runner("XFORMERS", "vllm"), label="xformrs"),
    Backend("IPEX", _available(_load_ipex, "IPEX"), _runner("IPEX", "ipex"), label="IPEX"),
    Backend(
        "JAX-via-torch",
        _available(_load_torch_op, "torch + jax"),
        _runner("JAX", "nhd"),
        label="JAX/pt",
    ),
]
