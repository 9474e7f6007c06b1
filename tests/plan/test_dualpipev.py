"""DualPipeV against DeepSeek's DualPipe README: its action order, bubble and activation memory.

The README's table (same number of PP stages; PP/2 = n devices for DualPipeV) gives the bubble
(PP/2 - 1)(F&B + B - 3W) and PP + 1 activations per device, with F a forward chunk, B a FULL backward
chunk (input gradient I plus weight gradient W: its 1F1B row is (PP - 1)(F + B), its ZB1P row
(PP - 1)(F + B - 2W)), W a weight-gradient chunk and F&B two mutually overlapped forward and backward
chunks. Its picture (4 devices, 10 micro-batches) draws F one cell, B two, I and W one each and an F&B
unit three (F + B): every device row holds 3 (3 + 2 - 3) = 6 empty cells from the step's start to its
end, warm-up included.

Bubble (`simulate`): per rank, the step's period when steps run back to back minus the rank's compute,
the largest over ranks. DualPipeV's F&B units do not add up to the same compute on every rank (rank r
runs 2m - 3n + r + 1 of them, the last rank 2m - 2n - 1: its step 4 starts with a split F0, B1), and
the most idle ranks are the last two.

Derivation, n = 2 ranks (stages 0, 3 on rank 0; 1, 2 on rank 1), I = B - W, O = F&B, O >= B, B >= F,
I <= 2F, W <= I (times are unit ends; each line follows dualpipev.py's 8 steps):
  rank 0: F0(0) F0(1) F0(2) until 3F; F3(0) needs F2(0) (3F): 3F..4F; I3(0) ..4F+I; W ..4F+B;
          F3(1) (F2(1) at 5F) ..5F+B; unit [F0(3)+B3(1)] ..5F+B+O.
  rank 1: F1(0) F2(0) F1(1) F2(1) F1(2) from F to 6F; B2(0) (I3(0) at 4F+I) ..6F+B;
          unit [F2(2)+B1(0)] ..6F+B+O.
  rank 0: unit [F3(2)+B0(0)] needs F2(2), B1(0): idles F. From here each rank's units wait exactly
          for the other's, no idle, until step 5: B3(m-2) (B) then [F3(m-1)+B0(m-3)] waits for rank
          1's last unit: idles O - B; step 6: B3(m-1), I0(m-2) (waits for B1(m-2): no idle when O >= B);
          step 7: W, then I0(m-1) waits for rank 1's I1(m-1): idles I - W; step 8: W ends the step.
  rank 0 idles F + (O - B) + (I - W) = O + F - 2W; rank 1 the same (equal compute for n = 2).
For n ranks the last rank idles (n - 1) F before its first forward (the warm-up: rank 0 ends every
step last, so this recurs each step), n - 1 times O - B before its step-6 backwards (the upstream
backward leaves rank n - 2 inside an F&B unit) and (n - 1)(I - W) at the end (the I0 chain back to
rank 0 still runs): bubble = (n - 1)(F&B + F - 2W) for W <= B - W <= F and max(F, B) <= F&B <= F + B.

This is the README's (n - 1)(F&B + B - 3W) exactly when B - W = F: the README counts the warm-up as
(n - 1)(B - W), which its picture (I and F one cell each) cannot tell apart from (n - 1) F. For
B - W != F the formula does not hold under this reading (nor under "idle inside one step's span",
which already misses it at B - W = F once F&B < F + B): e.g. F = 1, I = W = 0.5, F&B = B = 1 gives
(n - 1)/2, less than the last rank's warm-up wait of n - 1 alone.
"""

import pytest

from seekforge.plan.schedule import Action, pipeline_actions, simulate, uniform_costs


def deepseek_dualpipev_order(n: int, rank: int, m: int) -> list[tuple]:
    """dualpipev.py's DualPipeV.step, steps 1-8, as (kind, phase) units (phase 0 = the rank's stage on
    the way down, 1 = on the way back; "I" = a backward under WeightGradStore, "W" = a _weight_chunk)."""
    units = []
    units += [(("F", 0),)] * ((n - rank - 1) * 2)  # 1: nF0
    units += [(("F", 0),), (("F", 1),)] * (rank + 1)  # 2: nF0F1
    units += [(("I", 1),), (("W", None),), (("F", 1),)] * (n - rank - 1)  # 3: nB1W1F1, zero bubble
    for i in range(m - 2 * n + rank + 1):  # 4: nF0B1F1B0
        first_on_last = i == 0 and rank == n - 1  # "We don't overlap these two chunks"
        units += [(("F", 0),), (("B", 1),)] if first_on_last else [(("F", 0), ("B", 1))]
        units += [(("F", 1), ("B", 0))]
    units += [(("B", 1),), (("F", 1), ("B", 0))] * (n - rank - 1)  # 5: nB1F1B0
    zero_bubble = False
    for i in range(rank + 1):  # 6: nB1B0, the second half under zero bubble
        zero_bubble |= i == (rank + 1) // 2 and rank % 2 == 1
        units.append((("I" if zero_bubble else "B", 1),))
        zero_bubble |= i == (rank + 1) // 2 and rank % 2 == 0
        units.append((("I" if zero_bubble else "B", 0),))
    units += [(("W", None),), (("I", 0),)] * (n - rank - 1)  # 7: nWB0
    units += [(("W", None),)] * (rank + 1)  # 8: nW
    return units


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 6])
def test_torch_dualpipev_order_is_deepseeks(ranks, extra):
    """torch's ScheduleDualPipeV (which the simulator reads) runs dualpipev.py's order, F&B units kept."""
    m = 2 * ranks + extra
    units = pipeline_actions("DualPipeV", ranks, m)
    for rank in range(ranks):
        ours = [tuple((a.kind, _phase(a, rank)) for a in unit) for unit in units[rank]]
        assert ours == deepseek_dualpipev_order(ranks, rank, m)


