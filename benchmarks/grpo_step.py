"""One GRPO iteration: seekforge's GRPOTrainer vs TRL's GRPOTrainer, same model, same settings.

An iteration = rollout of 8 prompts × G = 8 completions of up to 128 new tokens (temperature 1) +
rewards + the training phase (one optimizer step, dapo loss, β = 0). `--dtype auto` (the default) is
what `seekforge grpo` picks for the model (model/precision.py; on a CPU with native bf16, from 512 wide:
bf16 autocast over fp32 master weights in training, a bf16 replica for the rollouts). TRL runs in that
dtype, and also in fp32 where that is bf16: its faster run is compared. Same model (the
`small` preset without MTP, random weights, saved once as an HF checkpoint both sides load), same
byte-level tokenizer (a tokenizer.json both sides read), same prompts (the arithmetic task's), same
reward (exact answer). Random weights rarely emit end-of-sequence, so both sides generate close to
the full 128 tokens: equal work, printed per side.

seekforge: rollouts on its co-located continuous-batching engine (paged latent KV cache), training
on dynamically packed rows. TRL: `transformers.generate` on the padded batch, training on padded
micro-batches. Each contender runs in its own child process, one after the other, timed from after
construction; each runs two iterations and the second (warm) one is timed (TRL: from its
`on_step_begin` to its `on_step_end` callback, which encloses generation, scoring and the update);
the peak RSS of each child is its own. seekforge's rollouts run compiled decode steps (GRPOConfig.compile,
serve/compiled.py), compiled while its trainer is built (printed; `--eager` turns them off). seekforge also
runs with the memory swap off (KV pool kept through training), to show what the swap saves.

Like for like in recompute: two settings, each on both sides — `off` (TRL's gradient_checkpointing=False, seekforge
recompute="none") and `on` (TRL's gradient_checkpointing=True, its GRPOConfig default; seekforge recompute="full").
Each setting prints its own ratio, and the load average beside every figure (the cores are shared).

    PYTHONPATH=. python benchmarks/grpo_step.py [--preset small] [--threads N] [--dtype auto|bf16|fp32] [--eager]
        [--recompute off,on]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import dtype_arg, machine_header  # benchmarks/machine.py

from seekforge.model.precision import DTYPES

PROMPTS, G, MAX_NEW = 8, 8, 128


def write_byte_tokenizer(out: Path) -> None:
    """tokenizer.json with id = byte value (ByteLevel alphabet, no merges) + <|bos|> <|eos|> <|pad|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in _bytes_to_unicode().items() if c in alphabet}
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.save_pretrained(out)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what ByteLevel pre-tokenization emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def prepare(workdir: Path, preset_name: str) -> None:
    from seekforge.config import preset
    from seekforge.model.hf import save_hf
    from seekforge.model.model import build_model

    cfg = preset(preset_name, vocab_size=320, num_nextn_predict_layers=0, max_position_embeddings=512,
                 bos_token_id=256, eos_token_id=257)
    save_hf(build_model(cfg, seed=0), workdir)
    write_byte_tokenizer(workdir)


def prompts_and_answers():
    """Both iterations' prompts: seekforge's step 0 and step 1 prompts, in order."""
    from seekforge.rl.data import ArithmeticPrompts

    stream = ArithmeticPrompts([1, 2, 3], seed=0, num_eval=0)
    return [(s.prompt, s.meta["answer"]) for s in stream.prompts(0, PROMPTS) + stream.prompts(1, PROMPTS)]


def run_seekforge(workdir: Path, swap: bool, dtype: str, compile: bool, recompute: bool) -> dict:
    from seekforge.model.load import load_model
    from seekforge.rl.config import GRPOConfig
    from seekforge.rl.trainer import GRPOTrainer

    policy, tokenizer = load_model(str(workdir), torch.float32)
    cfg = GRPOConfig(base=str(workdir), task_levels=[1, 2, 3], prompts_per_step=PROMPTS, group_size=G,
                     max_new_tokens=MAX_NEW, temperature=1.0, loss_type="dapo", beta=0.0, lr=1e-6, swap=swap,
                     kv_cache_memory="512MiB", eval_prompts=0, dtype=dtype, compile=compile,
                     recompute="full" if recompute else "none", out_dir=str(workdir / "sf_run"))
    start = time.perf_counter()
    trainer = GRPOTrainer(cfg, policy, tokenizer)
    build = time.perf_counter() - start
    trainer.step()  # warm-up
    start = time.perf_counter()
    metrics = trainer.step()
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "completion_tokens": metrics["response_length"] * PROMPTS * G,
            "rollout_s": metrics["rollout_time_s"], "train_s": metrics["train_time_s"], "build_s": build}


