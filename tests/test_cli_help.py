"""`seekforge VERB --help` describes every option: a flag listed bare leaves the user to guess."""

from __future__ import annotations

import argparse

import pytest

from seekforge.cli import VERBS, verb_module


def _parsers(parser: argparse.ArgumentParser):
    """The parser and every sub-command's parser below it (`plan memory`, `probe dump`, ...)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_option_has_a_description(verb):
    parser = argparse.ArgumentParser(prog=f"seekforge {verb}")
    verb_module(verb).add_arguments(parser)
    bare = [f"{p.prog} {action.option_strings[0]}" for p in _parsers(parser) for action in p._actions
            if action.option_strings and not action.help and action.help != argparse.SUPPRESS]
    assert not bare, f"options without a description: {bare}"
