"""One process of the two-process sharded decode test (test_sharding_multiprocess.py).

    python tests/jax/sharded_multiprocess.py COORDINATOR_PORT PROCESS_ID SEED

Each process owns 4 simulated CPU devices; `jax.distributed` (CPU collectives over gloo) joins
them into one 8-device mesh, tp=8 over kv heads. Both build the same global arrays from the
seed (each materializes only its own shards), run one sharded decode step, and gather the
output to the host; process 0 then recomputes it on one device and prints the max error and
its ratio to the one tolerance rule's bound (against a peer: `bound_ratio(..., peer=True)`).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import json
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(port: int, process_id: int, seed: int) -> int:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=40,
    )
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    from tolerances import bound_ratio

    import jax_attn
    from jax_attn.sharding import PagedSharding

    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    num_seqs, hq, hkv, d, bs, nb, max_blocks = 4, 16, 8, 16, 8, 32, 6
    rng = np.random.default_rng(seed)  # the same draws in both processes
    seq_lens = rng.integers(1, bs * max_blocks + 1, num_seqs).astype(np.int32)
    tables = rng.permutation(nb)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    kc = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    vc = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    owned = np.zeros((nb, bs), bool)
    for s in range(num_seqs):
        for p in range(seq_lens[s]):
            owned[tables[s, p // bs], p % bs] = True
    kc[~owned], vc[~owned] = np.nan, np.nan  # NaN in every slot no sequence owns
    q = rng.standard_normal((num_seqs, hq, d)).astype(np.float32)

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    layout = PagedSharding(mesh, hq, hkv)

    def put(x, spec):
        sharding = layout.sharding(spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    t0 = time.perf_counter()
    out = layout.paged_decode(
        put(q, layout.heads_spec),
        put(kc, layout.cache_spec),
        put(vc, layout.cache_spec),
        put(tables.astype(np.int32), layout.batch_spec),
        put(seq_lens, layout.batch_spec),
        impl="xla",
    )
    out.block_until_ready()
    step_s = time.perf_counter() - t0
    got = np.asarray(multihost_utils.process_allgather(out, tiled=True))
    report = dict(process=process_id, step_s=round(step_s, 3), shape=list(got.shape))
    if process_id == 0:
        local = jax.devices()[0]
        want = jax_attn.paged_decode(
            *(jax.device_put(jnp.asarray(x), local) for x in (q, kc, vc, tables, seq_lens)),
            impl="xla",
        )
        report["err"] = float(np.max(np.abs(got - np.asarray(want))))
        report["bound_ratio"] = bound_ratio(got, want, "float32", peer=True)
        report["finite"] = bool(np.isfinite(got).all())
    print(json.dumps(report), flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:4])))
