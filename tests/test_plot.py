"""Plan.plot(): one strip per array leaf, coloured by device; idle devices shown."""
import os
import sys

import numpy as np
import pytest

import dpmini

if "libasan" in os.environ.get("LD_PRELOAD", ""):
    # matplotlib's C++ extensions abort under an LD_PRELOADed ASan runtime
    # (its __cxa_throw interceptor); the plots are pure Python anyway.
    pytest.skip("matplotlib cannot be imported under LD_PRELOAD ASan", allow_module_level=True)
matplotlib = pytest.importorskip("matplotlib")

D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def bars(ax):
    return [p for p in ax.patches if p.get_width() > 0]


def legend_labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_returns_figure_with_one_segment_per_chunk(tmp_path):
    from matplotlib.figure import Figure

    fig = dpmini.explain((np.zeros((5, 3)),), D4).plot()
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(bars(ax)) == 3                      # [2, 2, 1]: three devices get rows
    widths = sorted(round(p.get_width(), 3) for p in bars(ax))
    assert widths == [0.2, 0.4, 0.4]
    labels = legend_labels(ax)
    assert labels[:3] == ["cpu:0", "cpu:1", "cpu:2"]
    assert labels[3] == "cpu:3 (nothing)"          # the idle device is shown
    assert "3 replicas on 4 devices" in ax.get_title()
    path = tmp_path / "plan.png"
    fig.savefig(path)
    assert path.stat().st_size > 1000
    matplotlib.pyplot.close(fig)


def test_plot_colours_follow_devices():
    fig = dpmini.explain((np.zeros(8), np.zeros((2, 8))), D4[:2], in_dims=(0, 1)).plot()
    ax = fig.axes[0]
    segs = bars(ax)
    assert len(segs) == 4
    colours = {tuple(p.get_facecolor()) for p in segs}
    assert len(colours) == 2                        # one colour per device, shared by leaves
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert any("args[1]" in t and "dim 1" in t for t in ticks)
    matplotlib.pyplot.close(fig)


def test_plot_broadcast_weights_truncation_and_errors():
    plan = dpmini.explain((np.zeros((10, 2)), np.zeros(3)), D4, in_dims=(0, None),
                          weights=[1, 2, 3, 4])
    fig = plan.plot(title="custom")
    ax = fig.axes[0]
    assert ax.get_title() == "custom"
    texts = [t.get_text() for t in ax.texts]
    assert any("whole array on each of the 4 replicas" in t for t in texts)
    matplotlib.pyplot.close(fig)

    fig = dpmini.explain((np.zeros(5), np.zeros(1)), D4[:2]).plot()
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("dropped" in t for t in texts)       # the truncated row
    assert any("warning" in t.get_text() for t in fig.texts)
    matplotlib.pyplot.close(fig)

    fig = dpmini.explain((np.zeros(0),), D4[:2]).plot()
    assert any("empty chunk" in t.get_text() for t in fig.axes[0].texts)
    matplotlib.pyplot.close(fig)

    fig = dpmini.explain((np.zeros(4),), D4[:2], kwargs={"k": np.array(1.0)}).plot()
    assert any("error" in t.get_text() for t in fig.texts)
    matplotlib.pyplot.close(fig)


def test_plot_into_given_axes_and_no_leaves():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert dpmini.explain(("no arrays",), D4[:2]).plot(ax=ax) is fig
    plt.close(fig)


def test_idle_devices():
    assert dpmini.explain((np.zeros(9),), D4).idle_devices() == ["cpu:3"]


def test_plot_without_matplotlib_raises_a_clear_importerror(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"matplotlib.*dpmini\[plot\]"):
        dpmini.explain((np.zeros(4),), D4[:2]).plot()
