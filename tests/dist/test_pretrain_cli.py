"""`seekforge pretrain --parallel ...` on 2 gloo ranks (the CLI entry called in-process on each rank,
as torchrun would run it) reproduces the single-device run under FSDP and under a pipeline, resumes
its checkpoint under another layout, and `seekforge convert` turns that distributed checkpoint into
an HF directory."""

import json
import re
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from dist_launcher import launch

from seekforge.cli import main
from seekforge.model.hf import load_hf

STEPS, SAVE_AT = 4, 2
# fp32. Measured: losses within 5e-7, grad norms within 6e-7 and final weights within 1.6e-7 of the
# single-device run (FSDP and TP sum in another order). A real error (a wrong data slice, a missing
# gradient reduction) moves the loss by > 1e-2 within two steps. The weight bound leaves room for
# AdamW's m/(sqrt(v)+eps), which amplifies reduction-order noise in near-zero gradients
# (test_data_parallel.py measured 5.2e-5); one step of lr moves a weight by about 1e-4.
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


def pretrain_args(out_dir, *extra: str) -> list[str]:
    return ["pretrain", "--preset", "tiny", "--data", "builtin:arithmetic", "--seq-len", "32",
            "--micro-batch-size", "4", "--steps", str(STEPS), "--dtype", "fp32", "--out-dir", str(out_dir),
            "--set", "peak_flops=1e11", "--set", "log_interval=0", "--set", "eval_interval=0",
            "--set", f"save_interval={SAVE_AT}", "--set", "sample_prompt=", *extra]


def run_cli(argv: list[str]) -> None:
    main(argv)


def curves(run_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records}


