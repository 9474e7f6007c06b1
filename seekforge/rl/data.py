"""GRPO's prompt datasets: the prompts a run trains on, with the columns its rewards grade them by.

GRPOConfig.data (and eval_data) name one:
  builtin:arithmetic         the built-in task's questions (data/corpora.ArithmeticTask, GRPOConfig.task_levels),
                             graded by their exact answer; it holds out questions of its own
  PATH.jsonl                 one JSON object per line, {"prompt": ..., "answer": ..., ...}
  PATH.parquet               a Parquet table with a `prompt` column (pyarrow)
  DIR[:SPLIT]                a directory `datasets.save_to_disk` wrote (a DatasetDict: its SPLIT, default train)
  hf:NAME[:CONFIG]:SPLIT     `datasets.load_dataset(NAME, CONFIG, split=SPLIT)` (hf:NAME: its train split): a hub
                             dataset where this machine has it or can download it, or a local dataset directory
A row's `prompt` is text, or a chat conversation — a list of {"role", "content"} messages — that the
tokenizer's chat template renders (with the generation prompt) before it is encoded (render_prompt). Every
other column reaches the reward functions as keywords, as TRL hands a dataset's columns to its reward
functions (rl/rewards.py). Held-out prompts: eval_data's rows when given (eval_prompts of them, drawn by the
seed), else eval_prompts of data's rows drawn by the seed and never trained on; the run's first reward
grades them (rl/evaluate.py; the built-in task: its exact answer).

Each is a PromptDataset: `prompts(step, count)` is a pure function of the seed and the step, so a run resumed
at step s draws exactly what the uninterrupted run drew; `state_dict` / `load_state_dict` carry the position
(and what identifies the data) through a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from seekforge.data.corpora import ArithmeticTask
from seekforge.errors import UserError

BUILTIN = "builtin:arithmetic"
_FORMS = (f"{BUILTIN!r}, a .jsonl or .parquet file, a directory datasets.save_to_disk wrote (DIR or DIR:SPLIT) or "
          "hf:NAME[:CONFIG]:SPLIT")


class Sample(NamedTuple):
    prompt: str | list[dict]  # text, or chat messages [{"role": ..., "content": ...}, ...]
    meta: dict[str, Any]  # the other columns: keyword arguments of the reward functions


class PromptDataset(Protocol):
    eval_set: list[Sample]
    position: int  # the next step: the data position a checkpoint stores
    grader: str | None  # the reward that grades eval_set; None: the run's first reward

    def prompts(self, step: int, count: int) -> list[Sample]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def render_prompt(tokenizer, prompt: str | list[dict]) -> str:
    """A prompt as the text the model continues: a chat conversation through the tokenizer's chat template,
    ending in the assistant's turn."""
    if isinstance(prompt, str):
        return prompt
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"chat prompts need a tokenizer with a chat template; {type(tokenizer).__name__} has none")
    try:
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    except Exception as e:  # jinja's errors (a template's raise_exception too) name no prompt
        raise ValueError(f"the tokenizer's chat template failed on the prompt {str(prompt)[:120]}: "
                         f"{type(e).__name__}: {e}") from e


# ------------------------------------------------------------------ which source a spec names
def check_data_spec(spec: str, key: str = "data") -> None:
    """A `data` / `eval_data` value that cannot load fails here, before any model is built (a hub dataset is
    only looked up when it loads)."""
    if spec == BUILTIN:
        return
    if spec.startswith("builtin:"):
        raise ValueError(f"{key}={spec!r}: the built-in prompt dataset is {BUILTIN!r}")
    if spec.startswith("hf:"):
        if not spec[3:] or spec.count(":") > 3:
            raise ValueError(f"{key}={spec!r}: write hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
        _datasets(key, spec)
        return
    path, _ = _path_and_split(spec)
    if path.is_dir():
        if not any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
            raise ValueError(f"{key}={spec!r} is a directory that datasets.save_to_disk did not write (no state.json "
                             f"or dataset_dict.json); give {_FORMS}")
        _datasets(key, spec)
        return
    if path.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"{key}={spec!r}: give {_FORMS}")
    if not path.is_file():
        raise ValueError(f"{key}={spec!r}: no such file")


