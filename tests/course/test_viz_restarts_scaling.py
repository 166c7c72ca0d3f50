"""labutils.course.viz plots of lessons 05 and 06: loss across restarts, scaling efficiency."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labutils.errors import InputError  # noqa: E402
from labutils.course.viz import plot_loss_across_restarts, plot_scaling  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def records(attempts):
    """[(restart, first_step, last_step, world_size)] -> records of ranks 0 and 1."""
    return [{"rank": rank, "step": s, "loss": 1.0 / (s + 1) + rank, "restart": restart,
             "world_size": world}
            for restart, lo, hi, world in attempts for s in range(lo, hi + 1)
            for rank in range(world)]


def test_one_line_per_attempt_with_world_size_and_a_marker_at_each_resume():
    fig = plot_loss_across_restarts(records([(0, 0, 13, 2), (1, 12, 30, 1)]),
                                    reference=records([(0, 0, 30, 2)]))
    (ax,) = fig.axes
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert labels == ["uninterrupted run (on top)", "restart 0: steps 0-13, world size 2",
                      "restart 1: steps 12-30, world size 1"]
    resume_markers = [line for line in ax.get_lines() if line.get_label().startswith("_")]
    assert len(resume_markers) == 1 and resume_markers[0].get_xdata()[0] == 11.5
    drawn = ax.get_lines()[1]
    assert list(drawn.get_ydata()) == [1.0 / (s + 1) for s in range(14)]  # rank 0 only


@pytest.mark.parametrize("bad", [None, "records", [], [{"rank": 0, "step": 1}],
                                 [{"rank": 1, "step": 0, "loss": 1.0}]])
def test_loss_plot_rejects_records_without_rank_0_losses(bad):
    with pytest.raises(InputError, match="records"):
        plot_loss_across_restarts(bad)


def test_scaling_plot_draws_time_and_efficiency_against_ideal():
    fig = plot_scaling({"strong": {1: 0.1, 2: 0.06, 4: 0.05}, "weak": {1: 0.05, 2: 0.06, 4: 0.1}})
    ax_t, ax_e = fig.axes
    strong_eff = next(line for line in ax_e.get_lines() if line.get_label() == "strong")
    assert list(strong_eff.get_ydata()) == pytest.approx([1.0, 0.1 / 0.12, 0.1 / 0.2])
    weak_eff = next(line for line in ax_e.get_lines() if line.get_label() == "weak")
    assert list(weak_eff.get_ydata()) == pytest.approx([1.0, 0.05 / 0.06, 0.5])
    ideal = next(line for line in ax_t.get_lines() if line.get_label() == "strong: ideal")
    assert list(ideal.get_ydata()) == pytest.approx([100, 50, 25])
    assert ax_t.get_xlabel() == "ranks" and "ms" in ax_t.get_ylabel()


@pytest.mark.parametrize("bad", [None, {}, {"fast": {1: 0.1}}, {"strong": {2: 0.1}},
                                 {"strong": {1: 0}}, {"weak": {1: 0.1, 0: 0.1}}])
def test_scaling_plot_rejects_bad_measurements(bad):
    with pytest.raises(InputError):
        plot_scaling(bad)
