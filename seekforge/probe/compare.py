"""Compare two dumps (probe/dump.py) call by call: accuracy metrics per tensor, pass/fail, and the
first module where the two runs diverge.

Dump A is the one under test, B the reference. With tensors in both (mode "tensor"), each slot gets
  cosine        cosine similarity of the flattened tensors
  max_abs_err   max |a − b|
  max_rel_err   max |a − b| / |b|        (|b| floored at 1e-12)
  within_1e-3 / within_5e-3   the fraction of elements whose relative error is at most 1/1000, 5/1000
and it passes when cosine ≥ min_cosine and max_abs_err ≤ atol_ratio · max|b| (NaN anywhere fails).
The element-wise relative errors are reported, not judged: an element that is zero in exact
arithmetic (the gradient of the first query, which attends to one key) carries rounding noise of
any relative size in both fp32 implementations alike. Without
tensors the statistics are compared (relative norm difference ≤ stats_rtol, equal NaN/Inf counts),
and md5 dumps compare their hashes. A mapping file (mappings/*.yaml) renames A's modules and slots
into B's, so two implementations of one network compare (seekforge ↔ transformers).

The first divergence: the first failing call in execution order (forward, then backward). When that
call's own inputs (input.*, or grad_output.* in backward) already fail, the error entered in code of
its parent that is not a module of its own (o_proj's input comes from the attention math), so the
blame moves up to the closest enclosing module whose inputs still pass.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open

from seekforge.config import read_config_file

METRICS = ("cosine", "max_abs_err", "max_rel_err", "within_1e-3", "within_5e-3")
CSV_COLUMNS = ("order", "direction", "module", "reference", "call", "slot", "status", *METRICS,
               "norm_a", "norm_b", "norm_rel_diff", "mean_diff", "max_diff", "min_diff", "nan_a", "nan_b",
               "shape_a", "shape_b", "dtype_a", "dtype_b", "note")


@dataclass
class Thresholds:
    min_cosine: float = 0.9999
    atol_ratio: float = 1e-3  # max |a − b| allowed, as a fraction of the reference's largest |value|
    stats_rtol: float = 1e-3  # statistics-only dumps: relative difference of the L2 norms


# ---------------------------------------------------------------------------------------- loading
@dataclass
class Dump:
    path: Path
    records: list[dict]
    classes: dict[str, str]
    tensor_file: Path | None

    def __post_init__(self):
        # One open file (memory-mapped) for all lookups; tensors are read one at a time.
        self._tensors = safe_open(str(self.tensor_file), "pt") if self.tensor_file else None
        self._keys = set(self._tensors.keys()) if self._tensors else set()

    def tensor(self, direction: str, module: str, call: int, slot: str) -> torch.Tensor | None:
        key = f"{direction}/{module}/{call}/{slot}"
        return self._tensors.get_tensor(key) if key in self._keys else None


def load_dump(path: str | Path) -> Dump:
    """A dump directory of one step and rank (DIR/step{S}/rank{R}), or a root holding exactly one."""
    path = Path(path)
    if not (path / "records.jsonl").exists():
        found = sorted(p.parent for p in path.glob("step*/rank*/records.jsonl"))
        if len(found) != 1:
            raise ValueError(f"{path}: expected a dump directory (with records.jsonl) or a root holding one step "
                             f"and rank; found {len(found)} ({[str(p) for p in found[:4]]}); pass one of them")
        path = found[0]
    records = [json.loads(line) for line in (path / "records.jsonl").read_text().splitlines() if line]
    classes = json.loads((path / "modules.json").read_text()) if (path / "modules.json").exists() else {}
    tensors = path / "tensors.safetensors"
    return Dump(path, records, classes, tensors if tensors.exists() else None)


# ---------------------------------------------------------------------------------------- mapping
@dataclass
class Rule:
    pattern: re.Pattern
    replace: str | None = None
    skip: str | None = None
    slots: dict[str, str | None] = field(default_factory=dict)


def load_mapping(name_or_path: str | Path | None) -> list[Rule]:
    """Rules from a YAML file, or the name of a shipped one (`transformers_deepseek_v3`); None: identity."""
    if name_or_path is None:
        return []
    path = Path(name_or_path)
    if not path.exists():
        shipped = resources.files("seekforge.probe") / "mappings" / f"{name_or_path}.yaml"
        if not shipped.is_file():
            names = sorted(p.name.removesuffix(".yaml") for p in (resources.files("seekforge.probe") / "mappings")
                           .iterdir() if p.name.endswith(".yaml"))
            raise ValueError(f"mapping {name_or_path!r}: no such file and no shipped mapping of that name; "
                             f"shipped: {names}")
        path = Path(str(shipped))
    raw = read_config_file(path, "mapping rules")
    rules = []
    for i, rule in enumerate(raw.get("rules", [])):
        if "pattern" not in rule or ("replace" in rule) == ("skip" in rule):
            raise ValueError(f"{path}: rule {i} needs `pattern` and exactly one of `replace` or `skip`: {rule}")
        rules.append(Rule(re.compile(rule["pattern"]), rule.get("replace"), rule.get("skip"), rule.get("slots") or {}))
    return rules


def map_name(rules: list[Rule], name: str) -> tuple[str | None, Rule | None]:
    """A's module name → (B's name or None when skipped/unmatched, the rule that decided)."""
    if not rules:
        return name, None
    for rule in rules:
        if rule.pattern.fullmatch(name):
            return (None if rule.skip else rule.pattern.sub(rule.replace, name, count=1)), rule
    return None, None


# ---------------------------------------------------------------------------------------- metrics
def tensor_metrics(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """The METRICS of a (under test) against b (reference), both flattened, in float64."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    diff = (a - b).abs()
    rel = diff / b.abs().clamp_min(1e-12)
    norms = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    if norms == 0:  # both zero is a match; one zero and one not is not
        cosine = 1.0 if torch.equal(a, b) else 0.0
    else:
        cosine = float(torch.dot(a, b) / norms)
    return {"cosine": cosine, "max_abs_err": float(diff.max()), "max_rel_err": float(rel.max()),
            "within_1e-3": float((rel <= 1e-3).double().mean()), "within_5e-3": float((rel <= 5e-3).double().mean())}


