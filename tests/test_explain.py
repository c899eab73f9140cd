"""dpmini.explain: the plan must describe exactly what DataParallel then does
(replica count, rows per device, warnings, errors), without copying anything."""
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dpmini

D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def test_plan_table():
    plan = dpmini.explain((np.zeros((10, 3)),), D4)
    assert isinstance(plan, dpmini.Plan)
    assert plan.replicas == 4
    assert [str(d) for d in plan.devices] == D4
    assert plan.error is None and plan.warnings == []
    (leaf,) = plan.leaves
    assert leaf["path"] == "args[0]"
    assert list(leaf["sizes"]) == [3, 3, 3, 1]
    assert list(leaf["starts"]) == [0, 3, 6, 9]
    assert list(leaf["nbytes"]) == [72, 72, 72, 24]
    text = str(plan)
    for d in D4:
        assert d in text
    assert "(3, 3)" in text and "(1, 3)" in text


def test_plan_idle_device_and_shared_leaves():
    plan = dpmini.explain((np.zeros(9), "tag"), D4, kwargs={"flag": True})
    assert plan.replicas == 3
    assert list(plan.leaves[0]["sizes"]) == [3, 3, 3, 0]
    assert "no replica" in str(plan)
    assert any("args[1]" in p for p in plan.shared)
    assert any("flag" in p for p in plan.shared)


def test_plan_list_is_one_argument_and_none_is_no_argument():
    plan = dpmini.explain([np.zeros(4), np.zeros(4)], D4[:2])
    assert [leaf["path"] for leaf in plan.leaves] == ["args[0][0]", "args[0][1]"]
    assert dpmini.explain(None, D4).replicas == 1  # a call without arguments runs once


def test_plan_records_truncation_warning():
    plan = dpmini.explain((np.zeros(5), np.zeros(1)), D4[:2])
    assert plan.replicas == 1
    assert len(plan.warnings) == 1 and "args[0]" in plan.warnings[0]
    assert plan.error is None


def test_plan_records_errors_instead_of_raising():
    plan = dpmini.explain((np.zeros(4),), D4[:2], kwargs={"k": np.array(3.0)})
    assert plan.error is not None and "1-dimensional" in plan.error
    assert "error" in str(plan)
    strict = dpmini.explain((np.zeros(5), np.zeros(1)), D4[:2], strict=True)
    assert strict.error is not None and strict.replicas == 0
    out_of_range = dpmini.explain((np.zeros(4),), D4[:2], dim=3)
    assert out_of_range.error is not None and "Dimension out of range" in out_of_range.error


def test_plan_bad_devices_raise():
    with pytest.raises(ValueError, match=r"device_ids"):
        dpmini.explain((np.zeros(4),), ["cpu:0", "cpu"])


def test_plan_copies_nothing():
    before = [dpmini.memory_allocated(d) for d in D4]
    dpmini.explain((np.zeros((1000, 1000)),), D4)
    assert [dpmini.memory_allocated(d) for d in D4] == before


@st.composite
def calls(draw):
    k = draw(st.integers(1, 5))
    devices = [f"cpu:{i}" for i in range(k)]
    npos = draw(st.integers(0, 3))
    pos = tuple(np.zeros((draw(st.integers(0, 12)), 2)) if draw(st.booleans()) else "s" for _ in range(npos))
    kw = {f"k{j}": np.zeros(draw(st.integers(0, 12))) for j in range(draw(st.integers(0, 2)))}
    if draw(st.booleans()):
        kw["flag"] = True
    return devices, pos, kw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_plan_matches_what_dataparallel_does(call):
    devices, pos, kw = call
    plan = dpmini.explain(pos, devices, kwargs=kw)
    assert plan.error is None
    seen = []
    lock = threading.Lock()

    def module(*args, **kwargs):
        with lock:
            seen.append(([a.shape[0] for a in args if isinstance(a, np.ndarray)],
                         {k: v.shape[0] for k, v in kwargs.items() if isinstance(v, np.ndarray)}))
        return np.zeros(1)

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        dpmini.DataParallel(module, device_ids=devices)(*pos, **kw)
    split_warnings = [w for w in rec if issubclass(w.category, dpmini.SplitWarning)]
    assert len(seen) == plan.replicas
    assert bool(split_warnings) == bool(plan.warnings)
    # rows per replica, per leaf, as planned
    for leaf in plan.leaves:
        planned = sorted(leaf["sizes"][: plan.replicas])
        path = leaf["path"]
        if path.startswith("args["):
            idx = [i for i, a in enumerate(pos) if isinstance(a, np.ndarray)].index(int(path[5:-1]))
            got = sorted(s[0][idx] for s in seen)
        else:
            key = path[len("kwargs['"):-2]
            got = sorted(s[1][key] for s in seen)
        assert got == planned
