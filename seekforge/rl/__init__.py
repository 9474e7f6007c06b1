"""GRPO post-training: pure loss/advantage math (algorithm), rewards, packing, balancing across
data-parallel ranks, co-located rollouts on serve's engine, the trainer, and the `grpo` verb."""
