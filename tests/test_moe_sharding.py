"""Mixtures of experts under expert, tensor and data parallelism on forced CPU devices, against one device and HF.

`tests/moe_sharding_worker.py` runs in processes of its own (forced devices act only before JAX starts): each
tiny MoE family of `tests/test_moe.py` on one device, with its experts split over 2 and 4 devices (attention
whole on each), under tensor parallel 2 (each expert's intermediate axis split), tensor parallel 2 with the
experts split over the same 2 devices, data parallel 2, and data parallel 2 x expert parallel 2; and HF's
`generate`. Two workers at once, on half the families each. The collectives of each compiled decode step are
counted from its HLO: expert parallelism adds one all-reduce per layer, of the step's f32[rows, hidden]. And two
processes (`jax.distributed`, one device each) with the experts split over them, process 0 giving the requests.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

import socket

from workers import run_workers, worker_env

WORKER = pathlib.Path(__file__).with_name("moe_sharding_worker.py")
sys.path.insert(0, str(WORKER.parent))
from moe_sharding_worker import RUNS, halves  # noqa: E402

CASES = [(name, run) for run, (_, families) in RUNS.items() if run != "one" for name in families]
DEVICES = {"ep2": 2, "tp2": 2, "tp2ep2": 2, "ep4": 4, "dp2": 2, "dp2ep2": 4}
HIDDEN, DECODE_ROWS = 64, 4  # the tiny models' hidden size; the decode step's bucket of 3 rows


@pytest.fixture(scope="module")
def seen():
    argvs = [[str(WORKER), "--families", ",".join(names)] for names in halves()]
    results = run_workers(argvs, worker_env(4), timeout=900)
    assert all(r["num_devices"] == 4 for r in results)
    return {"prompt_ids": results[0]["prompt_ids"], "families": {k: v for r in results for k, v in r["families"].items()}}


@pytest.mark.parametrize("name", RUNS["one"][1])
def test_one_device_gives_hf_generate_tokens(seen, name):
    family = seen["families"][name]
    assert family["one"] == family["hf"], name
    assert family["one_collectives"]["counts"] == {}


@pytest.mark.parametrize("name, run", CASES)
def test_sharded_gives_one_devices_and_hf_tokens(seen, name, run):
    family = seen["families"][name]
    assert family[f"{run}_devices"] == DEVICES[run]
    assert family[run] == family["one"] == family["hf"], f"{name} under {run}"


@pytest.mark.parametrize("name", RUNS["ep2"][1])
def test_expert_parallelism_combines_with_one_all_reduce_a_layer(seen, name):
    """The experts split, attention whole: the decode step's only collective is the experts' psum, inside the
    layer scan, of f32[rows, hidden]; tensor parallelism beside it adds its own (after o) on the same axis, and
    OLMoE's q/k norm over the whole projection, whose heads are then split, one more (the sum of squares)."""
    ep2, tp2ep2 = seen["families"][name]["ep2_collectives"], seen["families"][name]["tp2ep2_collectives"]
    assert ep2["counts"] == ep2["in_loop"] == {"all-reduce": 1}
    assert ep2["bytes"] == {"all-reduce": 4 * DECODE_ROWS * HIDDEN}
    assert tp2ep2["in_loop"]["all-reduce"] == (3 if name == "olmoe" else 2)


def test_two_processes_split_the_experts_and_give_hfs_tokens(tmp_path):
    """Qwen3-MoE with expert parallel size 2 over two processes of one device each (gloo's all-reduce combines
    the experts across them): both processes return HF's greedy tokens."""
    directory = tmp_path / "qwen3_moe"
    built = run_workers([[str(WORKER), "--build", str(directory)]], worker_env(1), timeout=300)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argvs = [[str(WORKER), "--process", f"127.0.0.1:{port}", "2", str(i), str(directory)] for i in range(2)]
    runs = run_workers(argvs, worker_env(1), timeout=400)
    for i, run in enumerate(runs):
        assert run["process_id"] == i and run["num_devices"] == 2 and run["local_devices"] == 1
        assert run["tokens"] == built["hf"], f"process {i}"
        assert run["collectives"]["in_loop"] == {"all-reduce": 1}
