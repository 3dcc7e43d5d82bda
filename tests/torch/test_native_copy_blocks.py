"""`copy_blocks` under every aliasing of its arguments (issue 37): the native op
(`torch.ops.jax_attn.copy_blocks`) and `PagedAttention.copy_blocks` / `swap_blocks` on both
paths, against a plain torch reference.

The documented semantics: `dst[i][:, pairs[:, 1]] = src[i][:, pairs[:, 0]]` for every i, as if
every source of every cache were read before any block is written; a destination id twice,
or destination caches that overlap (other than the same cache listed again), are refused
before anything is read or written.

Each case builds its caches as views of one flat buffer (`views(buffer) -> (dst, src)`), so
the same views over a copy of the buffer give the reference its own aliasing.
"""

import contextlib

import pytest
import torch

from torch_backends import native
from torch_backends.paged_attn import PagedAttention

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"native torch ops not available: {native.unavailable_reason()}",
)

NB, BLOCK = 6, 24  # blocks per half, elements per block: caches [2, NB, BLOCK] of float32
C = 2 * NB  # a cache's length in blocks


def cache_at(buffer: torch.Tensor, at: float, *, block: int = BLOCK, blocks: int = NB):
    """The contiguous cache `[2, blocks, block]` starting `at` blocks into `buffer` (a fraction
    of a block gives views whose blocks straddle each other's)."""
    start = int(at * block)
    return buffer[start : start + 2 * blocks * block].view(2, blocks, block)


def reference_copy(dst: list, src: list, pairs: torch.Tensor) -> None:
    """Every source read (copied out) first, then every destination written."""
    blocks = [s[:, pairs[:, 0]].clone() for s in src]  # [2, N, block] each
    for d, b in zip(dst, blocks, strict=True):
        d[:, pairs[:, 1]] = b


def caches(*starts, blocks=NB):
    """views(buffer, block) -> the caches starting at `starts` blocks (see `cache_at`)."""
    return lambda b, k: [cache_at(b, at, block=k, blocks=blocks) for at in starts]


# id -> (buffer length in blocks, dst views, src views, pairs)
ALIASING = {
    "dst-is-src-chain": (C, caches(0), caches(0), [[0, 1], [1, 2], [5, 0]]),
    "dst-is-src-cycle": (C, caches(0), caches(0), [[0, 1], [1, 2], [2, 0]]),
    "dst-is-src-swap": (C, caches(0), caches(0), [[0, 5], [5, 0]]),
    # src starts one block after dst: src block k is dst block k + 1 (and the halves meet)
    "views-one-block-apart": (C + 1, caches(0), caches(1), [[4, 5], [3, 2], [1, 1], [0, 0]]),
    # half a block apart: every read straddles two blocks that are written
    "views-half-a-block-apart": (C + 0.5, caches(0.5), caches(0),
                                 [[0, 0], [1, 1], [2, 3], [5, 4]]),
    # the value half of src is the key half of dst
    "views-a-half-apart": (C + NB, caches(NB), caches(0), [[0, 1], [2, 0], [4, 4]]),
    # copy 0 writes a block that copy 1 reads, and the other way round
    "dst-read-by-a-later-copy": (3 * C, caches(0, C), caches(2 * C, 0), [[0, 1], [1, 2]]),
    "dst-read-by-an-earlier-copy": (3 * C, caches(C, 0), caches(2 * C, C), [[0, 1], [1, 2]]),
    "caches-read-each-other": (2 * C, caches(0, C), caches(C, 0), [[0, 1], [1, 0], [3, 3]]),
    # one cache listed twice as its own source: copied once (a chain shows a second copy)
    "same-cache-listed-twice": (C, caches(0, 0), caches(0, 0), [[0, 1], [1, 2]]),
    # destinations apart, sources overlapping each other and the destinations
    "sources-overlap-each-other": (2 * C, caches(0, C), caches(1, 1 / 3),
                                   [[0, 0], [2, 1], [5, 3]]),
    # a smaller cache inside a larger one
    "small-source-inside-the-destination": (C, caches(0), caches(5, blocks=2), [[0, 5], [1, 4]]),
}  # fmt: skip


def run_case(case, rng, block: int = BLOCK):
    length, dst, src, pairs = ALIASING[case]
    pairs = torch.tensor(pairs, dtype=torch.int64)
    buffer = torch.from_numpy(rng.standard_normal(int(length * block)).astype("float32"))
    expected = buffer.clone()
    reference_copy(dst(expected, block), src(expected, block), pairs)
    torch.ops.jax_attn.copy_blocks(dst(buffer, block), src(buffer, block), pairs)
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("case", list(ALIASING))
def test_native_copy_blocks_reads_every_source_first(case, rng):
    run_case(case, rng)


