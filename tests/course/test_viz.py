"""labutils.course.viz: each plot draws what it promises and rejects input it cannot draw."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labutils.errors import InputError  # noqa: E402
from labutils.course.timing import AlphaBeta, fit_alpha_beta  # noqa: E402
from labutils.course.viz import plot_bandwidth  # noqa: E402

SIZES = [8, 128, 2048, 32768, 524288, 8388608]


def model_times(alpha, beta):
    return [alpha + s / beta for s in SIZES]


@pytest.fixture
def series():
    return {
        "library": (SIZES, model_times(5e-5, 2e9)),
        "ring": (SIZES, model_times(2e-4, 1e9)),
        "naive ring": (SIZES, model_times(1e-4, 3e8)),
    }


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_bandwidth_plot_has_two_labelled_log_panels(series):
    fig = plot_bandwidth(series, world_size=4)
    ax_t, ax_bw = fig.axes
    for ax in (ax_t, ax_bw):
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert "bytes" in ax.get_xlabel()
        assert ax.get_title()
        assert [t.get_text() for t in ax.get_legend().get_texts()][:1] == ["library"]
    assert "seconds" in ax_t.get_ylabel()
    assert ax_bw.get_ylabel() == "busbw (GB/s) = algbw × 1.5"
    assert fig._suptitle.get_text() == "all_reduce on 4 ranks"
    assert fig.get_size_inches()[0] >= 10


def test_bandwidth_plot_draws_busbw_values(series):
    fig = plot_bandwidth(series, world_size=4)
    ax_bw = fig.axes[1]
    library = ax_bw.get_lines()[0]
    size, seconds = SIZES[-1], model_times(5e-5, 2e9)[-1]
    assert library.get_ydata()[-1] == pytest.approx(size / seconds * 1.5 / 1e9)


def test_bandwidth_plot_draws_fits_in_legend(series):
    fits = {name: fit_alpha_beta(*pair) for name, pair in series.items()}
    fig = plot_bandwidth(series, world_size=2, fits=fits, title="mine")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(labels) == 6
    assert "ring fit: α=200 µs, β=1 GB/s" in labels
    assert fig._suptitle.get_text() == "mine"
    assert fig.axes[1].get_ylabel() == "busbw (GB/s) = algbw × 1"


def test_bandwidth_plot_in_the_units_of_the_tables_beside_it(series):
    fits = {name: fit_alpha_beta(*pair) for name, pair in series.items()}
    fig = plot_bandwidth(series, world_size=4, fits=fits, time_unit="ms", rate_unit="MB/s")
    ax_t, ax_bw = fig.axes
    assert ax_t.get_ylabel() == "time per call (ms)"
    assert ax_bw.get_ylabel() == "busbw (MB/s) = algbw × 1.5"
    size, seconds = SIZES[-1], model_times(5e-5, 2e9)[-1]
    assert ax_t.get_lines()[0].get_ydata()[-1] == pytest.approx(seconds * 1e3)
    assert ax_bw.get_lines()[0].get_ydata()[-1] == pytest.approx(size / seconds * 1.5 / 1e6)
    labels = [t.get_text() for t in ax_t.get_legend().get_texts()]
    assert "ring fit: α=0.200 ms, β=1000 MB/s" in labels


@pytest.mark.parametrize("unit", [{"time_unit": "min"}, {"rate_unit": "Gbit/s"}])
def test_bandwidth_plot_refuses_a_unit_it_has_not(series, unit):
    with pytest.raises(InputError, match=next(iter(unit))):
        plot_bandwidth(series, world_size=4, **unit)


def test_bandwidth_plot_other_collective(series):
    fig = plot_bandwidth(series, world_size=4, collective="all_gather")
    assert fig.axes[1].get_ylabel() == "busbw (GB/s) = algbw × 0.75"


def test_bandwidth_plot_single_size():
    fig = plot_bandwidth({"one": ([1024], [1e-4])}, world_size=2)
    assert len(fig.axes) == 2


@pytest.mark.parametrize(
    ("series", "kwargs", "fragment"),
    [
        ({}, {}, "series: expected a dict"),
        ([([8], [1.0])], {}, "series: expected a dict"),
        ({"a": [8, 16]}, {}, "expected a pair"),
        ({"a": ([8, 16], [1.0])}, {}, "2 sizes, 1 times"),
        ({"a": ([], [])}, {}, "non-empty"),
        ({"a": ([8], [1.0], [2])}, {}, "a pair"),
        ({"a": ([0, 16], [1.0, 2.0])}, {}, "sizes: expected numbers > 0"),
        ({"a": ([8, 16], [1.0, -2.0])}, {}, "seconds: expected numbers > 0"),
        ({"a": ([8, 16], [1.0, None])}, {}, "seconds"),
        ({"a": ([8, 16], [1.0, 2.0])}, {"world_size": 0}, "world_size"),
        ({"a": ([8, 16], [1.0, 2.0])}, {"collective": "allreduce"}, "collective"),
        ({"a": ([8, 16], [1.0, 2.0])}, {"fits": {"b": AlphaBeta(1e-4, 1e9)}}, "fits: expected names"),
        ({"a": ([8, 16], [1.0, 2.0])}, {"fits": {"a": (1e-4, 1e9)}}, "fits: expected AlphaBeta"),
    ],
)
def test_bandwidth_plot_rejects(series, kwargs, fragment):
    kwargs.setdefault("world_size", 4)
    with pytest.raises(InputError, match=fragment):
        plot_bandwidth(series, **kwargs)
