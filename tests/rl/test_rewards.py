"""Rewards: the built-ins, loading by `module:function` or file path with errors that say which part failed,
both signatures (per sample and TRL's batched one, with the columns as lists), async rewards run
concurrently, None left out of the weighted sum, and the error policies (raise: RewardError naming the reward
and the batch; zero: scored 0, warned once, counted)."""

from __future__ import annotations

import asyncio
import logging
import math
import sys

import pytest

from seekforge.rl.cli import split_weight
from seekforge.rl.rewards import (
    RewardError,
    RewardSet,
    boxed_reward,
    completion_text,
    format_reward,
    is_batched,
    last_boxed,
    length_reward,
    resolve_reward,
)

SEEN: list = []


def broken_reward(prompt, completion, **meta):
    if "boom" in completion:
        raise RuntimeError("boom")
    return 1.0


def char_count(prompt, completion, **meta):
    return float(len(completion))


def batched_match(prompts, completions, answer, **columns):
    """TRL's signature: lists in, a list out."""
    SEEN.append((prompts, completions, answer, columns))
    return [float(completion_text(c).strip() == a) for c, a in zip(completions, answer, strict=True)]


def only_answer(prompt, completion, answer):
    """No **columns: gets only the columns it names."""
    return float(answer in completion)


def with_ids(prompts, completions, completion_ids, **columns):
    return [len(ids) for ids in completion_ids]


def short_list(prompts, completions, **columns):
    return [1.0] * (len(completions) - 1)


def text_value(prompts, completions, **columns):
    return ["good"] * len(completions)


def maybe(prompt, completion, applies, **columns):
    return 1.0 if applies else None


async def async_a(prompts, completions, events, **columns):
    """Waits for async_b's signal before giving its own: completes only if the two run concurrently."""
    events = events[0]  # a column: one value per completion
    events["a"].set()
    await asyncio.wait_for(events["b"].wait(), 5)
    return [1.0] * len(completions)


async def async_b(prompts, completions, events, **columns):
    events = events[0]
    events["b"].set()
    await asyncio.wait_for(events["a"].wait(), 5)
    return [2.0] * len(completions)


async def async_per_sample(prompt, completion, **columns):
    await asyncio.sleep(0)
    return float(len(completion))


def test_arithmetic_format_and_length_rewards():
    arithmetic = resolve_reward("arithmetic")
    assert arithmetic("Q: 37 + 48 = ? A:", " 85", answer="85") == 1.0
    assert arithmetic("Q: 37 + 48 = ? A:", " 84", answer="85") == 0.0
    assert arithmetic("Q: 6 * 7 = ? A:", " 6 * 7 = 42. The answer is 42.", answer="42") == 1.0
    assert arithmetic([{"role": "user", "content": "6 * 7?"}], [{"role": "assistant", "content": "42"}],
                      answer="42") == 1.0  # TRL's chat form
    assert format_reward("", " 85") == 1.0
    assert format_reward("", " 40 * 2 = 80; 5 * 2 = 10. The answer is 90.") == 1.0
    assert format_reward("", " 85 Q: 1 + 1 = ?") == 0.0  # ran on into a new question
    assert format_reward("", " eighty-five") == 0.0
    # DAPO's soft overlong punishment over a budget of 8: free up to 6 tokens, then -0.5 per token
    assert length_reward([""] * 4, [""] * 4, [[1] * 5, [1] * 6, [1] * 7, [1] * 8], max_new_tokens=8) == \
        [0.0, 0.0, -0.5, -1.0]
    assert is_batched(length_reward) and not is_batched(format_reward)


