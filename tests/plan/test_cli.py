"""`seekforge plan ...` end to end through the CLI entry point."""

import pytest

from seekforge.cli import main


def test_plan_memory_table(capsys):
    main(["plan", "memory", "--preset", "small", "--parallel", "pp=2,microbatches=4", "--micro-batch-size", "8",
          "--seq-len", "256", "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert "pp rank 0 (stages 0)" in out and "pp rank 1 (stages 1)" in out and "peak" in out


def test_plan_memory_traced(capsys):
    main(["plan", "memory", "--preset", "tiny", "--parallel", "dp_shard=2", "--micro-batch-size", "2",
          "--seq-len", "32", "--traced"])
    assert "traced (the real step on fake tensors, rank 0): peak" in capsys.readouterr().out


def test_plan_schedule_writes_the_timeline(capsys, tmp_path):
    main(["plan", "schedule", "--schedule", "ZBVZeroBubble", "--pp", "2", "--microbatches", "4",
          "--png", str(tmp_path / "zbv.png")])
    assert "bubble 0" in capsys.readouterr().out
    assert (tmp_path / "zbv.png").exists()


def test_plan_schedule_dualpipev_fandb(capsys):
    """F = 1, B = 2 (I = W = 1), F&B = 2.5 on 4 ranks: DeepSeek's (4 - 1)(2.5 + 2 - 3) = 4.5."""
    main(["plan", "schedule", "--schedule", "DualPipeV", "--pp", "4", "--microbatches", "10", "--fandb", "2.5"])
    assert "bubble 4.5 " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "schedule", "--schedule", "DualPipeV", "--pp", "4", "--microbatches", "10", "--fandb", "1.5"])
    assert exit_info.value.code == 2 and "--fandb 1.5 must lie between" in capsys.readouterr().err


def test_plan_balance_prints_a_parallel_argument(capsys):
    main(["plan", "balance", "--preset", "small", "--pp", "2", "--seq-len", "256", "--micro-batch-size", "2",
          "--flops", "1e12"])
    out = capsys.readouterr().out
    assert "--parallel pp=2,pp_schedule=1F1B,microbatches=4,pp_split_points=[" in out


def test_plan_search_impossible_cluster_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "search", "--preset", "v3-671b", "--devices", "8", "--device-memory", "80GB",
              "--global-batch", "64"])
    assert exit_info.value.code == 2
    assert "no layout of 8 devices fits" in capsys.readouterr().err
