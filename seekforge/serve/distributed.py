"""Serving across ranks: one HTTP front end on rank 0, one scheduler per attention-DP replica, all
ranks stepping in lockstep (the SGLang dp-attention design; the weights' layout is parallel/serving.py's).

    torchrun --nproc-per-node 2 -m seekforge serve --model CKPT --tp 2          # attention TP
    torchrun --nproc-per-node 2 -m seekforge serve --model CKPT --dp-attention 2 --ep 2

world = dp_attention · tp ranks; replica d is ranks d·tp … d·tp + tp − 1 and its leader is d·tp. One
step, on every rank (`RankEngine.step`):
  1. rank 0 broadcasts the step's `Commands` over a gloo control group: new requests, each with the
     replica it goes to (the one with the fewest requests in flight), aborts, a prefix-cache reset.
  2. each leader applies its commands to its own LLMEngine (scheduler, block manager, latent cache,
     sampling, detokenization: everything per request stays on its replica) and steps it. Its
     ShardedRunner first broadcasts the step's chunks and head rows to the replica's other TP ranks,
     which run the same forward on their shards (the all-reduces of parallel/serving.py pair up).
     A leader that scheduled nothing runs one dummy token through the model instead (SGLang's idle
     batch), so every rank of an EP group runs each MoE layer's all-to-alls once per step.
  3. the leaders' outputs (cumulative RequestOutputs, as LLMEngine.step returns them) are gathered
     to rank 0, whose `DistributedEngine` presents all of it as one LLMEngine to AsyncEngine and the
     server. Per step that is one small broadcast and one gather on the control group.
Not served across ranks (refused up front): speculative decoding, multi-step scheduling and LoRA,
whose per-step forward counts differ between replicas or whose weights are not sharded.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from seekforge.config import PRESETS, EngineConfig
from seekforge.serve.engine import CompletionOutput, LLMEngine, Request, RequestOutput, drain
from seekforge.serve.runner import num_kv_blocks
from seekforge.serve.sequence import SamplingParams
from seekforge.serve.sharded_runner import ShardedRunner

log = logging.getLogger("seekforge.serve")

# Workers wait on the control group for as long as the server sits idle.
CONTROL_TIMEOUT = datetime.timedelta(days=30)


@dataclass
class Commands:
    """What rank 0 tells every rank before a step."""

    adds: list[tuple[int, str, list[int], SamplingParams, str | None, bool]] = field(default_factory=list)
    # (replica, request id, prompt token ids, params, cache salt, final only)
    aborts: list[tuple[int, str]] = field(default_factory=list)  # (replica, request id)
    reset_prefix_cache: bool = False
    stop: bool = False


class RankEngine:
    """This rank's part of the distributed engine: a replica leader's LLMEngine, or a follower's runner."""

    def __init__(self, model, tokenizer, config: EngineConfig, groups, control_group, layout):
        self.groups, self.control, self.model, self.layout = groups, control_group, model, layout
        if groups.is_leader:
            self.engine = LLMEngine(model, tokenizer, config, make_runner=partial(ShardedRunner, groups=groups))
            self.runner = self.engine.runner
        else:
            self.engine = None
            self.runner = ShardedRunner(model, config, num_kv_blocks(model, config), groups)

    def step(self, commands: Commands | None = None) -> list | None:
        """One lockstep step; `commands` from rank 0 (others pass None). → None once stopped; on rank 0
        per replica (outputs, failed adds, stats), elsewhere []."""
        box = [commands]
        dist.broadcast_object_list(box, src=0, group=self.control)
        commands = box[0]
        if commands.stop:
            return None
        result = self._lead(commands) if self.engine is not None else self.runner.follow()
        gathered = [None] * dist.get_world_size(self.control) if self.groups.rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=self.control)
        return [r for r in gathered if r is not None] if gathered is not None else []

    def _lead(self, commands: Commands):
        engine, me = self.engine, self.groups.dp_rank
        failed = []
        for replica, request_id, prompt_ids, params, cache_salt, final_only in commands.adds:
            if replica == me:
                try:
                    engine.add(engine.make_request(prompt_ids, params, request_id, cache_salt, final_only=final_only))
                except ValueError as e:  # rank 0 validated it with the same config: not expected
                    failed.append((request_id, prompt_ids, str(e)))
        for replica, request_id in commands.aborts:
            if replica == me:
                engine.abort(request_id)
        if commands.reset_prefix_cache:
            engine.reset_prefix_cache()
        self.runner.ran = False
        outputs = engine.step()
        if not self.runner.ran:
            self.runner.idle()
        return outputs, failed, engine.stats()

    def follow_forever(self) -> None:
        """A worker rank: step until rank 0 stops the engine (DistributedEngine.shutdown)."""
        while self.step() is not None:
            pass

    def sync_weights(self, modules):
        """New weights from a model in any layout over the same ranks (the GRPO trainer's FSDP policy, a
        TP model ...), moved in memory by parallel/transfer.py: every rank calls it, outside the serving
        loop (rank 0 between steps, the others after follow_forever returned). No file is written; the
        latents cached under the old weights are dropped. → this rank's SyncStats."""
        from seekforge.parallel.layout import layout_of_model
        from seekforge.parallel.serving import engine_shards
        from seekforge.parallel.transfer import shards_of, sync_shards

        stats = sync_shards(layout_of_model(modules), self.layout, shards_of(modules),
                            engine_shards(self.model, self.layout, self.groups.rank))
        if self.engine is not None:
            self.engine.reset_prefix_cache()
        return stats


