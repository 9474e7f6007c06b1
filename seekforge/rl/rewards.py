"""Rewards: plain functions `(prompt, completion, **meta) -> float`, combined with weights.

A reward is named by a built-in name (`arithmetic`, `format`, `boxed`) or as `module:function` for
the user's own. `meta` carries the task's fields for the sample (the built-in task passes `answer`);
a reward takes what it needs and ignores the rest through **meta.

A user's reward bug must not end a run that has trained for hours: a reward that raises scores that
sample 0, the first occurrence of each distinct error is logged as a warning, and the count of
failures is reported in the step's metrics (`reward_errors`).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from seekforge.data.corpora import check_answer

log = logging.getLogger("seekforge.rl")

RewardFn = Callable[..., float]


def arithmetic_reward(prompt: str, completion: str, answer: str, **meta) -> float:
    """1 when the completion's final number equals the task's answer (data/corpora.check_answer)."""
    return float(check_answer(completion, answer))


# The built-in task's answer shapes: a bare number ("A: 85") or worked steps ending in "The answer is
# 85." — and nothing after it (a model that runs on into a new question is not answering).
_WELL_FORMED = re.compile(r"\s*(?:-?\d+|[^\n]*?The answer is -?\d+\.)\s*")


def format_reward(prompt: str, completion: str, **meta) -> float:
    """1 when the whole completion is one answer in the task's format (see _WELL_FORMED), else 0."""
    return float(_WELL_FORMED.fullmatch(completion) is not None)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text`, braces balanced (\\boxed{\\frac{1}{2}} → \\frac{1}{2})."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # unbalanced: no answer


def _normalize_math(answer: str) -> str:
    text = answer.strip().strip("$").replace(" ", "").replace("\\!", "").replace("\\left", "").replace("\\right", "")
    text = re.sub(r"\\(?:d|t)frac", r"\\frac", text)
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    return text.rstrip(".")


def boxed_reward(prompt: str, completion: str, answer: str, **meta) -> float:
    """1 when the last \\boxed{} answer equals `answer`: numerically when both are numbers (1,000 = 1000.0),
    else as LaTeX text after whitespace / \\dfrac / \\text / $ normalization."""
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    got, want = _normalize_math(boxed), _normalize_math(answer)
    try:
        return float(float(got.replace(",", "")) == float(want.replace(",", "")))
    except ValueError:
        return float(got == want)


BUILTIN_REWARDS: dict[str, RewardFn] = {"arithmetic": arithmetic_reward, "format": format_reward,
                                        "boxed": boxed_reward}


def resolve_reward(spec: str) -> RewardFn:
    """A built-in name or "package.module:function" → the function. ValueError names the fix."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; use a built-in ({', '.join(BUILTIN_REWARDS)}) or "
                         "'module:function' for your own")
    module_name, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {spec!r} does not load ({e}); check that the module imports and "
                         f"defines {name}") from e
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not a function")
    return fn


@dataclass
class RewardSet:
    """Σ weight · reward over several rewards, failure-tolerant. `scores` also returns each reward's
    own mean for the metrics."""

    names: list[str]
    weights: list[float]
    functions: list[RewardFn] = field(init=False)
    num_errors: int = field(default=0, init=False)  # since construction; per call in `scores`' metrics
    _seen_errors: set[str] = field(default_factory=set, init=False)

    def __post_init__(self):
        if len(self.weights) != len(self.names):
            raise ValueError(f"{len(self.names)} rewards but {len(self.weights)} weights; give one weight per reward")
        self.functions = [resolve_reward(n) for n in self.names]

    def _call(self, name: str, fn: RewardFn, prompt: str, completion: str, meta: dict) -> tuple[float, bool]:
        try:
            return float(fn(prompt, completion, **meta)), False
        except Exception as e:  # the user's code: any error scores 0 and the run goes on
            key = f"{name}: {type(e).__name__}: {e}"
            if key not in self._seen_errors:
                self._seen_errors.add(key)
                log.warning("reward %s raised %s (the sample scores 0; further identical errors are only "
                            "counted)", name, key.split(": ", 1)[1])
            return 0.0, True

    def scores(self, prompts: list[str], completions: list[str], metas: list[dict]) -> tuple[list[float], dict]:
        """→ (combined reward per sample, metrics {"reward/<name>": mean, "reward_errors": count})."""
        totals = [0.0] * len(completions)
        metrics: dict[str, float] = {}
        errors = 0
        for name, weight, fn in zip(self.names, self.weights, self.functions, strict=True):
            values = []
            for i, (prompt, completion, meta) in enumerate(zip(prompts, completions, metas, strict=True)):
                value, failed = self._call(name, fn, prompt, completion, meta)
                errors += failed
                values.append(value)
                totals[i] += weight * value
            metrics[f"reward/{name}"] = sum(values) / max(len(values), 1)
        self.num_errors += errors
        metrics["reward_errors"] = errors
        return totals, metrics
