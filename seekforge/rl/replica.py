"""The weights the co-located engine generates with, kept equal to the policy's after every update, in
memory (no file).

The engine runs on the policy module itself when it can: same tensors, nothing to copy. It needs a
replica of its own when the compute dtype differs from the policy's (bf16 generation over an fp32
policy: the replica's tensors are also the bf16 training copies, train/master.py) or when the policy is
FSDP-sharded (each rank's engine needs every weight whole). `refresh` copies the policy into the replica
in place; from FSDP shards it goes through the resharding planner (parallel/transfer.py).
"""

from __future__ import annotations

import copy

import torch

from seekforge.model.dtensor import plain_tensor


class EngineWeights:
    def __init__(self, policy, compute_dtype: torch.dtype, sharded: bool):
        """Call before the policy is sharded: the replica is a full copy of it."""
        self.policy, self.sharded = policy, sharded
        self.model = policy
        if sharded or compute_dtype != policy.embed_tokens.weight.dtype:
            self.model = copy.deepcopy(policy).requires_grad_(False).cast(compute_dtype)
        self._plan = None  # (transfers, source dtypes) from the FSDP policy to the replica

    def refresh(self) -> None:
        """The replica takes the policy's current weights (shared tensors already have them): an FSDP
        policy's shards gathered, cast to the replica's dtype."""
        if self.sharded:
            self._sync_from_shards()
        elif self.model is not self.policy:
            with torch.no_grad():
                replica = dict(self.model.named_parameters())
                for name, param in self.policy.named_parameters():
                    replica[name].copy_(plain_tensor(param))

    def _sync_from_shards(self) -> None:
        """FSDP shards → every rank's full replica in the engine's dtype, by the resharding planner and
        its point-to-point executor (parallel/transfer.py): each rank receives only the boxes it lacks,
        in batched rounds, instead of an all-gather per parameter. The layouts never change, so the
        plan is made once."""
        from seekforge.parallel.layout import layout_of_model
        from seekforge.parallel.reshard import plan_reshard
        from seekforge.parallel.transfer import execute, shards_of

        if self._plan is None:
            src, dst = layout_of_model(self.policy), layout_of_model(self.model)
            self._plan = plan_reshard(src, dst), {name: t.dtype for name, t in src.tensors.items()}
        plan, dtypes = self._plan
        execute(plan, dtypes, shards_of(self.policy), shards_of(self.model))
