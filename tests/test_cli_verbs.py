"""Every `seekforge VERB` works on a plain install (`pip install seekforge`, no `test` extra): the
code a verb can reach imports only the standard library, seekforge, the runtime dependencies
declared in pyproject.toml and a feature extra's (an option that says which extra to install)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from seekforge.cli import VERBS, verb_module

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _declared() -> tuple[set[str], set[str]]:
    """(runtime and feature-extra distributions, distributions only the test extra installs)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime = {_name(r) for r in project["dependencies"]}
    runtime |= {_name(r) for extra, reqs in extras.items() if extra != "test" for r in reqs}
    return runtime, {_name(r) for r in extras["test"]} - runtime


@functools.cache
def _distributions() -> dict[str, set[str]]:
    """Top-level import name → the installed distributions providing it (scans every install: slow)."""
    return {top: {_name(d) for d in dists} for top, dists in importlib.metadata.packages_distributions().items()}


def _reachable_imports(module: str) -> dict[str, set[str]]:
    """Third-party top-level imports (module level or inside functions) of `module` and of every
    seekforge module it imports, transitively → the seekforge modules that import them."""
    found: dict[str, set[str]] = {}
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # `from seekforge.x import name` where name is not a module
            continue
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                top = target.split(".")[0]
                if top == "seekforge":
                    todo.append(target)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(name)
    return found


def test_verbs_reach_only_runtime_dependencies():
    runtime, _ = _declared()
    for verb in VERBS:
        for top, importers in _reachable_imports(verb_module(verb).__name__).items():
            dists = _distributions().get(top, set())
            assert dists & runtime, (f"`seekforge {verb}` reaches `import {top}` ({sorted(importers)}), "
                                     f"distribution {sorted(dists) or '?'} is not a runtime dependency")


def test_verbs_import_and_parse_without_test_only_packages():
    """Each verb module imports and builds its argument parser with the test-only packages hidden."""
    _, test_only = _declared()
    hidden = sorted(top for top, dists in _distributions().items() if dists & test_only)
    code = textwrap.dedent(f"""
        import argparse, sys

        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {hidden!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (test-only)", name=name)

        sys.meta_path.insert(0, Hide())
        from seekforge.cli import VERBS, verb_module

        for verb in VERBS:
            verb_module(verb).add_arguments(argparse.ArgumentParser())
            print(verb)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == list(VERBS)


def test_the_verb_table_is_visible_to_import_linter():
    """`seekforge.cli` imports each verb module by an import statement, so the layer contract (and a reader)
    sees which module serves which verb; a verb loaded by a string would be invisible to both."""
    import grimp

    graph = grimp.build_graph("seekforge")
    imported = graph.find_modules_directly_imported_by("seekforge.cli")
    for verb in VERBS:
        assert verb_module(verb).__name__ in imported, verb
