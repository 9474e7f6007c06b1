import argparse
import json
import re

import pytest
import torch

from seekforge.cli import main
from seekforge.config import ParallelConfig, preset
from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint


def test_pretrain_cli_writes_run_artifacts(tmp_path, capsys):
    out = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text("preset: tiny\nseq_len: 32\nmicro_batch_size: 4\nsteps: 4\nwarmup: 1\n"
                      "eval_interval: 2\neval_batches: 1\nsave_interval: 2\nlog_interval: 2\npeak_flops: 1.0e+11\n")
    main(["pretrain", "--config", str(config), "--out-dir", str(out), "--set", "sample_prompt=ab",
          "--lr", "1e-3"])
    printed = capsys.readouterr().out
    assert "unigram-entropy baseline" in printed and "sample (temperature" in printed

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "lm_loss", "mtp_loss", "grad_norm", "lr", "tokens_per_s", "mfu", "expert_imbalance"):
        assert key in records[-1], key
    assert len(records[-1]["expert_imbalance"]) == 3  # tiny: 2 MoE layers + 1 MTP MoE block
    assert "eval_loss" in records[1] and "eval_loss" in records[3]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "loss.png").stat().st_size > 1000
    assert latest_checkpoint(out / "checkpoints").name == "step_000004"
    assert (out / "train_config.yaml").exists()
    # The export names the byte tokenizer's real special ids, and carries a tokenizer transformers loads.
    for name in ("config.json", "generation_config.json"):
        exported = json.loads((out / "hf" / name).read_text())
        assert (exported["bos_token_id"], exported["eos_token_id"]) == (256, 257), name
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out / "hf")("ab<|eos|>")["input_ids"] == [97, 98, 257]
    capsys.readouterr()
    for source in (out, out / "hf"):  # `info --config` takes the run directory for its HF export
        main(["info", "--config", str(source)])
        assert "layers 3 (1 dense, 2 MoE)" in capsys.readouterr().out

    # Rerunning the same command resumes; the finished run has nothing left to do.
    main(["pretrain", "--config", str(config), "--out-dir", str(out), "--set", "sample_prompt="])
    assert "nothing to train" in capsys.readouterr().out

    # --no-resume starts over with nothing of the earlier run left to mix in: one TensorBoard event file, 4 records
    main(["pretrain", "--config", str(config), "--out-dir", str(out), "--set", "sample_prompt=", "--no-resume",
          "--set", "export_hf=false"])
    assert "starting over" in capsys.readouterr().out
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_resume_refuses_another_model_and_says_a_changed_schedule(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["pretrain", "--preset", "tiny", "--out-dir", str(out), "--seq-len", "32", "--micro-batch-size", "2",
            "--set", "sample_prompt=", "--set", "export_hf=false", "--set", "warmup=1", "--set", "peak_flops=1e11"]
    main(base + ["--steps", "2", "--set", "model.num_hidden_layers=2"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(base + ["--steps", "3", "--set", "model.num_hidden_layers=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "num_hidden_layers=2" in err and "num_hidden_layers=3" in err and "--no-resume" in err
    assert latest_checkpoint(out / "checkpoints").name == "step_000002"
    main(base + ["--steps", "3", "--set", "model.num_hidden_layers=2"])
    assert "resuming with another lr schedule (steps 2 → 3)" in capsys.readouterr().out


def test_a_converted_checkpoint_continues_with_the_command_convert_prints(tmp_path, capsys):
    """`seekforge convert HF_DIR RUN_DIR` says "continue training with: seekforge pretrain --out-dir RUN_DIR": with no
    --preset, that run's model is the converted one (tiny), not the default run's (hidden 192), which the user never
    asked for; a model key they do set is still checked against it."""
    from seekforge.config import preset
    from seekforge.model.model import build_model
    from seekforge.train.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "run" / "checkpoints", 5, build_model(preset("tiny"), seed=3))
    main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "float32"])
    main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")])
    assert "seekforge pretrain --out-dir " + str(tmp_path / "back") in capsys.readouterr().out
    quick = ["--seq-len", "32", "--micro-batch-size", "2", "--set", "sample_prompt=", "--set", "export_hf=false",
             "--set", "warmup=1", "--set", "peak_flops=1e11"]
    main(["pretrain", "--out-dir", str(tmp_path / "back"), "--steps", "1", *quick])
    assert latest_checkpoint(tmp_path / "back" / "checkpoints").name == "step_000001"
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--out-dir", str(tmp_path / "back"), "--steps", "2", "--set", "model.hidden_size=96", *quick])
    assert exit_info.value.code == 2 and "hidden_size=96" in capsys.readouterr().err


def test_pretrain_cli_bad_input_is_a_clean_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--preset", "tiny", "--set", "stpes=3", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "stpes" in capsys.readouterr().err


def test_convert_round_trip(tmp_path):
    from seekforge.config import preset
    from seekforge.model.model import build_model
    from seekforge.train.checkpoint import save_checkpoint

    model = build_model(preset("tiny"), seed=3)
    save_checkpoint(tmp_path / "run" / "checkpoints", 7, model)
    main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "float32"])
    main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")])
    restored = build_model(preset("tiny"), seed=0)
    assert load_checkpoint(latest_checkpoint(tmp_path / "back" / "checkpoints"), restored) == 0
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    # HF → DCP into a directory that holds a run (or an HF export) is refused: the run's checkpoints stay
    for dest in (tmp_path / "run", tmp_path / "hf"):
        with pytest.raises(SystemExit) as exit_info:
            main(["convert", str(tmp_path / "hf"), str(dest)])
        assert exit_info.value.code == 2
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000007"
    assert not (tmp_path / "hf" / "checkpoints").exists()