def statistic_diffs(sa: dict, sb: dict) -> dict:
    out = {"norm_a": sa.get("norm"), "norm_b": sb.get("norm"), "nan_a": sa.get("nan"), "nan_b": sb.get("nan"),
           "shape_a": sa["shape"], "shape_b": sb["shape"], "dtype_a": sa["dtype"], "dtype_b": sb["dtype"]}
    for name in ("mean", "max", "min"):
        if sa.get(name) is not None and sb.get(name) is not None:
            out[f"{name}_diff"] = sa[name] - sb[name]
    if sa.get("norm") is not None and sb.get("norm") is not None:
        out["norm_rel_diff"] = abs(sa["norm"] - sb["norm"]) / max(abs(sb["norm"]), 1e-12)
    return out


def judge(row: dict, th: Thresholds) -> str:
    """pass | fail for one compared slot (see the module docstring)."""
    if row.get("nan_a") != row.get("nan_b"):
        return "fail"
    if "cosine" in row:
        ok = row["cosine"] >= th.min_cosine and row["max_abs_err"] <= th.atol_ratio * row["max_abs_b"]
    elif "md5_equal" in row:
        ok = row["md5_equal"]
    else:
        ok = row.get("norm_rel_diff") is not None and row["norm_rel_diff"] <= th.stats_rtol
    return "pass" if ok else "fail"


