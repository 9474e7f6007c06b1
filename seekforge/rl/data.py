"""GRPO's prompt source."""

from __future__ import annotations

import random

from seekforge.data.corpora import ArithmeticTask


class PromptStream:
    """The built-in task's prompts. Step s's prompts come from a generator seeded by (seed, s), so
    they depend only on the step; held-out prompts come from another seed and are never trained on.
    `position` (the next step) is the data position a checkpoint stores."""

    def __init__(self, levels: list[int], seed: int, num_eval: int):
        self.task, self.seed, self.position = ArithmeticTask(seed, tuple(levels)), seed, 0
        eval_rng = random.Random(f"eval-{seed}")
        self.eval_set = [self.task.sample(eval_rng) for _ in range(num_eval)]
        self._held_out = {prompt for prompt, _ in self.eval_set}

    def prompts(self, step: int, count: int) -> list[tuple[str, str]]:
        rng, out = random.Random(f"train-{self.seed}-{step}"), []
        while len(out) < count:
            prompt, answer = self.task.sample(rng)
            if prompt not in self._held_out:
                out.append((prompt, answer))
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