def assert_same_curves(got: dict, expected: dict, steps) -> None:
    for step in steps:
        for key in ("loss", "lm_loss", "mtp_loss", "grad_norm", "lr"):
            assert abs(got[step][key] - expected[step][key]) <= LOSS_TOL, (step, key, got[step], expected[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-device run and the same command on 2 ranks under FSDP (dp_shard=2)."""
    root = tmp_path_factory.mktemp("pretrain")
    main(pretrain_args(root / "single"))
    launch(run_cli, 2, pretrain_args(root / "fsdp", "--parallel", "dp_shard=2"))
    return root


def test_fsdp_pretrain_matches_single_device(runs):
    assert_same_curves(curves(runs / "fsdp"), curves(runs / "single"), range(1, STEPS + 1))
    ref, got = load_hf(runs / "single" / "hf").state_dict(), load_hf(runs / "fsdp" / "hf").state_dict()
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    print(f"fsdp vs single: max weight diff {worst:.1e}")
    assert worst <= WEIGHT_TOL


def test_fsdp_checkpoint_resumes_under_tensor_parallel(runs, tmp_path):
    # A dp_shard=2 run preempted after step 2: its latest checkpoint and log stop there.
    run = tmp_path / "resumed"
    shutil.copytree(runs / "fsdp", run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:06d}")
    (run / "checkpoints" / "latest").write_text(f"step_{SAVE_AT:06d}\n")
    kept = [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= SAVE_AT]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")

    launch(run_cli, 2, pretrain_args(run, "--parallel", "tp=2", "--set", "export_hf=false"))
    assert_same_curves(curves(run), curves(runs / "single"), range(1, STEPS + 1))


def test_convert_distributed_checkpoint_to_hf_and_back(runs, tmp_path):
    # No process group here: DCP reads the 2-rank checkpoint's shards into one process.
    main(["convert", str(runs / "fsdp"), str(tmp_path / "hf"), "--dtype", "float32"])
    converted = load_hf(tmp_path / "hf").state_dict()
    exported = load_hf(runs / "fsdp" / "hf").state_dict()  # gathered from the shards at the end of the run
    assert converted.keys() == exported.keys()
    for name, value in exported.items():
        torch.testing.assert_close(converted[name], value, rtol=0, atol=0, msg=name)

    # HF → a weights-only checkpoint that a TP run starts from.
    main(["convert", str(tmp_path / "hf"), str(tmp_path / "again")])
    launch(run_cli, 2, pretrain_args(tmp_path / "again", "--parallel", "tp=2", "--steps", "1",
                                      "--set", "export_hf=false", "--set", "save_interval=0"))
    first = curves(tmp_path / "again")[1]
    assert first["lm_loss"] < curves(runs / "single")[1]["lm_loss"] - 0.1  # trained weights, not a fresh init


# The pipeline runs the single-device objective: gradient accumulation over 2 steps of 2 micro-batches,
# a balance loss weighted enough to move the router, MTP, 4 layers (ZBV's 4 stages on 2 ranks).
PP_ARGS = ("--grad-accum", "2", "--set", "aux_loss_coeff=0.01", "--set", "model.num_hidden_layers=4")
# Relative bounds. fp32: reduction order only (measured < 1e-6). bf16 autocast: the tolerance of the
# single-device bf16 tests (tests/train/test_hot_path.py, 2e-2), since a micro-batch of 2 samples
# rounds its matmuls differently from one of 4.
PP_TOL = {"fp32": 1e-5, "bf16": 2e-2}
PP_CURVES = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm", "lr")


@pytest.fixture(scope="module")
def single_device_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_reference")
    for dtype in PP_TOL:
        main(pretrain_args(root / dtype, *PP_ARGS, "--dtype", dtype))
    return root


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
@pytest.mark.parametrize("dtype", list(PP_TOL))
def test_pipeline_pretrain_matches_single_device(schedule, dtype, single_device_runs, tmp_path):
    launch(run_cli, 2, pretrain_args(tmp_path, *PP_ARGS, "--dtype", dtype,
                                     "--parallel", f"pp=2,microbatches=2,pp_schedule={schedule}"))
    single, pipelined = curves(single_device_runs / dtype), curves(tmp_path)
    assert single[STEPS]["aux_loss"] > 1e-3  # the balance loss is really on
    for step in range(1, STEPS + 1):
        for key in PP_CURVES + (("eval_loss",) if step == STEPS else ()):
            assert pipelined[step][key] == pytest.approx(single[step][key], rel=PP_TOL[dtype]), (step, key)
    if dtype == "fp32":
        ref = load_hf(single_device_runs / dtype / "hf").state_dict()
        got = load_hf(tmp_path / "hf").state_dict()
        assert got.keys() == ref.keys()  # rank 0 gathered every stage
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= WEIGHT_TOL


def test_pipeline_checkpoint_resumes_on_one_process(single_device_runs, tmp_path):
    launch(run_cli, 2, pretrain_args(tmp_path, *PP_ARGS, "--dtype", "fp32", "--parallel", "pp=2,microbatches=2"))
    # The pipeline's step-2 checkpoint (each rank wrote its stages) continues on one process.
    (tmp_path / "checkpoints" / "latest").write_text(f"step_{SAVE_AT:06d}\n")
    shutil.rmtree(tmp_path / "checkpoints" / f"step_{STEPS:06d}")
    main(pretrain_args(tmp_path, *PP_ARGS, "--dtype", "fp32", "--set", "export_hf=false"))
    assert_same_curves(curves(tmp_path), curves(single_device_runs / "fp32"), range(SAVE_AT + 1, STEPS + 1))


@pytest.mark.parametrize("spec, message", [
    ("dp_shard2", r"'dp_shard2' is not key=value; write e.g. --parallel dp_shard=2,tp=2"),
    ("tpp=2", r"unknown key\(s\) \['tpp'\]"),
    ("tp=0", r"tp=0: must be a positive integer"),
    ("tp=2", r"asks for 2 ranks but this is a single process; launch with torchrun --nproc-per-node 2"),
])
def test_bad_parallel_is_one_clean_error(spec, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(pretrain_args(tmp_path, "--parallel", spec))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_bad_layout_fails_on_every_rank_with_one_message(tmp_path, capfd):
    with pytest.raises(mp.ProcessExitedException, match="exit code 2"):
        launch(run_cli, 2, pretrain_args(tmp_path, "--parallel", "dp_shard=2,tp=2"))
    err = capfd.readouterr().err
    assert err.count("seekforge pretrain: error:") == 1, err
    assert "= 4, but the world size is 2; use dp_shard=1" in err