def test_convert_refuses_a_damaged_checkpoint(tmp_path, capsys):
    from seekforge.config import preset
    from seekforge.model.model import build_model
    from seekforge.train.checkpoint import save_checkpoint

    step = save_checkpoint(tmp_path / "run" / "checkpoints", 3, build_model(preset("tiny"), seed=3))
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    for source in (step, tmp_path / "run"):
        with pytest.raises(SystemExit) as exit_info:
            main(["convert", str(source), str(tmp_path / "hf")])
        assert exit_info.value.code == 2
        assert shard.name in capsys.readouterr().err


def test_ctrl_c_says_whether_a_rerun_resumes(tmp_path, capsys, monkeypatch):
    """Interrupted before its first save, a run has nothing to resume from: the line says so (it had promised a resume
    either way); after one, it names the checkpoint a rerun resumes from."""
    from seekforge.train import pretrain as pretrain_module

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain_module, "pretrain", interrupted)
    out = tmp_path / "run"
    for expected in ("no checkpoint is saved yet (save_interval=100", "last checkpoint, step_000004"):
        with pytest.raises(SystemExit) as exit_info:
            main(["pretrain", "--preset", "tiny", "--out-dir", str(out)])
        assert exit_info.value.code == 130 and expected in capsys.readouterr().err
        (out / "checkpoints" / "step_000004").mkdir(parents=True, exist_ok=True)


def test_every_example_in_pretrain_help_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # --set examples resolve the default run directory; keep it empty
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help wraps lines anywhere
    commands = re.findall(r"\((?:any size: )?(--preset [^)]+)\)", text)
    assert commands, "no command example found in pretrain --help"
    for command in commands:  # each dry-runs as printed
        main(["pretrain", "--dry-run", *command.split()])
        assert "nothing materialized" in capsys.readouterr().out, command
    settings = re.findall(r"--set ([\w.]+=\d[^\s;,]*)", text)  # not the KEY=VALUE placeholders
    assert settings, "no --set example found in pretrain --help"
    from seekforge.train.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config_from_args(parser.parse_args([arg for s in settings for arg in ("--set", s)]))
    for layout in re.findall(r"e\.g\. ((?:\w+=\d+,?)+) \(world size", text):
        pc = ParallelConfig(**{k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))})
        pc.validate(pc.pp * pc.dp_replicate * pc.dp_shard * pc.tp, preset("small"))


