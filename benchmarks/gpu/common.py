"""What the GPU suite's rows and checks share: the shapes, a timer, and the per-step cost of a call (kernel
launches, host syncs, GPU busy fraction)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from seekforge.model.gpu.sync import HostSyncGuard

# DeepSeek-V3's shapes scaled to ~1.1B parameters (1.0B without MTP, 0.54B active per token): V3's MLA
# head (q_lora, kv_lora 512, nope 128 + rope 64, v 128), sigmoid group-limited routing, one dense layer.
GPU_MODEL = dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=704,
                 num_hidden_layers=12, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16,
                 n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                 num_nextn_predict_layers=1, max_position_embeddings=4096)
# The same structure in miniature (every feature on), for the CPU dry run.
DRY_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                 n_group=2, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=1,
                 max_position_embeddings=512)


@dataclass
class Shapes:
    model: dict
    batch: int  # training micro-batch
    seq: int
    steps: int  # timed training steps (median reported)
    requests: int
    prompt: int
    new: int
    prefix: int  # shared-prefix workload: common prefix, unique suffix, new tokens
    suffix: int
    prefix_new: int
    engine: dict  # EngineConfig keywords of every engine built


GPU = Shapes(GPU_MODEL, batch=8, seq=2048, steps=10, requests=128, prompt=256, new=256, prefix=2048, suffix=64,
             prefix_new=16, engine={"kv_cache_memory": "16GiB"})
# the dry run takes the GPU path on the CPU, where each CUDA-graph size runs the interpreted kernels at start
DRY = Shapes(DRY_MODEL, batch=2, seq=32, steps=2, requests=4, prompt=16, new=8, prefix=32, suffix=4, prefix_new=4,
             engine={"kv_cache_memory": "16MiB", "max_cuda_graph_batch": 4, "max_model_len": 64})



# CUDA runtime/driver calls that start work on the GPU: a kernel each, or a whole captured graph
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}


class Timer:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, fn):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start


@dataclass
class StepCost:
    """Per step of a call: `launches` (CUDA launch calls; on a CPU the aten ops dispatched), host `syncs`, and
    `busy`, the GPU's kernel time over the unprofiled wall time of a step (None on a CPU)."""

    launches: float
    syncs: float
    busy: float | None
    cpu: bool

    def cells(self) -> tuple[str, str, str]:
        launches = f"{self.launches:,.0f}" + (" ops" if self.cpu else "")
        busy = "n/a (CPU)" if self.busy is None else f"{100 * self.busy:.0f}%"
        return launches, f"{self.syncs:,.1f}", busy


def step_cost(fn, steps: int, seconds_per_step: float, device: torch.device) -> StepCost:
    """Run fn (which runs `steps` steps) once under HostSyncGuard (syncs, and on a CPU the ops) and, on a GPU,
    once under the profiler (launch calls and kernel time)."""
    with HostSyncGuard(strict=False) as guard:
        fn()
    if device.type != "cuda":
        return StepCost(guard.ops / steps, guard.syncs / steps, None, cpu=True)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    launches = sum(e.name in LAUNCH_CALLS for e in events)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    busy_us, end = 0.0, float("-inf")  # the union of the kernels' intervals (streams may overlap)
    for start, stop in kernels:
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return StepCost(launches / steps, guard.syncs / steps, busy_us / 1e6 / steps / seconds_per_step, cpu=False)