def compare_slot(dump_a: Dump, dump_b: Dump, ra: dict, rb: dict, slot_a: str, slot_b: str, th: Thresholds) -> dict:
    sa, sb = ra["tensors"][slot_a], rb["tensors"][slot_b]
    row = {"order": ra["order"], "direction": ra["direction"], "module": ra["module"], "reference": rb["module"],
           "call": ra["call"], "slot": slot_a, **statistic_diffs(sa, sb), "note": ""}
    if slot_b != slot_a:
        row["note"] = f"reference slot {slot_b}"
    numel_a, numel_b = _numel(sa["shape"]), _numel(sb["shape"])
    if numel_a != numel_b:
        row.update(status="fail", note=f"{numel_a} vs {numel_b} elements")
        return row
    ta = dump_a.tensor(ra["direction"], ra["module"], ra["call"], slot_a)
    tb = dump_b.tensor(rb["direction"], rb["module"], rb["call"], slot_b)
    if ta is not None and tb is not None:
        row.update(tensor_metrics(ta, tb), max_abs_b=float(tb.double().abs().max()) if tb.numel() else 0.0)
    elif "md5" in sa and "md5" in sb:
        row["md5_equal"] = sa["md5"] == sb["md5"]
    if sa["shape"] != sb["shape"]:
        row["note"] = (row["note"] + "; " if row["note"] else "") + "compared flattened"
    row["status"] = judge(row, th)
    return row


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------------- comparison
@dataclass
class Comparison:
    rows: list[dict]  # one per compared (or skipped) slot, in A's execution order
    first_divergence: dict | None  # {"module", "direction", "call", "order"} or None when all pass
    classes: dict[str, str]  # A's module tree (name → class)

    @property
    def passed(self) -> bool:
        return all(r["status"] != "fail" for r in self.rows)

    def summary(self) -> str:
        counts = {s: sum(r["status"] == s for r in self.rows) for s in ("pass", "fail", "skip")}
        text = f"{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skipped slots"
        if self.first_divergence:
            d = self.first_divergence
            text += f"; first divergence: {d['module']} ({d['direction']}, call {d['call']})"
        return text


def compare_dumps(dump_a: Dump, dump_b: Dump, rules: list[Rule] | None = None,
                  thresholds: Thresholds | None = None) -> Comparison:
    th = thresholds or Thresholds()
    rules = rules or []
    index_b = {(r["direction"], r["module"], r["call"]): r for r in dump_b.records}
    rows = []
    for ra in sorted(dump_a.records, key=lambda r: r["order"]):
        name_b, rule = map_name(rules, ra["module"])
        base = {"order": ra["order"], "direction": ra["direction"], "module": ra["module"], "call": ra["call"]}
        rb = index_b.get((ra["direction"], name_b, ra["call"])) if name_b else None
        if rb is None:
            note = f"skipped: {rule.skip}" if rule and rule.skip else f"no counterpart {name_b or '(unmapped)'}"
            rows.append({**base, "slot": "*", "status": "skip", "note": note})
            continue
        slot_map = rule.slots if rule else {}
        for slot_a in ra["tensors"]:
            slot_b = slot_map.get(slot_a, slot_a)
            if slot_b is None or slot_b not in rb["tensors"]:
                continue  # this slot has no peer (an argument only one side passes)
            rows.append(compare_slot(dump_a, dump_b, ra, rb, slot_a, slot_b, th))
    return Comparison(rows, first_divergence(rows), dump_a.classes)


_RECEIVED = ("input.", "grad_output.")  # what a call was given; the rest is what it produced


def first_divergence(rows: list[dict]) -> dict | None:
    calls: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] != "skip":
            calls.setdefault((row["order"], row["direction"], row["module"], row["call"]), []).append(row)
    ordered = sorted(calls)
    failing = [key for key in ordered if any(r["status"] == "fail" for r in calls[key])]
    if not failing:
        return None
    key = failing[0]

    def inputs_fail(k):
        return any(r["status"] == "fail" and r["slot"].startswith(_RECEIVED) for r in calls[k])

    while inputs_fail(key):
        parent = _enclosing_call(key, ordered)
        if parent is None:
            break
        key = parent
    order, direction, module, call = key
    return {"order": order, "direction": direction, "module": module, "call": call}


def _enclosing_call(key: tuple, ordered: list[tuple]) -> tuple | None:
    """The call of the closest ancestor module that completes after `key` (calls complete children
    first, so that is the one enclosing it)."""
    order, direction, module, _ = key
    parts = module.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        ancestor = ".".join(parts[:depth])
        for other in ordered:
            if other[0] > order and other[1] == direction and other[2] == ancestor:
                return other
    return None


def write_csv(comparison: Comparison, path: str | Path) -> Path:
    path = Path(path)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in comparison.rows:
            writer.writerow(row)
    return path
