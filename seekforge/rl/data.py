"""GRPO's prompt datasets: the prompts a run trains on, with the columns its rewards grade them by.

GRPOConfig.data names one:
  builtin:arithmetic  the built-in task's questions (data/corpora.ArithmeticTask, GRPOConfig.task_levels),
                      graded by their exact answer
  PATH.jsonl          one JSON object per line, {"prompt": "...", "answer": "...", ...}: every column but
                      `prompt` reaches the reward functions as keyword arguments (as TRL hands a dataset's
                      columns to its reward functions); held-out prompts are graded by the run's first reward
Each is a PromptDataset: `prompts(step, count)` is a pure function of the seed and the step, so a run resumed
at step s draws exactly what the uninterrupted run drew; `eval_set` holds prompts never trained on, which
`grade` scores; `state_dict` / `load_state_dict` carry the position (and what identifies the data) through
a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from seekforge.data.corpora import ArithmeticTask
from seekforge.errors import UserError
from seekforge.rl.rewards import RewardFn, arithmetic_reward, resolve_reward

BUILTIN = "builtin:arithmetic"


class Sample(NamedTuple):
    prompt: str
    meta: dict[str, Any]  # the other columns: keyword arguments of the reward functions


class PromptDataset(Protocol):
    eval_set: list[Sample]
    position: int  # the next step: the data position a checkpoint stores

    def prompts(self, step: int, count: int) -> list[Sample]: ...

    def grade(self, sample: Sample, completion: str) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def check_data_spec(spec: str) -> None:
    """A `data` value that cannot load fails here, before any model is built."""
    if spec == BUILTIN:
        return
    if spec.startswith("builtin:"):
        raise ValueError(f"data={spec!r}: the built-in prompt dataset is {BUILTIN!r}")
    if Path(spec).suffix != ".jsonl":
        raise ValueError(f"data={spec!r}: give {BUILTIN!r} or a .jsonl file of {{\"prompt\": ...}} lines")
    if not Path(spec).is_file():
        raise ValueError(f"data={spec!r}: no such file")


def prompt_dataset(spec: str, seed: int, num_eval: int, task_levels: list[int], rewards: list[str]) -> PromptDataset:
    """GRPOConfig.data → its dataset (arguments: the config's fields of the same names; eval_prompts → num_eval)."""
    check_data_spec(spec)
    if spec == BUILTIN:
        return ArithmeticPrompts(task_levels, seed, num_eval)
    return JsonlPrompts(spec, seed, num_eval, resolve_reward(rewards[0]))


class ArithmeticPrompts:
    """The built-in task. Step s's prompts come from a generator seeded by (seed, s); held-out prompts
    come from another seed and are never trained on."""

    def __init__(self, levels: list[int], seed: int, num_eval: int):
        self.task, self.seed, self.position = ArithmeticTask(seed, tuple(levels)), seed, 0
        eval_rng = random.Random(f"eval-{seed}")
        self.eval_set = [self._sample(*self.task.sample(eval_rng)) for _ in range(num_eval)]
        self._held_out = {sample.prompt for sample in self.eval_set}

    @staticmethod
    def _sample(prompt: str, answer: str) -> Sample:
        return Sample(prompt, {"answer": answer})

    def prompts(self, step: int, count: int) -> list[Sample]:
        rng, out = random.Random(f"train-{self.seed}-{step}"), []
        while len(out) < count:
            prompt, answer = self.task.sample(rng)
            if prompt not in self._held_out:
                out.append(self._sample(prompt, answer))
        return out

    def grade(self, sample: Sample, completion: str) -> float:
        return arithmetic_reward(sample.prompt, completion, **sample.meta)

    def state_dict(self) -> dict:
        return {"position": self.position, "data": BUILTIN}

    def load_state_dict(self, state: dict) -> None:
        if state.get("data", BUILTIN) != BUILTIN:  # checkpoints from before the key existed trained on BUILTIN
            raise _other_data(state["data"], BUILTIN)
        self.position = int(state["position"])


class JsonlPrompts:
    """A JSONL file of prompts. The held-out set is `num_eval` lines drawn by the seed; the other lines are
    trained on in epochs, each in its own seeded order: step s takes positions [s·count, (s+1)·count) of
    that endless sequence."""

    def __init__(self, path: str | Path, seed: int, num_eval: int, grade_reward: RewardFn):
        self.path, self.seed, self.position, self._grade = Path(path), seed, 0, grade_reward
        text = self.path.read_bytes()
        self.fingerprint = hashlib.sha256(text).hexdigest()
        try:
            lines = text.decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
                             ) from None
        rows = [_row(self.path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
        if num_eval >= len(rows):
            raise ValueError(f"{self.path} has {len(rows)} prompts and eval_prompts={num_eval} would hold out all "
                             f"of them; set eval_prompts below {len(rows)} (0: no held-out evaluation)")
        order = list(range(len(rows)))
        random.Random(f"split-{seed}").shuffle(order)
        self.eval_set = [rows[i] for i in order[:num_eval]]
        self._train = [rows[i] for i in sorted(order[num_eval:])]
        self._epoch, self._order = -1, []

    def prompts(self, step: int, count: int) -> list[Sample]:
        out = []
        for k in range(step * count, (step + 1) * count):
            epoch, i = divmod(k, len(self._train))
            if epoch != self._epoch:
                self._epoch, self._order = epoch, list(range(len(self._train)))
                random.Random(f"train-{self.seed}-{epoch}").shuffle(self._order)
            out.append(self._train[self._order[i]])
        return out

    def grade(self, sample: Sample, completion: str) -> float:
        return float(self._grade(sample.prompt, completion, **sample.meta))

    def state_dict(self) -> dict:
        return {"position": self.position, "num_prompts": len(self._train) + len(self.eval_set),
                "sha256": self.fingerprint, "data": str(self.path)}

    def load_state_dict(self, state: dict) -> None:
        if "sha256" not in state:  # a run on the built-in task
            raise _other_data(state.get("data", BUILTIN), str(self.path))
        if state["sha256"] != self.fingerprint:
            raise ValueError(f"the checkpoint's run trained on another version of {self.path} ({state['num_prompts']} "
                             f"prompts, sha256 {state['sha256'][:12]}…; now {len(self._train) + len(self.eval_set)}, "
                             f"{self.fingerprint[:12]}…); restore that file, or start over with --no-resume")
        self.position = int(state["position"])


def _other_data(saved: str, asked: str) -> UserError:
    return UserError(f"the checkpoint's run trained on {saved}, and this one asks for {asked}: a resumed run keeps "
                     "its data; give this run its own --out-dir, or start over with --no-resume")


def _row(path: Path, number: int, line: str) -> Sample:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        row = None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f'{path}:{number} is not a JSON object with a "prompt" string; write one object per '
                         'line, such as {"prompt": "...", "answer": "..."}')
    return Sample(row.pop("prompt"), row)
