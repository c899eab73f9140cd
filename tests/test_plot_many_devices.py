"""Plan.plot() with many devices (the legend fits) and of a plan that would raise
(no device colours)."""
import os
import warnings

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]


# --- Plan.plot() with many devices, and of a plan that would raise -----

def _matplotlib():
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan")
    return pytest.importorskip("matplotlib")


@pytest.mark.parametrize("ndev,rows", [(17, 9), (64, 100), (256, 1000)])
def test_plot_legend_fits_with_many_devices(ndev, rows):
    mpl = _matplotlib()
    plan = dpmini.explain(np.zeros((rows, 3)), [f"cpu:{i}" for i in range(ndev)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # no "Tight layout not applied"
        fig = plan.plot()
        fig.canvas.draw()
    ax = fig.axes[0]
    leg = ax.get_legend().get_window_extent()
    fb = fig.bbox
    assert fb.x0 <= leg.x0 and leg.x1 <= fb.x1 and fb.y0 <= leg.y0 and leg.y1 <= fb.y1
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    idle = ndev - plan.replicas
    if idle > 1:                          # the idle devices share one entry
        assert labels[-1] == f"cpu:{plan.replicas}..cpu:{ndev - 1}: nothing ({idle} devices)"
    assert len(labels) == plan.replicas + (1 if idle > 1 else idle)
    mpl.pyplot.close(fig)


def test_plot_of_an_error_plan_draws_no_device_colours():
    mpl = _matplotlib()
    plan = dpmini.explain((np.zeros(4), np.zeros(1)), D2, strict=True)
    assert plan.error and plan.replicas == 0
    fig = plan.plot()
    ax = fig.axes[0]
    device_colours = {tuple(c) for c in (mpl.colormaps["tab10"](i) for i in range(2))}
    assert not [p for p in ax.patches if tuple(p.get_facecolor()) in device_colours]
    assert len(ax.patches) == 2 and all(p.get_hatch() == ".." for p in ax.patches)
    assert ax.get_title().startswith("the call would raise: ")
    assert "strict=True" in ax.get_title().replace("\n", " ")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ["cpu:0 (nothing)", "cpu:1 (nothing)"]
    mpl.pyplot.close(fig)
