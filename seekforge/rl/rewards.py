"""Rewards: functions that score a step's completions, combined with weights.

A reward is named by a built-in name (`arithmetic`, `format`, `boxed`, `length`) or as `module:function`
(a module importable from the current directory or sys.path) or `path/to/file.py:function`. Two
signatures, told apart by the names of the first two parameters:

  per sample  fn(prompt, completion, **columns) -> float | None
  batched     fn(prompts, completions, **columns) -> list[float | None]     (TRL's reward signature)

The dataset's other columns arrive as keywords: one value each for a per-sample reward, a list (one per
completion) for a batched one, as TRL hands them. A reward that names a `completion_ids` parameter also
gets the completions' token ids, one that names `max_new_tokens` the run's completion budget. A prompt is
what the dataset holds: text, or for a chat dataset its list of {"role", "content"} messages, in which case
the completion is TRL's `[{"role": "assistant", "content": text}]`. Either signature may be `async def`
(a remote grader, an LLM judge): async rewards run concurrently with each other, an async per-sample
reward concurrently over the samples.

None (not applicable to this sample, as in TRL) leaves that reward out of the sample's weighted sum (a
NaN-ignoring sum; a sample no reward applies to scores 0) and out of that reward's mean and std.

A reward that raises, returns the wrong number of values or something not a number fails the step:
RewardSet(on_error="raise", GRPOConfig.reward_errors' default) raises RewardError naming the reward and the
batch, and the trainer saves the run's state at its last completed step before it stops, so a fixed
reward resumes the run. on_error="zero": the failed samples score 0, the first occurrence of each distinct
error is logged, and the count reaches the step's metrics (`reward_errors`).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seekforge.data.corpora import check_answer
from seekforge.errors import UserError

log = logging.getLogger("seekforge.rl")

RewardFn = Callable[..., Any]
ON_ERROR = ("raise", "zero")
EXTRAS = ("completion_ids", "max_new_tokens")  # given only to a reward that names them as parameters


class RewardError(UserError):
    """A reward function failed; `reward` is its spec as the run names it."""

    def __init__(self, reward: str, message: str):
        self.reward = reward
        super().__init__(message)


def completion_text(completion) -> str:
    """A completion as text, from either form a reward receives (text, or TRL's chat messages)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


# ------------------------------------------------------------------ the built-ins: examples of both signatures
def arithmetic_reward(prompt, completion, answer: str, **columns) -> float:
    """Exact answer: 1 when the completion's final number equals the task's answer (data/corpora.check_answer)."""
    return float(check_answer(completion_text(completion), answer))


# The built-in task's answer shapes: a bare number ("A: 85") or worked steps ending in "The answer is
# 85." — and nothing after it (a model that runs on into a new question is not answering).
_WELL_FORMED = re.compile(r"\s*(?:-?\d+|[^\n]*?The answer is -?\d+\.)\s*")


def format_reward(prompt, completion, **columns) -> float:
    """1 when the whole completion is one answer in the task's format (see _WELL_FORMED), else 0."""
    return float(_WELL_FORMED.fullmatch(completion_text(completion)) is not None)


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


def boxed_reward(prompt, completion, answer: str, **columns) -> float:
    """1 when the last \\boxed{} answer equals `answer`: numerically when both are numbers (1,000 = 1000.0),
    else as LaTeX text after whitespace / \\dfrac / \\text / $ normalization."""
    boxed = last_boxed(completion_text(completion))
    if boxed is None:
        return 0.0
    got, want = _normalize_math(boxed), _normalize_math(answer)
    try:
        return float(float(got.replace(",", "")) == float(want.replace(",", "")))
    except ValueError:
        return float(got == want)


def length_reward(prompts, completions, completion_ids, max_new_tokens, **columns) -> list[float]:
    """DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment), batched: 0 up to three quarters
    of the completion budget, then falling linearly to -1 at the budget: long answers cost, truncated ones
    most."""
    soft = max_new_tokens - max(max_new_tokens // 4, 1)
    return [min(0.0, (soft - len(ids)) / (max_new_tokens - soft)) for ids in completion_ids]


BUILTIN_REWARDS: dict[str, RewardFn] = {"arithmetic": arithmetic_reward, "format": format_reward,
                                        "boxed": boxed_reward, "length": length_reward}


# ------------------------------------------------------------------ naming and loading
def resolve_reward(spec: str) -> RewardFn:
    """A built-in name, "package.module:function" or "path/to/file.py:function" → the function. ValueError
    names the fix."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; use a built-in ({', '.join(BUILTIN_REWARDS)}) or "
                         "'module:function' for your own")
    module_name, _, name = spec.rpartition(":")
    module = _import_reward_module(spec, module_name)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"reward {spec!r}: {module_name} has no {name!r} "
                         f"(its functions: {', '.join(defined) or 'none'})")
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not a function")
    return fn


def _import_reward_module(spec: str, module_name: str):
    """As `python -m` would: a module in the current directory imports too; a .py path loads that file."""
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"reward {spec!r}: no such file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
            return module
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ValueError(f"reward {spec!r}: no module named {e.name!r} (searched the current directory and "
                             "sys.path); run from the directory that holds it, or give its file: "
                             f"path/to/{module_name.rsplit('.', 1)[-1]}.py:{spec.rpartition(':')[2]}") from None
        raise ValueError(f"reward {spec!r}: importing {module_name} failed: {e}") from e
    except ValueError:
        raise
    except Exception as e:  # the user's module raised while importing
        raise ValueError(f"reward {spec!r}: importing {module_name} raised {type(e).__name__}: {e}{_where(e)}") from e


def is_batched(fn: RewardFn) -> bool:
    """TRL's signature: the first two parameters are named `prompts` and `completions`."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[:2] == ["prompts", "completions"]


@dataclass
class Reward:
    spec: str  # as the run names it (a built-in name, module:function)
    name: str  # its metrics' name: rewards/<name>/mean
    fn: RewardFn
    batched: bool
    is_async: bool
    params: set[str]  # its parameters' names
    takes_any: bool  # it has **columns: every column reaches it

    @classmethod
    def load(cls, spec: str, name: str) -> Reward:
        fn = resolve_reward(spec)
        params = inspect.signature(fn).parameters.values()
        return cls(spec, name, fn, is_batched(fn), inspect.iscoroutinefunction(fn), {p.name for p in params},
                   any(p.kind == p.VAR_KEYWORD for p in params))

    def keyword_args(self, columns: dict[str, Any], extras: dict[str, Any]) -> dict[str, Any]:
        """The dataset's columns and the extras it names; without **columns, only the columns it names."""
        merged = {**{k: v for k, v in columns.items() if k not in _POSITIONAL},
                  **{k: v for k, v in extras.items() if k in self.params}}
        return merged if self.takes_any else {k: v for k, v in merged.items() if k in self.params}


_POSITIONAL = {"prompt", "completion", "prompts", "completions"}  # a column of that name would collide


def reward_names(specs: list[str]) -> list[str]:
    """Metrics names: the function's name (TRL's), the whole spec where two share one."""
    short = [spec.rpartition(":")[2] for spec in specs]
    return [s if short.count(s) == 1 else spec for s, spec in zip(short, specs, strict=True)]


# ------------------------------------------------------------------ scoring a batch
class _BadOutput(ValueError):
    """A reward returned something that is not one number (or None) per completion."""


@dataclass
class _Batch:
    prompts: list  # as the dataset holds them
    completions: list  # text, or TRL's chat form for a chat prompt
    columns: list[dict[str, Any]]  # per completion
    completion_ids: list[list[int]] | None
    max_new_tokens: int | None

    def column_lists(self) -> dict[str, list]:
        """TRL's form: each column as a list over the batch (None where a row lacks it)."""
        keys = dict.fromkeys(k for row in self.columns for k in row)
        return {k: [row.get(k) for row in self.columns] for k in keys}

    def extras(self, i: int | None = None) -> dict[str, Any]:
        ids = self.completion_ids if i is None or self.completion_ids is None else self.completion_ids[i]
        return {"completion_ids": ids, "max_new_tokens": self.max_new_tokens}


class RewardSet:
    """The run's rewards and their weights. `score` runs them all on a batch of completions → each one's
    value per completion (rl/score.py makes the weighted, None-ignoring sums)."""

    def __init__(self, specs: list[str], weights: list[float], on_error: str = "raise",
                 max_new_tokens: int | None = None):
        if len(weights) != len(specs):
            raise ValueError(f"{len(specs)} rewards but {len(weights)} weights; give one weight per reward")
        if on_error not in ON_ERROR:
            raise ValueError(f"reward_errors={on_error!r}: choose one of {ON_ERROR}")
        self.rewards = [Reward.load(spec, name) for spec, name in zip(specs, reward_names(specs), strict=True)]
        self.names = [r.name for r in self.rewards]
        self.weights, self.on_error, self.max_new_tokens = list(weights), on_error, max_new_tokens
        self.num_errors = 0  # failed samples since construction (on_error="zero")
        self._seen_errors: set = set()

    def score(self, prompts: list, completions: list[str], columns: list[dict],
              completion_ids: list[list[int]] | None = None) -> tuple[list[list[float]], int]:
        """prompts as the dataset holds them, completions as text, each row's other columns → (values (N, R):
        reward r's value of completion i at [i][r], NaN where it gave None; the samples that failed under
        on_error="zero", which score 0). Raises RewardError under on_error="raise"."""
        n = len(completions)
        chat_form = [c if isinstance(p, str) else [{"role": "assistant", "content": c}]
                     for p, c in zip(prompts, completions, strict=True)]
        batch = _Batch(list(prompts), chat_form, list(columns), completion_ids, self.max_new_tokens)
        results = _run(_gather(*(self._values(reward, batch) for reward in self.rewards)))
        errors = 0
        for reward, values in zip(self.rewards, results, strict=True):
            failed = [i for i, v in enumerate(values) if isinstance(v, BaseException)]
            if not failed:
                continue
            message = _failure_message(reward, values[failed[0]], failed[0], n, len(failed))
            if self.on_error == "raise":
                raise RewardError(reward.spec, message) from values[failed[0]]
            e = values[failed[0]]  # one warning per reward and distinct error, wherever in a batch it happens
            self.warn_once(f"{message} (scored 0; further identical errors are only counted)",
                           (reward.spec, type(e).__name__, "" if isinstance(e, _BadOutput) else str(e)))
            errors += len(failed)
            for i in failed:
                values[i] = 0.0
        self.num_errors += errors
        return [list(row) for row in zip(*results, strict=True)], errors

    def warn_once(self, message: str, key=None) -> None:
        key = message if key is None else key
        if key not in self._seen_errors:
            self._seen_errors.add(key)
            log.warning(message)

    async def _values(self, reward: Reward, batch: _Batch) -> list:
        """Each completion's value (NaN for None), or the exception that stands for it."""
        n = len(batch.completions)
        if reward.batched:
            try:
                out = reward.fn(batch.prompts, batch.completions,
                                **reward.keyword_args(batch.column_lists(), batch.extras()))
                if reward.is_async:
                    out = await out
                return _checked_values(out, n)
            except Exception as e:  # the user's code: the on_error policy decides
                return [e] * n

        async def one(i: int):
            try:
                out = reward.fn(batch.prompts[i], batch.completions[i],
                                **reward.keyword_args(batch.columns[i], batch.extras(i)))
                if reward.is_async:
                    out = await out
                return _number(out, i, n)
            except Exception as e:
                return e

        if reward.is_async:  # concurrently over the samples
            return list(await asyncio.gather(*(one(i) for i in range(n))))
        return [await one(i) for i in range(n)]


def _checked_values(out, n: int) -> list[float]:
    if isinstance(out, str | bytes | dict) or not hasattr(out, "__len__"):
        raise _BadOutput(f"returned {_short(out)} for a batch of {n} completions; a batched reward (first parameters "
                         "`prompts, completions`) returns a list of one number (or None) per completion")
    if len(out) != n:
        raise _BadOutput(f"returned {len(out)} values for {n} completions; a batched reward returns one number "
                         "(or None: not applicable) per completion, in order")
    return [_number(v, i, n) for i, v in enumerate(out)]


def _number(value, i: int, n: int) -> float:
    if value is None:
        return math.nan
    try:
        if isinstance(value, str | bytes):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise _BadOutput(f"returned {_short(value)} for completion {i + 1} of {n}; return a number, or None where "
                         "it does not apply") from None
    if math.isinf(number):
        raise _BadOutput(f"returned {number} for completion {i + 1} of {n}; return a finite number")
    return number


def _short(value) -> str:
    text = repr(value)
    return f"{text[:60]}… (a {type(value).__name__})" if len(text) > 60 else f"{text} (a {type(value).__name__})"


def _where(e: BaseException) -> str:
    """Where in the user's code it raised: the innermost frame."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _failure_message(reward: Reward, e: BaseException, i: int, n: int, num_failed: int) -> str:
    if isinstance(e, _BadOutput):
        return f"reward {reward.spec!r} {e}"
    on = f"a batch of {n} completions" if reward.batched else f"completion {i + 1} of {n} ({num_failed} failed)"
    return f"reward {reward.spec!r} raised {type(e).__name__}: {e}{_where(e)} scoring {on}"


async def _gather(*coroutines):
    return await asyncio.gather(*coroutines)


def _run(coroutine):
    """Runs the rewards' event loop; inside a running loop (a notebook) on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()

