"""DualPipeV's simulated bubble against DeepSeek's DualPipe README formula, (PP/2 - 1)(F&B + B - 3W).

    python benchmarks/plan_dualpipev.py

No timing: plan/schedule.py simulates torch's DualPipeV order (DeepSeek's dualpipev.py steps) with F&B
units, for the README's picture values and sped-up / unequal ones. B is the full backward (I + W). The
last column is the closed form the simulator follows for W <= B - W <= F (tests/plan/test_dualpipev.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seekforge.plan.schedule import simulate, uniform_costs  # noqa: E402

# (F, B, W, F&B): the README picture's cells; its F&B sped up; unequal values with B - W = F; then B - W < F
CASES = [(1.0, 2.0, 1.0, 3.0), (1.0, 2.0, 1.0, 2.5), (2.0, 2.5, 0.5, 3.1), (1.5, 2.25, 0.75, 2.4),
         (1.0, 1.3, 0.5, 1.8), (1.0, 1.0, 0.5, 1.0)]


def main() -> None:
    print(f"{'F':>5}{'B':>6}{'W':>6}{'F&B':>6}  B-W=F  ranks  micro-batches  simulated  README  (n-1)(F&B+F-2W)")
    for forward, backward, weight, fandb in CASES:
        for ranks in (2, 3, 4, 8, 16):
            m = 2 * ranks + 4
            r = simulate("DualPipeV", uniform_costs("DualPipeV", ranks, forward, backward - weight, weight), m,
                         overlap=forward + backward - fandb)
            readme = (ranks - 1) * (fandb + backward - 3 * weight)
            general = (ranks - 1) * (fandb + forward - 2 * weight)
            same = "yes" if backward - weight == forward else "no"
            print(f"{forward:>5}{backward:>6}{weight:>6}{fandb:>6}  {same:>5}{ranks:>7}{m:>15}"
                  f"{r.bubble_time:>11.4g}{readme:>8.4g}{general:>17.4g}")


if __name__ == "__main__":
    main()
