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


def test_plan_memory_per_ep_rank_skews_and_context_parallelism(capsys):
    main(["plan", "memory", "--preset", "small", "--parallel", "dp_shard=2,ep=2", "--seq-len", "256",
          "--moe-skew", "1.3,0.7"])
    out = capsys.readouterr().out
    assert "(EP rank 0)" in out and "(EP rank 1)" in out
    main(["plan", "memory", "--preset", "small", "--parallel", "cp=2,dp_shard=2", "--seq-len", "256",
          "--dtype", "fp32"])
    assert "cp=2: each rank holds 128 tokens of every sequence" in capsys.readouterr().out
    # cp composes with TP, PP and EP (ep borrowing cp ranks), in bf16
    for layout in ("cp=2,tp=2", "cp=2,tp=2,pp=2,microbatches=2", "cp=2,ep=2,mixed_precision=bf16"):
        main(["plan", "memory", "--preset", "small", "--parallel", layout, "--seq-len", "256", "--micro-batch-size",
              "2"])
        out = capsys.readouterr().out
        assert "each rank holds 128 tokens" in out and "peak" in out, layout


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
    assert "headroom under 74.5 GiB" in out  # the full dry run of the balanced layout, against the device


def test_plan_search_impossible_cluster_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "search", "--preset", "v3-671b", "--devices", "8", "--device-memory", "80GB",
              "--global-batch", "64"])
    assert exit_info.value.code == 2
    assert "no layout of 8 devices fits" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["schedule", "--pp", "0"], "--pp 0: give at least 1"),
    (["schedule", "--pp", "4", "--microbatches", "2"],
     "microbatches=2 < pp=4 leaves stages idle; use microbatches >= 4"),
    (["schedule", "--pp", "4", "--microbatches", "0"], "--microbatches 0: give at least 1"),
    (["schedule", "--schedule", "ZB-H1", "--pp", "4", "--microbatches", "3"], "microbatches=3 < pp=4"),
    (["schedule", "--schedule", "DualPipeV", "--pp", "4", "--microbatches", "4"],
     "DualPipeV needs microbatches >= num_stages=8"),
    (["schedule", "--forward", "-1"], "--forward -1.0: give a time >= 0"),
    (["memory", "--preset", "tiny", "--micro-batch-size", "-3"], "--micro-batch-size -3: give at least 1"),
    (["memory", "--preset", "tiny", "--micro-batch-size", "0"], "--micro-batch-size 0: give at least 1"),
    (["memory", "--preset", "tiny", "--seq-len", "-128"], "--seq-len -128: give at least 1"),
    (["memory", "--preset", "tiny", "--moe-skew", "0.5"], "--moe-skew 0.5: give at least 1"),
    (["memory", "--preset", "small", "--moe-skew", "1,-1"], "one value >= 0 per expert-parallel rank"),
    (["memory", "--preset", "small", "--parallel", "dp_shard=2,ep=2", "--moe-skew", "1,1,1"],
     "or 2 non-negative ones, one per EP rank"),
    (["memory", "--preset", "small", "--parallel", "cp=2", "--seq-len", "250"], "use a multiple of 4"),
    (["memory", "--preset", "small", "--parallel", "dp_shard=2,ep=2,etp=2"], "ep*etp = 2*2 = 4 does not divide"),
    (["memory", "--preset", "small", "--parallel", "cp=2,dp_shard=4,ep=2,etp=2"], "use ep_nodes=1 and etp=1 with cp"),
    (["memory", "--preset", "small", "--parallel", "cp=2", "--seq-len", "64", "--traced"],
     "tp=1, ep=1, pp=1, cp=2 need real collectives"),
    (["memory", "--parallel", "tp=3"], "tp=3 does not divide num_attention_heads=128; pick tp in [1, 2, 4, 8, 16"),
    (["memory", "--parallel", "tp=5"], "tp=5 does not divide num_attention_heads=128"),
    (["memory", "--preset", "small", "--parallel", "pp=4"], "microbatches=1 < pp=4 leaves stages idle"),
    (["memory", "--preset", "small", "--parallel", "tpp=2"], "parallel has unknown key(s) ['tpp']"),
    (["memory", "--preset", "tiny", "--parallel", "pp=2,microbatches=2"],
     "micro_batch_size=1 (per data-parallel rank) is not divisible by microbatches=2; make it a multiple of 2"),
    (["balance", "--preset", "small", "--pp", "2", "--seq-len", "0"], "--seq-len 0: give at least 1"),
    (["balance", "--preset", "small", "--pp", "4", "--microbatches", "2"], "microbatches=2 < pp=4"),
    (["balance", "--preset", "small", "--pp", "2", "--parallel", "tp=3"],
     "tp=3 does not divide num_attention_heads=8; pick tp in [1, 2, 4, 8]"),
    (["balance", "--preset", "small", "--pp", "2", "--flops", "0"], "--flops 0.0: give a rate > 0"),
    (["search", "--preset", "small", "--devices", "8", "--global-batch", "0"], "--global-batch 0: give at least 1"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_plan_refuses_what_pretrain_would(argv, says, capsys):
    """A layout pretrain refuses (ParallelConfig's checks, one validator) and a count below 1 end in one
    line naming the fix, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("seekforge plan: error: ") and says in err, err


@pytest.mark.parametrize("argv", [
    ["--pp", "2"],
    ["--pp", "4", "--microbatches", "4", "--micro-batch-size", "2", "--parallel", "dp_shard=2,tp=2"],
], ids=" ".join)
def test_plan_balance_flags_are_ones_pretrain_accepts(argv, capsys, monkeypatch):
    """The printed flags pass pretrain's own layout and batch checks (train/pretrain.parallel_layout)."""
    from seekforge.config import TrainConfig, parse_parallel
    from seekforge.train.pretrain import parallel_layout

    main(["plan", "balance", "--preset", "small", "--seq-len", "256", "--flops", "1e12", *argv])
    flags = capsys.readouterr().out.splitlines()[-1].removeprefix("pretrain flags: ").split()
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    cfg = TrainConfig(preset="small", seq_len=int(given["--seq-len"]),
                      micro_batch_size=int(given["--micro-batch-size"]), parallel=parse_parallel(given["--parallel"]))
    pc = cfg.parallel_config()
    monkeypatch.setenv("WORLD_SIZE", str(pc.world_size))  # as torchrun would start it
    assert parallel_layout(cfg, cfg.model_config(), pc.world_size) == pc


def test_every_plan_option_has_a_description():
    """`seekforge plan --help` and each sub-verb's --help describe every option (argparse prints none
    for an option without help, and no default either)."""
    import argparse

    from seekforge.plan.cli import add_arguments

    parser = argparse.ArgumentParser(prog="seekforge plan")
    add_arguments(parser)
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(choice.help for choice in verbs._choices_actions)
    bare = [f"{verb} {action.option_strings[-1]}" for verb, sub in verbs.choices.items() for action in sub._actions
            if not action.help]
    assert not bare, f"options without a description: {bare}"
