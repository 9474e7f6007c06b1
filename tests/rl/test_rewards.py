"""Rewards: the built-ins, `module:function` loading, weighted combination, and a raising reward that
scores 0, warns once per distinct error and is counted."""

from __future__ import annotations

import logging

import pytest

from seekforge.rl.rewards import RewardSet, boxed_reward, format_reward, last_boxed, resolve_reward


def broken_reward(prompt, completion, **meta):
    if "boom" in completion:
        raise RuntimeError("boom")
    return 1.0


def length_reward(prompt, completion, **meta):
    return float(len(completion))


def test_arithmetic_and_format_rewards():
    arithmetic = resolve_reward("arithmetic")
    assert arithmetic("Q: 37 + 48 = ? A:", " 85", answer="85") == 1.0
    assert arithmetic("Q: 37 + 48 = ? A:", " 84", answer="85") == 0.0
    assert arithmetic("Q: 6 * 7 = ? A:", " 6 * 7 = 42. The answer is 42.", answer="42") == 1.0
    assert format_reward("", " 85") == 1.0
    assert format_reward("", " 40 * 2 = 80; 5 * 2 = 10. The answer is 90.") == 1.0
    assert format_reward("", " 85 Q: 1 + 1 = ?") == 0.0  # ran on into a new question
    assert format_reward("", " eighty-five") == 0.0


def test_boxed_reward():
    assert last_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{12") is None
    assert boxed_reward("", r"The answer is $\boxed{1,000}$", answer="1000") == 1.0
    assert boxed_reward("", r"\boxed{\dfrac{1}{2}}", answer=r"\frac{1}{2}") == 1.0
    assert boxed_reward("", r"\boxed{\text{yes}}", answer="yes") == 1.0
    assert boxed_reward("", r"\boxed{3}", answer="4") == 0.0
    assert boxed_reward("", "no box: 4", answer="4") == 0.0


def test_user_reward_by_module_path_and_weights():
    rewards = RewardSet(["arithmetic", f"{__name__}:length_reward"], [1.0, 0.5])
    totals, metrics = rewards.scores(["p", "p"], [" 3", " 4x"], [{"answer": "3"}, {"answer": "3"}])
    assert totals == [1.0 + 0.5 * 2, 0.5 * 3]
    assert metrics["reward/arithmetic"] == 0.5 and metrics["reward_errors"] == 0


def test_raising_reward_scores_zero_warns_once_and_is_counted(caplog):
    rewards = RewardSet([f"{__name__}:broken_reward"], [1.0])
    with caplog.at_level(logging.WARNING, logger="seekforge.rl"):
        totals, metrics = rewards.scores(["p"] * 4, ["ok", "boom", "boom", "ok"], [{}] * 4)
    assert totals == [1.0, 0.0, 0.0, 1.0]
    assert metrics["reward_errors"] == 2 and rewards.num_errors == 2
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1


@pytest.mark.parametrize("spec, match", [("nope", "unknown reward 'nope'"),
                                         ("no_such_module_xyz:f", "does not load"),
                                         (f"{__name__}:missing", "does not load")])
def test_unknown_reward_is_one_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_reward(spec)