def run_trl(workdir: Path, dtype: str, recompute: bool) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from seekforge.data.corpora import check_answer

    samples = prompts_and_answers()
    dataset = Dataset.from_dict({"prompt": [p for p, _ in samples], "answer": [a for _, a in samples]})

    def exact_answer(prompts, completions, answer, **kwargs):
        return [float(check_answer(c, a)) for c, a in zip(completions, answer, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(workdir)
    model = AutoModelForCausalLM.from_pretrained(workdir, dtype=torch.float32)
    class StepTimer(TrainerCallback):
        def __init__(self):
            self.durations, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.durations.append(time.perf_counter() - self.start)

    timer = StepTimer()
    args = GRPOConfig(output_dir=str(workdir / "trl_run"), per_device_train_batch_size=PROMPTS * G, num_generations=G,
                      max_completion_length=MAX_NEW, max_steps=2, shuffle_dataset=False, learning_rate=1e-6,
                      beta=0.0, loss_type="dapo",
                      epsilon_high=0.28, temperature=1.0, use_cpu=True, bf16=dtype == "bf16", report_to="none",
                      save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                      gradient_checkpointing=recompute)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    lengths = [m.get("completions/mean_length") for m in trainer.state.log_history if "completions/mean_length" in m]
    tokens = (lengths[-1] if lengths else float("nan")) * PROMPTS * G
    return {"seconds": timer.durations[-1], "completion_tokens": tokens}


def child(which: str, workdir: Path, threads: int | None, dtype: str, compile: bool, recompute: bool) -> None:
    if threads:
        torch.set_num_threads(threads)
    if which == "trl":
        result = run_trl(workdir, dtype, recompute)
    else:
        result = run_seekforge(workdir, which == "seekforge", dtype, compile, recompute)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["load"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, default=None)
    dtype_arg(parser)
    parser.add_argument("--eager", action="store_true",
                        help="seekforge's rollouts without compiled decode steps (GRPOConfig.compile, on by default "
                             "here: compiled while the trainer is built, which is not timed)")
    parser.add_argument("--recompute", default="off,on",
                        help="recompute settings to run, each on both sides: off (TRL gradient_checkpointing=False, "
                             "seekforge recompute=none), on (True / full)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, Path(args.workdir), args.threads, args.dtype, not args.eager, args.recompute == "on")
    if args.threads:
        torch.set_num_threads(args.threads)
    from seekforge.config import preset

    width = preset(args.preset).hidden_size
    dtype, _ = machine_header(args.dtype, hidden_size=width)
    name = next(key for key, value in DTYPES.items() if value == dtype)
    # TRL runs in seekforge's dtype, and in fp32 too where that is bf16 (its bf16=True is autocast over
    # everything, which need not be its faster choice): its faster run is the one compared.
    trl_dtypes = sorted({name, "fp32"})
    print(f"preset {args.preset} (no MTP), {PROMPTS} prompts x G={G}, up to {MAX_NEW} new tokens, one optimizer "
          f"step; seekforge in {name}; TRL in {' and in '.join(trl_dtypes)}")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(tmp), args.preset)
        for setting in args.recompute.split(","):
            summary.append(compare(tmp, args, trl_dtypes, setting))
    for line in summary:
        print(line)


def compare(tmp: str, args, trl_dtypes: list[str], setting: str) -> str:
    """Every contender with recompute `setting` (off | on) → the setting's summary line."""
    if setting not in ("off", "on"):
        sys.exit(f"--recompute takes off and on, not {setting!r}")
    print(f"-- recompute {setting}: TRL gradient_checkpointing={setting == 'on'}, seekforge recompute="
          f"{'full' if setting == 'on' else 'none'}")
    results = {}
    runs = [("seekforge", args.dtype), ("seekforge-noswap", args.dtype), *(("trl", d) for d in trl_dtypes)]
    for which, dtype in runs:
        cmd = [sys.executable, __file__, "--child", which, "--workdir", tmp, "--dtype", dtype, "--recompute", setting]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.eager:
            cmd.append("--eager")
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            sys.exit(f"{which} failed:\n{out.stderr[-3000:]}")
        label = f"trl ({dtype})" if which == "trl" else which
        r = results[label] = json.loads(lines[-1].removeprefix("RESULT "))
        extra = (f" (rollout {r['rollout_s']:.1f}s, training {r['train_s']:.1f}s; trainer built in "
                 f"{r['build_s']:.0f}s)") if "rollout_s" in r else ""
        print(f"{label:>17}: {r['seconds']:.1f}s{extra}, {r['completion_tokens']:.0f} completion tokens, "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB, load average {r['load']:.1f}", flush=True)
    sf = results["seekforge"]
    trl_label, trl = min(((k, v) for k, v in results.items() if k.startswith("trl")), key=lambda kv: kv[1]["seconds"])
    return (f"recompute {setting}: speed-up vs TRL GRPOTrainer (its faster run, {trl_label}): "
            f"{trl['seconds'] / sf['seconds']:.2f}x ({sf['seconds']:.1f}s at load {sf['load']:.1f} vs "
            f"{trl['seconds']:.1f}s at load {trl['load']:.1f}); memory swap saves "
            f"{results['seekforge-noswap']['peak_rss_mib'] - sf['peak_rss_mib']:.0f} MiB of peak RSS")


if __name__ == "__main__":
    main()