def test_boxed_reward():
    assert last_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{12") is None
    assert boxed_reward("", r"The answer is $\boxed{1,000}$", answer="1000") == 1.0
    assert boxed_reward("", r"\boxed{\dfrac{1}{2}}", answer=r"\frac{1}{2}") == 1.0
    assert boxed_reward("", r"\boxed{\text{yes}}", answer="yes") == 1.0
    assert boxed_reward("", r"\boxed{3}", answer="4") == 0.0
    assert boxed_reward("", "no box: 4", answer="4") == 0.0


def test_per_sample_and_batched_rewards_with_weights():
    SEEN.clear()
    rewards = RewardSet(["arithmetic", f"{__name__}:char_count", f"{__name__}:batched_match",
                         f"{__name__}:only_answer"], [1.0, 0.5, 2.0, 1.0])
    assert rewards.names == ["arithmetic", "char_count", "batched_match", "only_answer"]
    columns = [{"answer": "3", "level": 1}, {"answer": "3", "level": 2}]
    values, errors = rewards.score(["p", "q"], [" 3", " 4x"], columns)
    assert values == [[1.0, 2.0, 1.0, 1.0], [0.0, 3.0, 0.0, 0.0]] and errors == 0
    (prompts, completions, answer, columns), = SEEN  # one call for the batch, the columns as lists
    assert prompts == ["p", "q"] and completions == [" 3", " 4x"]
    assert answer == ["3", "3"] and columns == {"level": [1, 2]}


def test_extras_reach_only_the_rewards_that_name_them_and_chat_completions_are_messages():
    SEEN.clear()
    rewards = RewardSet([f"{__name__}:with_ids", f"{__name__}:batched_match", "length"], [1.0, 1.0, 1.0],
                        max_new_tokens=4)
    chat = [{"role": "user", "content": "1 + 1?"}]
    values, _ = rewards.score([chat, "text"], ["2", "3"], [{"answer": "2"}] * 2, [[50, 257], [51, 52, 53, 54]])
    assert [row[0] for row in values] == [2.0, 4.0] and [row[2] for row in values] == [0.0, -1.0]
    (prompts, completions, _, columns), = SEEN
    assert columns == {} and prompts == [chat, "text"]  # no completion_ids: batched_match does not name it
    assert completions == [[{"role": "assistant", "content": "2"}], "3"]  # TRL's forms


def test_async_rewards_run_concurrently():
    events = {"a": asyncio.Event(), "b": asyncio.Event()}
    rewards = RewardSet([f"{__name__}:async_a", f"{__name__}:async_b", f"{__name__}:async_per_sample"], [1, 1, 1])
    values, _ = rewards.score(["p"] * 3, ["x", "yy", "zzz"], [{"events": events}] * 3)
    assert values == [[1.0, 2.0, 1.0], [1.0, 2.0, 2.0], [1.0, 2.0, 3.0]]


def test_async_rewards_inside_a_running_event_loop():
    """A notebook runs an event loop already: the rewards' loop runs on a thread of its own."""
    rewards = RewardSet([f"{__name__}:async_per_sample"], [1.0])

    async def main():
        return rewards.score(["p"], ["abc"], [{}])

    assert asyncio.run(main()) == ([[3.0]], 0)


def test_none_is_left_out_of_the_sum_and_the_reward_statistics():
    from seekforge.rl.score import reward_statistics

    rewards = RewardSet([f"{__name__}:maybe", f"{__name__}:char_count"], [1.0, 0.5])
    values, _ = rewards.score(["p"] * 3, ["ab", "abcd", "x"], [{"applies": a} for a in (True, False, True)])
    assert math.isnan(values[1][0]) and [v[1] for v in values] == [2.0, 4.0, 1.0]
    import torch

    column = torch.tensor([v[0] for v in values], dtype=torch.float64)
    assert reward_statistics(column, "rewards/maybe") == {"rewards/maybe/mean": 1.0, "rewards/maybe/std": 0.0}
    stats = reward_statistics(torch.tensor([math.nan]), "r")
    assert math.isnan(stats["r/mean"]) and math.isnan(stats["r/std"])


@pytest.mark.parametrize("reward, message", [
    ("broken_reward", r"reward 'tests.rl.test_rewards:broken_reward' raised RuntimeError: boom "
                      r"\(at .*test_rewards.py:\d+\) scoring completion 2 of 4 \(2 failed\)"),
    ("short_list", r"reward 'tests.rl.test_rewards:short_list' returned 3 values for 4 completions"),
    ("text_value", r"reward 'tests.rl.test_rewards:text_value' returned 'good' \(a str\) for completion 1 of 4"),
])
def test_a_failing_reward_raises_naming_it(reward, message):
    rewards = RewardSet([f"{__name__}:{reward}"], [1.0])
    with pytest.raises(RewardError, match=message) as info:
        rewards.score(["p"] * 4, ["ok", "boom", "boom", "ok"], [{}] * 4)
    assert info.value.reward == f"{__name__}:{reward}"


def test_raising_reward_under_zero_scores_zero_warns_once_and_is_counted(caplog):
    rewards = RewardSet([f"{__name__}:broken_reward", f"{__name__}:short_list"], [1.0, 1.0], on_error="zero")
    with caplog.at_level(logging.WARNING, logger="seekforge.rl"):
        values, errors = rewards.score(["p"] * 4, ["ok", "boom", "boom", "ok"], [{}] * 4)
        rewards.score(["p"] * 4, ["boom", "ok", "ok", "ok"], [{}] * 4)  # elsewhere in the batch: the same error
    assert [row[0] for row in values] == [1.0, 0.0, 0.0, 1.0] and [row[1] for row in values] == [0.0] * 4
    assert errors == 2 + 4 and rewards.num_errors == 6 + 1 + 4
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1
    assert len([r for r in caplog.records if "returned 3 values" in r.getMessage()]) == 1


@pytest.mark.parametrize("spec, match", [
    ("nope", "unknown reward 'nope'"),
    ("no_such_module_xyz:f", r"no module named 'no_such_module_xyz' \(searched the current directory"),
    (f"{__name__}:missing", r"tests.rl.test_rewards has no 'missing' \(its functions: .*batched_match"),
    ("missing_file.py:f", "no such file missing_file.py"),
])
def test_unknown_reward_is_one_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_reward(spec)


def test_rewards_from_a_file_and_from_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "shouting_rewards.py").write_text("def shout(prompt, completion, **columns):\n    return 2.0\n")
    (tmp_path / "raises_on_import.py").write_text("raise ImportError('needs torch 9')\n")
    assert resolve_reward(f"{tmp_path}/shouting_rewards.py:shout")("p", "c") == 2.0
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "shouting_rewards", raising=False)
    assert resolve_reward("shouting_rewards:shout")("p", "c") == 2.0  # as `python -m` would import it
    del sys.modules["shouting_rewards"]
    with pytest.raises(ValueError, match="importing raises_on_import raised ImportError: needs torch 9"):
        resolve_reward("raises_on_import:f")


@pytest.mark.parametrize("flag, parsed", [("format=0.2", ("format", 0.2)), ("m.x:fn", ("m.x:fn", None)),
                                          ("m:fn=-1", ("m:fn", -1.0))])
def test_reward_flag_weights(flag, parsed):
    assert split_weight(flag) == parsed
