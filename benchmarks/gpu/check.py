"""benchmarks/gpu/run.py --check: every fast path of the GPU path equals its reference, in under 3 minutes on one
GPU. Each line says PASS or FAIL, what was compared and the largest difference; the exit status is 1 if any
failed. On the CPU (--dry-run --check) the GPU path is forced onto CPU tensors with Triton interpreted: tiny
shapes, the same comparisons.

  kernels   mla_decode, fused_moe, fused linear + cross-entropy vs their torch references, fp32 and bf16
  engine    the engine vs transformers greedy in fp32, with CUDA graphs and without; speculative vs plain
  train     a train step's loss and gradients on the GPU path vs the CPU path's (fp32), and no host sync in it
"""

from __future__ import annotations

import contextlib
import time

import torch
from common import DRY_MODEL
from serve_throughput import hf_generate, hf_peer

from seekforge.config import ModelConfig
from seekforge.model.gpu import forced_gpu_path
from seekforge.model.gpu.cross_entropy import fused_linear_cross_entropy
from seekforge.model.gpu.fused_moe import fused_moe, fused_moe_reference
from seekforge.model.gpu.mla_decode import mla_decode, mla_decode_reference
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.model.loss import cross_entropy, lm_loss
from seekforge.model.model import build_model
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams

# The serving checks' model on a GPU: the suite model's attention and expert shapes (kv_lora 512 + rope 64,
# 16 experts top-4 of width 704) in 4 layers, small enough for fp32 transformers to decode in seconds.
CHECK_MODEL = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                   num_hidden_layers=4, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16,
                   n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                   num_nextn_predict_layers=1, max_position_embeddings=4096)
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}  # max |a - b| / max |b|


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_mla_decode(device, dry: bool) -> tuple[bool, str]:
    b, nh, r, dr, size, blocks = (3, 4, 32, 8, 4, 9) if dry else (8, 16, 512, 64, 16, 600)
    lens = torch.tensor([1, size, 2 * size + 1] if dry else [1, 15, 16, 17, 300, 1000, 4095, 4096], device=device)
    errors = []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(0)
        c_kv, k_pe = (torch.randn(blocks, size, d, generator=gen, device=device).to(dtype) for d in (r, dr))
        width = -(-int(lens.max()) // size)
        tables = torch.randperm(blocks, generator=gen, device=device)[:b * width].view(b, width) if dry else \
            torch.randint(0, blocks, (b, width), generator=gen, device=device)
        q, q_rope = (torch.randn(b, nh, d, generator=gen, device=device).to(dtype) for d in (r, dr))
        args = (q, q_rope, c_kv, k_pe, tables, lens, (r + dr) ** -0.5)
        errors.append(relative_error(mla_decode(*args), mla_decode_reference(*args)))
    return _verdict(errors, f"rows {b}, heads {nh}, latent {r}+{dr}, context lengths {lens.tolist()}")


def check_fused_moe(device, dry: bool) -> tuple[bool, str]:
    e, k, h, i = (8, 2, 64, 32) if dry else (16, 4, 2048, 704)
    errors = []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(0)
        gate_up = (torch.randn(e, 2 * i, h, generator=gen, device=device) * h ** -0.5).to(dtype)
        down = (torch.randn(e, h, i, generator=gen, device=device) * i ** -0.5).to(dtype)
        worst = 0.0
        for n in (1, 5, 37) if dry else (1, 8, 128, 256):
            x = torch.randn(n, h, generator=gen, device=device).to(dtype)
            scores = torch.rand(n, e, generator=gen, device=device)
            weights, indices = scores.topk(k, dim=-1)
            worst = max(worst, relative_error(fused_moe(x, gate_up, down, weights, indices),
                                              fused_moe_reference(x, gate_up, down, weights, indices)))
        errors.append(worst)
    return _verdict(errors, f"{e} experts top-{k}, hidden {h}, expert width {i}")


def check_cross_entropy(device, dry: bool) -> tuple[bool, str]:
    n, h, v = (70, 32, 300) if dry else (4096, 2048, 32768)
    errors = []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(n, h, generator=gen, device=device).to(dtype).requires_grad_()
        weight = (torch.randn(v, h, generator=gen, device=device) * h ** -0.5).to(dtype).requires_grad_()
        labels = torch.randint(0, v, (n,), generator=gen, device=device)
        labels[::7] = -100
        results = []
        for fused in (True, False):
            if fused:
                loss = fused_linear_cross_entropy(hidden, weight, labels)
            else:
                loss = cross_entropy(hidden @ weight.t(), labels)
            results.append((loss, *torch.autograd.grad(loss, (hidden, weight))))
        errors.append(max(relative_error(a, b) for a, b in zip(*results, strict=True)))
    return _verdict(errors, f"{n} rows, hidden {h}, vocab {v}: loss and both gradients")


def _verdict(errors: list[float], what: str) -> tuple[bool, str]:
    ok = errors[0] <= TOLERANCE[torch.float32] and errors[1] <= TOLERANCE[torch.bfloat16]
    return ok, f"{what}; largest relative difference fp32 {errors[0]:.1e}, bf16 {errors[1]:.1e}"


def check_engine(device, dry: bool) -> tuple[bool, str]:
    """Greedy in fp32: engine with graphs = transformers; graphs = eager; speculative = plain."""
    cfg = ModelConfig(**(DRY_MODEL if dry else CHECK_MODEL))
    source = build_model(cfg, seed=0).eval()
    hf = hf_peer(source).to(device)
    model = source.to(device)
    model.init_buffers()
    n, prompt, new = (4, 12, 8) if dry else (16, 64, 64)
    prompts = torch.randint(0, cfg.vocab_size, (n, prompt), generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    # on the CPU every capture size runs the interpreted kernels at start: a few small ones
    memory = {"kv_cache_memory": "16MiB", "max_cuda_graph_batch": 4, "max_model_len": 64} if dry else \
        {"kv_cache_memory": "2GiB"}
    outputs = {}
    for name, kwargs in (("graphs", {}), ("eager", {"cuda_graphs": False}), ("speculative", {"speculative_tokens": 1})):
        llm = LLM(model, **memory, **kwargs)
        # prompts of different lengths: the batch shrinks and grows across capture sizes
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(
            [p[:prompt - j % 3] for j, p in enumerate(prompts.tolist())], greedy)]
    reference = [hf_generate(hf, prompts[j:j + 1, :prompt - j % 3].to(device), new)[0].tolist() for j in range(n)]
    same = {name: sum(a == b for a, b in zip(out, reference, strict=True)) for name, out in outputs.items()}
    return all(v == n for v in same.values()), (f"{n} prompts × {new} new tokens, greedy identical to transformers: "
                                                 + ", ".join(f"{k} {v}/{n}" for k, v in same.items()))


def check_train(device, dry: bool) -> tuple[bool, str]:
    """One forward + backward of lm_loss on the GPU path (on `device`) vs the CPU path's, fp32, same weights."""
    cfg = ModelConfig(**(DRY_MODEL if dry else CHECK_MODEL))
    tokens = torch.randint(0, cfg.vocab_size, (2, 65 if dry else 513), generator=torch.Generator().manual_seed(0))
    results = []
    gpu_path = forced_gpu_path if device.type == "cpu" else contextlib.nullcontext
    for dev, path in ((torch.device("cpu"), contextlib.nullcontext), (device, gpu_path)):
        model = build_model(cfg, device=dev, seed=0).train()
        with path():
            loss, _ = lm_loss(model, tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
            loss.backward()
        norms = torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])
        results.append((loss.detach().cpu(), norms.cpu()))
    loss_error = relative_error(results[1][0], results[0][0])
    grad_error = relative_error(results[1][1], results[0][1])
    ok = loss_error <= 1e-4 and grad_error <= 1e-3
    return ok, f"loss relative difference {loss_error:.1e}, per-parameter gradient norms {grad_error:.1e}"


