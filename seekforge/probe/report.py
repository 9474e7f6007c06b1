"""A comparison (probe/compare.py) as one self-contained HTML file: the module hierarchy as a
collapsible tree (<details>/<summary>), each node coloured by the worst metric anywhere below it, so
a reader follows the red from the root down to where the error enters. The first diverging module
carries the class `first-diverging` and a visible label; a few lines of inline JS open the path to
it (the summary line links to it). No external assets: the file opens offline and can be attached to an
issue."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from seekforge.probe.compare import METRICS, Comparison

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
.summary { margin: 0 0 1em; }
details { margin-left: 1.2em; border-left: 1px dotted #bbb; padding-left: .4em; }
summary { cursor: pointer; padding: 1px 0; white-space: nowrap; }
.swatch { display: inline-block; width: .9em; height: .9em; border-radius: 2px; margin-right: .4em;
          vertical-align: -1px; }
.cls { color: #777; margin-left: .4em; }
.metric { color: #444; margin-left: .6em; font-size: .9em; }
.pass > summary .swatch { background: #2e9e44; }
.warn > summary .swatch { background: #e0a800; }
.fail > summary .swatch { background: #d9381e; }
.skip > summary .swatch { background: #bbb; }
.first-diverging > summary { background: #ffe3dc; outline: 2px solid #d9381e; }
.divergence-label { color: #fff; background: #d9381e; border-radius: 3px; padding: 0 .4em; margin-left: .6em;
                    font-weight: 600; }
table { border-collapse: collapse; margin: .3em 0 .5em 1.2em; font-size: .85em; }
td, th { border: 1px solid #ddd; padding: 1px 6px; text-align: right; }
td.l, th.l { text-align: left; }
tr.fail td { background: #fde8e4; }
.toolbar button { margin-right: .5em; }
details.rows { border-left: none; }
.rows-summary { color: #666; font-size: .85em; }
"""

_JS = """
const marked = document.querySelector('details.first-diverging');
for (let node = marked; node; node = node.parentElement && node.parentElement.closest('details.node')) {
  node.open = true;
}
function setAll(open) { document.querySelectorAll('details.node').forEach(d => { d.open = open; }); }
function showFailing() {
  document.querySelectorAll('details.node').forEach(d => { d.open = d.classList.contains('fail'); });
}
document.body.dataset.rendered = 'true';
"""


@dataclass
class Node:
    name: str  # full dotted name ("" for the root)
    cls: str = ""
    rows: list[dict] = field(default_factory=list)  # this module's own compared slots
    children: dict[str, Node] = field(default_factory=dict)
    worst_cosine: float = math.inf
    fails: int = 0
    compared: int = 0


def build_tree(comparison: Comparison) -> Node:
    root = Node("")
    names = set(comparison.classes) | {r["module"] for r in comparison.rows}
    for name in sorted(names):
        node = root
        for depth, part in enumerate(name.split(".")):
            full = ".".join(name.split(".")[:depth + 1])
            node = node.children.setdefault(part, Node(full, comparison.classes.get(full, "")))
    for row in comparison.rows:
        node = root
        for part in row["module"].split("."):
            node = node.children[part]
        node.rows.append(row)
    _aggregate(root)
    _sort_by_execution(root)
    return root


def _sort_by_execution(node: Node) -> float:
    """Children in the order they first ran (modules never called last); returns the subtree's first order."""
    first = min((r["order"] for r in node.rows), default=math.inf)
    keyed = [(_sort_by_execution(child), part, child) for part, child in node.children.items()]
    keyed.sort(key=lambda item: item[0])
    node.children = {part: child for _, part, child in keyed}
    return min([first] + [k for k, _, _ in keyed])


def _aggregate(node: Node) -> None:
    for row in node.rows:
        if row["status"] == "skip":
            continue
        node.compared += 1
        node.fails += row["status"] == "fail"
        cosine = row.get("cosine")
        if cosine is not None:
            node.worst_cosine = min(node.worst_cosine, cosine if not math.isnan(cosine) else -math.inf)
    for child in node.children.values():
        _aggregate(child)
        node.compared += child.compared
        node.fails += child.fails
        node.worst_cosine = min(node.worst_cosine, child.worst_cosine)


def _status(node: Node, warn_cosine: float) -> str:
    if node.compared == 0:
        return "skip"
    if node.fails:
        return "fail"
    return "warn" if node.worst_cosine < warn_cosine else "pass"


def _fmt(value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return html.escape(str(value))


def _rows_table(rows: list[dict], open_: bool) -> str:
    """This module's own slots, folded away under one line unless `open_` (the diverging module)."""
    if not rows:
        return ""
    head = ["direction", "call", "slot", "status", *METRICS, "norm_a", "norm_b", "shape_a", "note"]
    out = ["<table><tr>" + "".join(f'<th class="l">{h}</th>' for h in head) + "</tr>"]
    for row in rows:
        cells = "".join(f'<td class="{"l" if h in ("direction", "slot", "status", "note") else ""}">'
                        f'{_fmt(row.get(h))}</td>' for h in head)
        out.append(f'<tr class="{row["status"]}">{cells}</tr>')
    fails = sum(r["status"] == "fail" for r in rows)
    return (f'<details class="rows"{" open" if open_ else ""}><summary class="rows-summary">{len(rows)} slots of '
            f'this module ({fails} fail)</summary>' + "".join(out) + "</table></details>")


def _render(node: Node, divergence: dict | None, warn_cosine: float) -> str:
    label = node.name.rsplit(".", 1)[-1] if node.name else "(model)"
    classes = ["node", _status(node, warn_cosine)]
    marker = ""
    diverging = bool(divergence and node.name == divergence["module"])
    if diverging:
        classes.append("first-diverging")
        marker = (f'<span class="divergence-label">first divergence ({divergence["direction"]}, '
                  f'call {divergence["call"]})</span>')
    metric = "not compared" if node.compared == 0 else (
        f"worst cosine {_fmt(node.worst_cosine) if node.worst_cosine != math.inf else 'n/a'} · "
        f"{node.fails}/{node.compared} slots fail")
    children = "".join(_render(child, divergence, warn_cosine) for child in node.children.values())
    cls = f'<span class="cls">{html.escape(node.cls)}</span>' if node.cls else ""
    anchor = ' id="first-divergence"' if diverging else ""
    return (f'<details class="{" ".join(classes)}" data-module="{html.escape(node.name)}"{anchor}>'
            f'<summary><span class="swatch"></span>{html.escape(label)}{cls}<span class="metric">{metric}</span>'
            f'{marker}</summary>{_rows_table(node.rows, diverging)}{children}</details>')


def render_html(comparison: Comparison, title: str = "seekforge probe comparison",
                warn_cosine: float = 0.999999) -> str:
    """warn_cosine: passing subtrees whose worst cosine is below this are drawn amber, not green."""
    tree = build_tree(comparison)
    body = _render(tree, comparison.first_divergence, warn_cosine)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>'
            f'<p class="summary">{html.escape(comparison.summary())}'
            f'{" · <a href=#first-divergence>go to it</a>" if comparison.first_divergence else ""}</p>'
            '<p class="toolbar"><button onclick="setAll(true)">expand all</button>'
            '<button onclick="setAll(false)">collapse all</button>'
            '<button onclick="showFailing()">failing only</button></p>'
            f'<div id="tree">{body}</div><script>{_JS}</script></body></html>')


def write_report(comparison: Comparison, path: str | Path, title: str = "seekforge probe comparison") -> Path:
    path = Path(path)
    path.write_text(render_html(comparison, title))
    return path