class DistributedEngine:
    """Rank 0's face of the distributed engine: LLMEngine's interface for AsyncEngine and the server.
    Metrics gauges (scheduler, block_manager) show replica 0; `stats()` sums over replicas."""

    def __init__(self, rank_engine: RankEngine):
        local = rank_engine.engine
        self.rank_engine = rank_engine
        self.num_replicas = rank_engine.groups.dp_attention
        self.tokenizer, self.model, self.config = local.tokenizer, local.model, local.config
        self.max_model_len, self.capacity = local.max_model_len, local.capacity
        self.scheduler, self.block_manager, self.spec = local.scheduler, local.block_manager, None
        self.owner: dict[str, int] = {}  # request in flight → its replica
        self.pending = Commands()
        self.replica_stats = [local.stats()] * self.num_replicas
        self.num_steps = 0

    @property
    def lora_adapters(self) -> dict:
        return {}

    def load_lora(self, name: str, path: str) -> None:
        raise ValueError("LoRA adapters are not served across ranks; serve them on one process (without --tp, "
                         "--dp-attention or --ep)")

    unload_lora = load_lora

    def make_request(self, *args, **kwargs) -> Request:
        """Validated and tokenized by replica 0's engine (every replica has the same config)."""
        return self.rank_engine.engine.make_request(*args, **kwargs)

    def add(self, request: Request) -> str:
        if request.request_id in self.owner:
            raise ValueError(f"request id {request.request_id!r} is already running; use a unique id")
        load = [0] * self.num_replicas
        for replica in self.owner.values():
            load[replica] += 1
        replica = min(range(self.num_replicas), key=load.__getitem__)  # least loaded, lowest first
        seq = request.seqs[0]
        self.pending.adds.append((replica, request.request_id, request.prompt_token_ids, seq.params, seq.cache_salt,
                                  request.final_only))
        self.owner[request.request_id] = replica
        return request.request_id

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        return self.add(self.make_request(prompt, params, request_id, cache_salt))

    def abort(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            self.pending.aborts.append((replica, request_id))

    def has_unfinished(self) -> bool:
        return bool(self.owner or self.pending.aborts or self.pending.reset_prefix_cache)

    def reset_prefix_cache(self) -> None:
        self.pending.reset_prefix_cache = True

    def step(self) -> list[RequestOutput]:
        commands, self.pending = self.pending, Commands()
        outputs = []
        for replica, (outs, failed, stats) in enumerate(self.rank_engine.step(commands)):
            self.replica_stats[replica] = stats
            for request_id, prompt_ids, message in failed:
                log.error("replica %d refused request %s: %s", replica, request_id, message)
                outs.append(RequestOutput(request_id, prompt_ids, [CompletionOutput(0, "", [], "abort", None)],
                                          True, 0))
            for out in outs:
                if out.request_id not in self.owner:
                    continue  # aborted here after the replica produced it
                if out.finished:
                    del self.owner[out.request_id]
                outputs.append(out)
        self.num_steps += 1
        return outputs

    def generate(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        """Offline: every prompt (text or token ids) to completion, outputs in prompt order."""
        requests = [self.make_request(p, sp, final_only=True) for p, sp in zip(prompts, params, strict=True)]
        return self.drain([self.add(r) for r in requests])

    def drain(self, ids: list[str]) -> list[RequestOutput]:
        """Step until the requests `ids` finish → their final outputs, in that order."""
        return drain(self, ids)

    def stats(self) -> dict:
        total = {}
        for stats in self.replica_stats:
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        for key in ("kv_cache_usage", "prefix_cache_hit_rate"):  # ratios: the mean over replicas
            total[key] /= self.num_replicas
        total["num_replicas"] = self.num_replicas
        return total

    def shutdown(self) -> None:
        """End the workers' serving loop: follow_forever returns on every other rank (to exit, or to
        run something collective such as RankEngine.sync_weights and then follow again)."""
        self.rank_engine.step(Commands(stop=True))


# ---------------------------------------------------------------------------------- start
def check_engine_config(config: EngineConfig) -> None:
    for flag, on in (("--speculative-tokens", config.speculative_tokens), ("--num-scheduler-steps",
                     config.num_scheduler_steps > 1), ("--enable-lora/--lora-modules", config.enable_lora)):
        if on:
            raise ValueError(f"{flag} is not served across ranks (replicas would run different numbers of "
                             f"forward passes per step); drop {flag}, or serve on one process")


def build(name_or_path: str, tp: int, dp_attention: int, ep: int, dtype: torch.dtype,
          config: EngineConfig) -> RankEngine:
    """Join the torchrun job (or the process group already up) and build this rank's part of the
    engine: its shards of the weights (read from the checkpoint's slices, or a preset's random weights)
    and its scheduler or runner. Bad layouts fail before anything is built."""
    from seekforge.model.load import checkpoint_config, checkpoint_tokenizer
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.parallel.mesh import init_distributed
    from seekforge.parallel.serving import (
        build_engine_model,
        check_engine_layout,
        engine_groups,
        engine_shards,
        fill_from_state_dict,
    )

    cfg = checkpoint_config(name_or_path)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_engine_layout(cfg, tp, dp_attention, ep, world)
    check_engine_config(config)
    path = Path(name_or_path)
    if name_or_path not in PRESETS:
        from seekforge.quant.checkpoint import is_compressed

        if is_compressed(path):
            raise ValueError(f"{path} is a quantized checkpoint; those are served on one process only")
    init_distributed()
    groups = engine_groups(tp, dp_attention, ep)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    model, layout = build_engine_model(cfg, groups, dtype)
    shards = engine_shards(model, layout, groups.rank)
    if name_or_path in PRESETS:  # random weights: the single-device build's, sliced
        from seekforge.model.model import build_model

        fill_from_state_dict(shards, build_model(cfg, seed=0).state_dict())
        tokenizer = load_tokenizer("byte")
    else:
        from seekforge.parallel.disk import read_hf_shards

        read = read_hf_shards(path, shards)
        log.info("rank %d read %.1f MiB of its shards from %s", groups.rank, read / 2**20, path)
        tokenizer = checkpoint_tokenizer(path, cfg)
    return RankEngine(model, tokenizer, config, groups, control, layout)


def start(name_or_path: str, tp: int, dp_attention: int, ep: int, dtype: torch.dtype,
          config: EngineConfig) -> DistributedEngine | None:
    """`build`, then rank 0 gets the DistributedEngine to serve from; every other rank serves here
    until rank 0 calls shutdown, then gets None."""
    rank_engine = build(name_or_path, tp, dp_attention, ep, dtype, config)
    if rank_engine.groups.rank == 0:
        return DistributedEngine(rank_engine)
    with _stopped_by_rank0():
        rank_engine.follow_forever()
    log.info("rank %d: stopped by rank 0", rank_engine.groups.rank)
    return None


@contextlib.contextmanager
def _stopped_by_rank0():
    """A worker ignores SIGTERM and SIGINT while it follows: torchrun forwards a SIGTERM (and a terminal
    its Ctrl-C) to every rank, and rank 0 answers it by draining its requests, which needs every rank's
    steps, then stops the workers (DistributedEngine.shutdown). A worker that died at the signal would
    crash rank 0's next broadcast instead. (torchrun SIGKILLs what is left after its --shutdown-timeout.)"""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