def check_train_syncs(device, dry: bool) -> tuple[bool, str]:
    """Trainer.train_step (forward, backward, clip, AdamW, the bias update) on the GPU path with no host sync."""
    from train_step import RepeatLoader

    from seekforge.config import TrainConfig
    from seekforge.train.trainer import Trainer

    shape = DRY_MODEL if dry else CHECK_MODEL
    cfg = TrainConfig(preset="small", model=shape, seq_len=64, micro_batch_size=2, dtype="fp32" if dry else "bf16",
                      steps=10, peak_flops=1.0, eval_interval=0, log_interval=0)
    tokens = torch.randint(0, shape["vocab_size"], (2, 65), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(cfg, build_model(ModelConfig(**shape), device=device, seed=0),
                      RepeatLoader({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}), out_dir="/tmp/unused")
    trainer.train_step()  # AdamW's states, the kernels' first launches
    with HostSyncGuard(strict=False) as guard:
        trainer.train_step()
    return guard.syncs == 0, guard.summary(top=4)


# (name, check, whether it runs on the GPU path as a whole: check_train runs the CPU path's reference itself)
CHECKS = (("mla_decode kernel", check_mla_decode, True), ("fused_moe kernel", check_fused_moe, True),
          ("fused linear cross-entropy", check_cross_entropy, True), ("engine greedy (fp32)", check_engine, True),
          ("train step GPU path = CPU path (fp32)", check_train, False),
          ("train step without host syncs", check_train_syncs, True))


def run_checks(device: torch.device, dry_run: bool) -> bool:
    """Run every check (forcing the GPU path on a CPU), print a line each; True when all passed."""
    passed, start = True, time.perf_counter()
    for name, check, whole in CHECKS:
        try:
            with forced_gpu_path() if whole and device.type == "cpu" else contextlib.nullcontext():
                ok, detail = check(device, dry_run)
        except Exception as e:  # a crash is a failed check: say which and go on to the next
            ok, detail = False, f"{type(e).__name__}: {e}"
        passed &= ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}  [{time.perf_counter() - start:.0f} s]", flush=True)
    print("all checks passed" if passed else "SOME CHECKS FAILED")
    return passed
