"""`seekforge VERB --help` describes every option: a flag listed bare leaves the user to guess."""

from __future__ import annotations

import argparse
import importlib

import pytest

from seekforge.cli import VERBS


@pytest.mark.parametrize("verb", ["generate", "serve", "bench"])
def test_every_option_has_a_description(verb):
    parser = argparse.ArgumentParser()
    importlib.import_module(VERBS[verb][0]).add_arguments(parser)
    bare = [action.option_strings[0] for action in parser._actions
            if action.option_strings and not action.help and action.help != argparse.SUPPRESS]
    assert not bare, f"seekforge {verb}: options without a description: {bare}"