@pytest.mark.parametrize("case", ["dst-is-src-cycle", "views-half-a-block-apart",
                                  "dst-read-by-an-earlier-copy"])  # fmt: skip
def test_native_copy_blocks_stages_on_many_threads(case, rng):
    """Blocks of 192 KiB: past the op's 1 MiB threshold (>= 1.1 MiB moved in each case) the
    moves and the staging run on torch's threads."""
    run_case(case, rng, block=BLOCK * 2048)


REFUSED = {
    "destination-twice": (C, caches(0), caches(0), [[0, 2], [1, 3], [4, 2]],
                          r"block_pairs\[:, 1\] has block 2 more than once \(block_pairs\[0\] "
                          r"and \[2\]\): destinations must be distinct"),
    "destinations-overlap": (C + 1, caches(0, 1), caches(0, 0), [[0, 1]],
                             r"dst\[0\] and dst\[1\] share memory: destination caches must "
                             r"not overlap"),
    # the same destination with two different sources is not a repeat of one copy
    "same-destination-two-sources": (2 * C, caches(0, 0), caches(0, C), [[0, 1]],
                                     r"dst\[0\] and dst\[1\] share memory"),
    "source-out-of-range": (C, caches(0), caches(0, blocks=3), [[1, 2], [3, 0]],
                            r"block_pairs\[1\]=\(3, 0\) must be a source block in \[0, 3\) "
                            r"of src\[0\]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_native_copy_blocks_refuses_before_touching_anything(case, rng):
    length, dst, src, pairs, message = REFUSED[case]
    buffer = torch.from_numpy(rng.standard_normal(length * BLOCK).astype("float32"))
    before = buffer.clone()
    with pytest.raises(ValueError, match=message):
        torch.ops.jax_attn.copy_blocks(dst(buffer, BLOCK), src(buffer, BLOCK), torch.tensor(pairs))
    assert torch.equal(buffer, before)


@contextlib.contextmanager
def _path(use_torch: bool):
    """`native.available()` False inside (the vectorized-torch path) when `use_torch`."""
    if not use_torch:
        yield
        return
    saved = dict(native._state)
    native._state.update(reason="forced for this test", warned=True)
    try:
        yield
    finally:
        native._state.clear()
        native._state.update(saved)


@pytest.mark.parametrize("use_torch", [False, True], ids=["native", "torch"])
def test_paged_attention_copy_blocks_aliasing(use_torch, rng):
    """One layer's cache listed twice copies once; layers that are views of one buffer, apart,
    read their sources first; both paths agree with the reference."""
    buffer = torch.from_numpy(rng.standard_normal(2 * C * BLOCK).astype("float32"))
    chain = torch.tensor([[0, 1], [1, 2], [2, 0]])
    layers = [cache_at(buffer, 0), cache_at(buffer, C), cache_at(buffer, 0)]
    expected = buffer.clone()
    ref_layers = [cache_at(expected, 0), cache_at(expected, C)]
    reference_copy(ref_layers, ref_layers, chain)
    with _path(use_torch):
        PagedAttention.copy_blocks(layers, chain)
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("use_torch", [False, True], ids=["native", "torch"])
def test_paged_attention_swap_blocks_within_one_cache(use_torch, rng):
    kv = torch.from_numpy(rng.standard_normal((2, NB, BLOCK)).astype("float32"))
    pairs = torch.tensor([[0, 3], [3, 0], [1, 5]])
    expected = kv.clone()
    reference_copy([expected], [expected.clone()], pairs)
    with _path(use_torch):
        PagedAttention.swap_blocks(kv, kv, pairs)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("use_torch", [False, True], ids=["native", "torch"])
def test_paged_attention_refuses_repeats_and_overlaps_on_both_paths(use_torch, rng):
    buffer = torch.from_numpy(rng.standard_normal((C + 1) * BLOCK).astype("float32"))
    before = buffer.clone()
    layers = [cache_at(buffer, 0), cache_at(buffer, 1)]
    with _path(use_torch):
        with pytest.raises(
            ValueError,
            match=r"src_to_dists\[:, 1\] has block 1 more than once "
            r"\(src_to_dists\[0\] and \[1\]\)",
        ):
            PagedAttention.copy_blocks(layers[:1], torch.tensor([[0, 1], [2, 1]]))
        with pytest.raises(ValueError, match=r"src_to_dst\[:, 1\] has block 4 more than once"):
            PagedAttention.swap_blocks(layers[0], layers[0], torch.tensor([[0, 4], [1, 4]]))
        with pytest.raises(ValueError, match=r"kv_caches\[0\] and kv_caches\[1\] share memory"):
            PagedAttention.copy_blocks(layers, torch.tensor([[0, 1]]))
    assert torch.equal(buffer, before)
