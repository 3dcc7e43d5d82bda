"""`python -m benchmarks.gpu_decode --smoke` in-process: the record has its fields, every peer
that ran computed the same attention as the xla path, and a missing peer is listed with its
reason instead of crashing the run. Speed is never asserted (without a GPU the Pallas kernels
run in interpret mode)."""

import argparse
import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("rich")

from benchmarks import gpu_decode

ROW_FIELDS = {
    "median_s", "iqr_s", "reps", "inner", "times_s", "bytes", "flops", "gb_s", "tflop_s",
    "fraction_of_copy", "ratio_vs_pallas", "max_abs_err_vs_xla", "agrees",
}  # fmt: skip


# One worker runs the module: its `record` (a quick run, ~15 s) then runs once.
pytestmark = pytest.mark.xdist_group("gpu-decode-smoke")


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_bench") / "gpu.json"
    assert gpu_decode.main(["--smoke", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_record_has_device_copy_and_every_workload(record):
    assert record["smoke"] is True
    assert {"jax_backend", "jax_device"} <= set(record["device"])
    copy = record["copy"]
    assert copy["gb_s"] > 0 and copy["bytes"] > 0 and copy["method"] in copy
    assert set(record["workloads"]) == {"decode-bs16", "decode-bs128", "prefill-16x1024"}
    assert record["targets"] == []  # judged on full sizes only
    for name, result in record["workloads"].items():
        assert result["bytes"] > 0 and result["flops"] > 0, name
        assert result["copy"]["gb_s"] > 0, name
        for peer in (gpu_decode.BASELINE, gpu_decode.REFERENCE):
            assert result["backends"][peer]["status"] == "ok", (name, peer)


def test_every_peer_that_ran_agrees_with_xla(record):
    for name, result in record["workloads"].items():
        for peer, row in result["backends"].items():
            assert row["status"] in ("ok", "skipped", "unavailable"), (name, peer, row["note"])
            if row["status"] != "ok":
                assert row["note"], (name, peer)
                continue
            assert ROW_FIELDS <= set(row), (name, peer)
            assert row["agrees"] is True, (name, peer, row["max_abs_err_vs_xla"])
            assert row["reps"] == len(row["times_s"]) >= 1
            assert row["bytes"] == result["bytes"]
        assert result["backends"][gpu_decode.BASELINE]["ratio_vs_pallas"] == 1.0


def test_peers_expected_here_ran(record):
    decode = record["workloads"]["decode-bs16"]["backends"]
    prefill = record["workloads"]["prefill-16x1024"]["backends"]
    assert decode["pallas-ragged"]["status"] == "ok"
    assert prefill["jax-dpa"]["status"] == "ok"
    if gpu_decode._jax_op_available() is None:
        assert decode["jax-pallas-op"]["status"] == "ok"
        assert decode["jax-pallas-op"]["k_splits"] >= 1
    if importlib.util.find_spec("torch") is not None:
        for peer in ("torch-sdpa+gather", "torch-sdpa-dense", "torch-flex-paged"):
            assert decode[peer]["status"] == "ok", peer
        assert decode["torch-sdpa+gather"]["gather"] == "inside timing"
        assert prefill["torch-sdpa-flash"]["status"] == "ok"


def test_missing_peer_is_listed_with_its_reason(tmp_path):
    missing = gpu_decode.Peer(
        "nowhere", ("prefill",), lambda: "not available: no such kernel here", None
    )
    xla = next(p for p in gpu_decode.PEERS if p.name == gpu_decode.REFERENCE)
    path = tmp_path / "one.json"
    args = argparse.Namespace(smoke=True, workloads="prefill-16x1024", reps=1, json=str(path))
    assert gpu_decode.run(args, peers=[xla, missing]) == 0
    record = json.loads(path.read_text())
    assert record["unavailable"] == {"nowhere": "not available: no such kernel here"}
    row = record["workloads"]["prefill-16x1024"]["backends"]["nowhere"]
    assert row == {"status": "unavailable", "note": "not available: no such kernel here"}


def test_unknown_workload_is_refused():
    assert gpu_decode.main(["--smoke", "--workloads", "decode-bs16,nope"]) == 2


@pytest.mark.parametrize(
    ("max_blocks", "expected"), [(256, (256, 16, 8)), (32, (32, 16, 2)), (3, (3, 3, 1)),
                                 (40, (48, 16, 3)), (200, (256, 16, 8))],
)  # fmt: skip
def test_jax_op_tables_meet_the_ops_divisibility_rules(max_blocks, expected):
    tables = np.arange(2 * max_blocks, dtype=np.int32).reshape(2, max_blocks)
    padded, k_splits, per_step = gpu_decode.jax_op_tables(tables)
    assert (padded.shape[1], k_splits, per_step) == expected
    per_split = padded.shape[1] // k_splits
    assert padded.shape[1] % k_splits == 0 and per_split % per_step == 0
    np.testing.assert_array_equal(padded[:, :max_blocks], tables)
    assert not padded[:, max_blocks:].any()


def test_flex_block_mask_arrays_example():
    tables = np.array([[7, 2, 5]], np.int32)
    part, part_idx, full, full_idx, p2l = gpu_decode.flex_block_mask_arrays(
        tables, np.array([40], np.int32), num_blocks=9, bs=16
    )
    assert full.ravel().tolist() == [2] and full_idx[0, 0, 0, :2].tolist() == [7, 2]
    assert part.ravel().tolist() == [1] and part_idx[0, 0, 0, 0] == 5
    assert {b: int(p2l[0, b]) for b in np.flatnonzero(p2l[0] >= 0)} == {7: 0, 2: 1, 5: 2}
    assert part_idx.shape == full_idx.shape == (1, 1, 1, 9)