def _path_and_split(spec: str) -> tuple[Path, str | None]:
    """DIR:SPLIT names a split of a saved DatasetDict (when DIR is a directory and DIR:SPLIT is not a path)."""
    head, colon, split = spec.rpartition(":")
    if colon and not Path(spec).exists() and Path(head).is_dir():
        return Path(head), split
    return Path(spec), None


def _datasets(key: str, spec: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{key}={spec!r} needs the `datasets` library: pip install datasets (or seekforge[datasets]; "
                         "or give a .jsonl or .parquet file)") from None
    return datasets


# ------------------------------------------------------------------ loading rows
def load_rows(spec: str, key: str = "data") -> tuple[list[Sample], str]:
    """A data spec (not the built-in) → (its rows as Samples, a fingerprint that changes with their content)."""
    check_data_spec(spec, key)
    if spec.startswith("hf:"):
        return _rows_of_dataset(spec, _load_hub(key, spec))
    path, split = _path_and_split(spec)
    if path.is_dir():
        return _rows_of_dataset(spec, _load_saved(key, spec, path, split))
    data = path.read_bytes()
    fingerprint = hashlib.sha256(data).hexdigest()
    if path.suffix == ".parquet":
        return _rows_of_table(spec, _parquet_rows(path)), fingerprint
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    return [_jsonl_row(path, number, line) for number, line in enumerate(lines, 1) if line.strip()], fingerprint


def _load_hub(key: str, spec: str):
    parts = spec[3:].split(":")
    name, config, split = parts[0], (parts[1] if len(parts) == 3 else None), (parts[-1] if len(parts) > 1 else "train")
    try:
        return _datasets(key, spec).load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name or split: datasets' own message says which
        raise ValueError(f"{key}={spec!r}: datasets.load_dataset({name!r}, {config!r}, split={split!r}) failed: "
                         f"{type(e).__name__}: {e}") from e


def _load_saved(key: str, spec: str, path: Path, split: str | None):
    datasets = _datasets(key, spec)
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        split = split or "train"
        if split not in loaded:
            raise ValueError(f"{key}={spec!r}: {path} has the splits {sorted(loaded)}, not {split!r}; write "
                             f"{path}:SPLIT")
        return loaded[split]
    if split is not None:
        raise ValueError(f"{key}={spec!r}: {path} holds one dataset, not a DatasetDict with splits; drop ':{split}'")
    return loaded


def _parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path} needs pyarrow to read: pip install pyarrow (or datasets, which brings it)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise ValueError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from e
    _check_columns(str(path), table.column_names)
    return table.to_pylist()


def _rows_of_dataset(spec: str, dataset) -> tuple[list[Sample], str]:
    _check_columns(spec, dataset.column_names)
    rows = dataset.to_list()
    fingerprint = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
    return _rows_of_table(spec, rows), fingerprint


def _check_columns(source: str, columns: list[str]) -> None:
    if "prompt" not in columns:
        raise ValueError(f"{source} has no `prompt` column (its columns: {', '.join(columns)}); name the prompts' "
                         "column `prompt` (the others reach the rewards)")


def _rows_of_table(source: str, rows: list[dict]) -> list[Sample]:
    return [_sample(f"{source} row {i}", dict(row)) for i, row in enumerate(rows)]


def _jsonl_row(path: Path, number: int, line: str) -> Sample:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        row = None
    if not isinstance(row, dict):
        raise ValueError(f'{path}:{number} is not a JSON object; write one object per line, such as '
                         '{"prompt": "...", "answer": "..."}')
    return _sample(f"{path}:{number}", row)


def _sample(where: str, row: dict) -> Sample:
    prompt = row.pop("prompt", None)
    chat = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not (isinstance(prompt, str) or chat):
        raise ValueError(f'{where}: "prompt" must be text or a non-empty list of {{"role": ..., "content": ...}} chat '
                         f"messages (got {str(prompt)[:80]!r})")
    return Sample(prompt, row)