def _phase(a: Action, rank: int) -> int | None:
    return None if a.kind == "W" else (0 if a.stage == rank else 1)


# (F, B full, W, F&B) with B - W = F and W <= F: DeepSeek's picture; its pair sped up; and unequal values
READMES_REGIME = [(1.0, 2.0, 1.0, 3.0), (1.0, 2.0, 1.0, 2.5), (2.0, 2.5, 0.5, 3.1), (1.5, 2.25, 0.75, 2.4),
                  (0.8, 1.1, 0.3, 1.1)]


@pytest.mark.parametrize("ranks", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("forward,backward,weight,fandb", READMES_REGIME)
def test_dualpipev_bubble_is_deepseeks_formula(ranks, forward, backward, weight, fandb):
    for m in (2 * ranks, 2 * ranks + 5):
        costs = uniform_costs("DualPipeV", ranks, forward, backward - weight, weight)
        r = simulate("DualPipeV", costs, m, overlap=forward + backward - fandb)
        readme = (2 * ranks / 2 - 1) * (fandb + backward - 3 * weight)
        assert r.bubble_time == pytest.approx(readme)
        # the step: the last rank's compute (2m F and B, 2m - 2n - 1 of them in F&B units) plus its bubble
        last_rank_work = 2 * m * (forward + backward) - (2 * m - 2 * ranks - 1) * (forward + backward - fandb)
        assert r.step_time == pytest.approx(last_rank_work + readme)
        assert r.rank_peak([1.0] * (2 * ranks)) == [2 * ranks + 1] * ranks  # README: PP + 1 per device


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("forward,backward,weight,fandb", [(1.0, 1.3, 0.5, 1.8), (2.0, 2.5, 1.0, 3.5),
                                                           (1.0, 1.0, 0.5, 1.0)])
def test_dualpipev_bubble_when_input_grad_is_not_forward(ranks, forward, backward, weight, fandb):
    """B - W < F: the simulated bubble is (n-1)(F&B + F - 2W), above the README's (n-1)(F&B + B - 3W) by
    (n-1)(F - (B - W)): the warm-up is n-1 forwards, not n-1 input-gradient backwards."""
    r = simulate("DualPipeV", uniform_costs("DualPipeV", ranks, forward, backward - weight, weight), 2 * ranks + 3,
                 overlap=forward + backward - fandb)
    assert r.bubble_time == pytest.approx((ranks - 1) * (fandb + forward - 2 * weight))
    readme = (ranks - 1) * (fandb + backward - 3 * weight)
    assert r.bubble_time - readme == pytest.approx((ranks - 1) * (forward - (backward - weight)))
    assert min(e.start for e in r.events if e.rank == ranks - 1) == pytest.approx((ranks - 1) * forward)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_readme_formula_is_below_the_last_ranks_warm_up(ranks):
    """F = 1, I = W = 0.5, F&B = B = 1: the README's (n-1)(1 + 1 - 1.5) is less than the n-1 the last
    rank waits for its first forward in every step, whatever else the schedule does."""
    r = simulate("DualPipeV", uniform_costs("DualPipeV", ranks, 1.0, 0.5, 0.5), 2 * ranks + 3, overlap=1.0)
    last = [e for e in r.events if e.rank == ranks - 1]
    assert max(e.end for e in r.events if e.rank == 0) == pytest.approx(r.step_time)  # rank 0 ends the step
    warm_up, readme = min(e.start for e in last), (ranks - 1) * (1 + 1 - 1.5)
    assert warm_up == pytest.approx(ranks - 1) and warm_up > readme
    assert r.bubble_time == pytest.approx((ranks - 1) * (1 + 1 - 2 * 0.5))


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_dualpipev_as_torch_runs_it(ranks):
    """torch runs an F&B unit's forward and backward one after the other (overlap 0: F&B = F + B); with
    F = I = W = 1 the README gives (n-1)(3 + 2 - 3) = 2(n-1)."""
    r = simulate("DualPipeV", uniform_costs("DualPipeV", ranks, 1.0, 1.0, 1.0), 2 * ranks + 4)
    assert r.bubble_time == pytest.approx(2 * (ranks - 1))
    pairs = [e for e in r.events if e.overlapped]
    assert pairs and all(e.end - e.start == pytest.approx(1.0 if e.action.kind == "F" else 2.0) for e in pairs)


def test_overlap_is_checked():
    costs = uniform_costs("DualPipeV", 2, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="must lie in"):
        simulate("DualPipeV", costs, 4, overlap=1.5)  # F&B = 1.5 < B = 2
    with pytest.raises(ValueError, match="has none"):
        simulate("1F1B", uniform_costs("1F1B", 2, 1.0, 1.0, 1.0), 4, overlap=0.5)