def test_convert_writes_what_pretrains_export_writes(tmp_path):
    """fp32 as pretrain's hf/ (the checkpoint's master weights), files readable as any other (mode 0644 under
    umask 022; safetensors alone leaves 0600), and the index HF writes once there are several shards."""
    import os

    from safetensors import safe_open

    from seekforge.config import preset
    from seekforge.model.model import build_model
    from seekforge.train.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "run" / "checkpoints", 7, build_model(preset("tiny"), seed=3))
    old_umask = os.umask(0o022)
    try:
        main(["convert", str(tmp_path / "run"), str(tmp_path / "hf")])
        main(["convert", str(tmp_path / "run"), str(tmp_path / "sharded"), "--max-shard-size", "200KB"])
    finally:
        os.umask(old_umask)
    hf = tmp_path / "hf"
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "float32"
    with safe_open(hf / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    for file in [*hf.iterdir(), *(tmp_path / "sharded").iterdir()]:
        assert oct(file.stat().st_mode & 0o777) == oct(0o644), file
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()


def test_a_new_snippet_in_a_finished_runs_directory_says_pass_name(tmp_path, capsys, monkeypatch):
    """README snippets run after the main job land in its runs/default: other data, or an explicit --preset
    of another model, must not silently resume it (the data failed obscurely, the preset trained the stored
    model); both say to pass --name (or --no-resume)."""
    monkeypatch.chdir(tmp_path)
    quick = ["--seq-len", "32", "--micro-batch-size", "2", "--steps", "1", "--set", "sample_prompt=",
             "--set", "export_hf=false", "--set", "peak_flops=1e11"]
    main(["pretrain", *quick])  # the main job's model, in runs/default
    capsys.readouterr()
    for other in (["--data", "builtin:arithmetic"], ["--preset", "small"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["pretrain", *quick, "--steps", "2", *other])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--name" in err and "--no-resume" in err and "Traceback" not in err, err
    assert latest_checkpoint(tmp_path / "runs" / "default" / "checkpoints").name == "step_000001"
    main(["pretrain", "--preset", "small", "--dry-run"])  # sizes small, not runs/default's stored model
    from seekforge.config import ParallelConfig, preset
    from seekforge.parallel.materialize import dry_run

    byte_vocab = dict(vocab_size=320, bos_token_id=256, eos_token_id=257)
    assert capsys.readouterr().out == dry_run(preset("small", **byte_vocab), ParallelConfig()) + "\n"
    main(["pretrain", *quick, "--preset", "small", "--name", "small", "--set", "model.num_hidden_layers=1"])
    assert latest_checkpoint(tmp_path / "runs" / "small" / "checkpoints").name == "step_000001"


def test_the_dry_run_describes_the_model_the_run_trains(tmp_path, capsys):
    """--dry-run sizes the model through the same function as the run (train/pretrain.run_model): a new run's
    vocab is its tokenizer's (byte: 320 rows, not the preset's 512), and a run to resume keeps its own model (here a
    tiny one, not the default run's hidden 192)."""
    from seekforge.config import ParallelConfig, preset
    from seekforge.model.model import build_model
    from seekforge.parallel.materialize import dry_run
    from seekforge.train.checkpoint import save_checkpoint

    layout = ParallelConfig(dp_shard=2)
    main(["pretrain", "--dry-run", "--preset", "tiny", "--parallel", "dp_shard=2", "--out-dir", str(tmp_path / "new")])
    assert capsys.readouterr().out == dry_run(preset("tiny", vocab_size=320, bos_token_id=256, eos_token_id=257),
                                              layout) + "\n"
    save_checkpoint(tmp_path / "run" / "checkpoints", 5, build_model(preset("tiny"), seed=3))
    main(["pretrain", "--dry-run", "--parallel", "dp_shard=2", "--out-dir", str(tmp_path / "run")])
    assert capsys.readouterr().out == dry_run(preset("tiny"), layout) + "\n"


def test_pretrain_returns_the_metrics_of_each_step_it_ran(tmp_path):
    """As its docstring says (it returned None): one record per step of this call, none on a rerun."""
    from seekforge.config import TrainConfig
    from seekforge.train.pretrain import pretrain

    cfg = TrainConfig(preset="tiny", steps=2, seq_len=32, micro_batch_size=2, export_hf=False, sample_prompt="",
                      peak_flops=1e11, out_dir=str(tmp_path / "run"))
    history = pretrain(cfg)
    assert len(history) == 2 and all(record["loss"] > 0 for record in history)
    assert pretrain(cfg) == []  # resumed at step 2 of 2: nothing left to train


def test_a_config_file_of_another_model_does_not_resume_a_run_silently(tmp_path, capsys):
    """As an explicit --preset: the file names a model, the directory holds a run of another; say --name/--no-resume."""
    from seekforge.config import preset
    from seekforge.model.model import build_model
    from seekforge.train.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "run" / "checkpoints", 1, build_model(preset("tiny", num_hidden_layers=2), seed=3))
    config = tmp_path / "run.yaml"
    config.write_text(f"preset: tiny\nout_dir: {tmp_path / 'run'}\nsteps: 2\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--config", str(config)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--config {config}" in err and "--no-resume" in err, err