# ------------------------------------------------------------------ the datasets
def prompt_dataset(spec: str, seed: int, num_eval: int, task_levels: list[int], eval_spec: str = "",
                   tokenizer=None) -> PromptDataset:
    """GRPOConfig.data → its dataset (arguments: the config's fields of the same names; eval_prompts → num_eval,
    eval_data → eval_spec). With a tokenizer, a chat dataset's first prompt is rendered now: a template that
    cannot render it fails before any training."""
    check_data_spec(spec)
    if spec == BUILTIN:
        if eval_spec:
            raise ValueError(f"eval_data={eval_spec!r} needs data other than {BUILTIN!r}, which holds out questions "
                             "of its own (eval_prompts of them)")
        return ArithmeticPrompts(task_levels, seed, num_eval)
    rows, fingerprint = load_rows(spec)
    eval_rows = load_rows(eval_spec, "eval_data")[0] if eval_spec else None
    dataset = TablePrompts(spec, rows, fingerprint, seed, num_eval, eval_rows)
    first_chat = next((s.prompt for s in rows + (eval_rows or []) if not isinstance(s.prompt, str)), None)
    if tokenizer is not None and first_chat is not None:
        render_prompt(tokenizer, first_chat)
    return dataset


class ArithmeticPrompts:
    """The built-in task. Step s's prompts come from a generator seeded by (seed, s); held-out prompts
    come from another seed and are never trained on."""

    grader = "arithmetic"

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

    def state_dict(self) -> dict:
        return {"position": self.position, "data": BUILTIN}

    def load_state_dict(self, state: dict) -> None:
        if state.get("data", BUILTIN) != BUILTIN:  # checkpoints from before the key existed trained on BUILTIN
            raise _other_data(state["data"], BUILTIN)
        self.position = int(state["position"])


class TablePrompts:
    """A user's prompts (any source load_rows reads). Without separate eval rows, `num_eval` rows drawn by the
    seed are held out; the training rows are trained on in epochs, each in its own seeded order: step s takes
    positions [s·count, (s+1)·count) of that endless sequence."""

    grader = None

    def __init__(self, source: str, rows: list[Sample], fingerprint: str, seed: int, num_eval: int,
                 eval_rows: list[Sample] | None = None):
        self.source, self.fingerprint, self.seed, self.position, self.num_rows = source, fingerprint, seed, 0, len(rows)
        if eval_rows is None:
            if num_eval >= len(rows):
                raise ValueError(f"{source} has {len(rows)} prompts and eval_prompts={num_eval} would hold out all of "
                                 f"them; set eval_prompts below {len(rows)} (0: no held-out evaluation), or give "
                                 "held-out prompts of their own (--eval-data)")
            order = list(range(len(rows)))
            random.Random(f"split-{seed}").shuffle(order)
            self.eval_set = [rows[i] for i in order[:num_eval]]
            self._train = [rows[i] for i in sorted(order[num_eval:])]
        else:
            if not rows:
                raise ValueError(f"{source} has no prompts")
            order = list(range(len(eval_rows)))
            random.Random(f"eval-{seed}").shuffle(order)
            self.eval_set = [eval_rows[i] for i in sorted(order[:num_eval])]
            self._train = rows
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

    def state_dict(self) -> dict:
        return {"position": self.position, "num_prompts": self.num_rows, "sha256": self.fingerprint,
                "data": self.source}

    def load_state_dict(self, state: dict) -> None:
        if "sha256" not in state:  # a run on the built-in task
            raise _other_data(state.get("data", BUILTIN), self.source)
        if state["sha256"] != self.fingerprint:
            raise ValueError(f"the checkpoint's run trained on another version of {self.source} "
                             f"({state['num_prompts']} prompts, sha256 {state['sha256'][:12]}…; now {self.num_rows}, "
                             f"{self.fingerprint[:12]}…); restore that data, or start over with --no-resume")
        self.position = int(state["position"])


def _other_data(saved: str, asked: str) -> UserError:
    return UserError(f"the checkpoint's run trained on {saved}, and this one asks for {asked}: a resumed run keeps "
                     "its data; give this run its own --out-dir, or start over with --no-resume")
