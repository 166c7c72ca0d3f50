"""labutils.course.sharding and viz.plot_ownership: ownership tables from records, coverage
checks, the picture, and one real torchrun run of DistributedSampler."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labutils import launch  # noqa: E402
from labutils.errors import InputError  # noqa: E402
from labutils.course.sharding import Coverage, coverage, ownership  # noqa: E402
from labutils.course.viz import plot_ownership  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


RECORDS = [
    {"rank": 1, "setup": "a", "epoch": 0, "items": [1, 4, 7, 0]},
    {"rank": 0, "setup": "a", "epoch": 0, "items": [0, 3, 6, 9]},
    {"rank": 2, "setup": "a", "epoch": 0, "items": [2, 5, 8, 1]},
    {"rank": 0, "setup": "a", "epoch": 1, "items": [9]},
    {"rank": 0, "setup": "b", "epoch": 0, "items": [5]},
    {"rank": 0, "other": "record without items"},
]


def test_ownership_groups_by_epoch_and_rank_sorted():
    own = ownership(RECORDS, setup="a")
    assert own == {0: {0: [0, 3, 6, 9], 1: [1, 4, 7, 0], 2: [2, 5, 8, 1]}, 1: {0: [9]}}
    assert list(own[0]) == [0, 1, 2]
    assert ownership(RECORDS, setup="b") == {0: {0: [5]}}
    assert ownership(RECORDS, setup="none") == {}


def test_ownership_with_another_key():
    recs = [{"rank": 0, "epoch": 0, "shard": [1, 2]}]
    assert ownership(recs, key="shard") == {0: {0: [1, 2]}}


def test_ownership_rejects_records_without_epoch():
    with pytest.raises(InputError, match="'epoch', 'rank'"):
        ownership([{"rank": 0, "items": [1]}])


@pytest.mark.parametrize(
    ("shards", "n", "seen", "missing", "duplicated", "exact"),
    [
        # DistributedSampler, 10 items on 3 ranks: padded with items 0 and 1.
        ({0: [0, 3, 6, 9], 1: [1, 4, 7, 0], 2: [2, 5, 8, 1]}, 10, 12, [], {0: 2, 1: 2}, False),
        # drop_last=True: item 9 is left out.
        ({0: [0, 3, 6], 1: [1, 4, 7], 2: [2, 5, 8]}, 10, 9, [9], {}, False),
        # 12 items on 3 ranks: exact.
        ({0: [8, 9, 2, 1], 1: [0, 7, 10, 11], 2: [5, 4, 3, 6]}, 12, 12, [], {}, True),
        # no sampler: everyone sees everything.
        ({0: [0, 1], 1: [1, 0]}, 2, 4, [], {0: 2, 1: 2}, False),
        # seed=rank: lost and repeated items at once.
        ({0: [0, 1], 1: [1, 2]}, 4, 4, [3], {1: 2}, False),
        ({}, 0, 0, [], {}, True),
        ({0: []}, 2, 0, [0, 1], {}, False),
    ],
)
def test_coverage(shards, n, seen, missing, duplicated, exact):
    c = coverage(shards, n_items=n)
    assert (c.seen, c.missing, c.duplicated, c.exact) == (seen, missing, duplicated, exact)


@pytest.mark.parametrize(
    ("cov", "text"),
    [
        (Coverage(n_items=3, seen=3), "every one of the 3 items seen exactly once"),
        (Coverage(n_items=10, seen=9, missing=[9]), "9 items seen for 10 in the dataset; missing [9]"),
        (Coverage(n_items=10, seen=12, duplicated={0: 2, 1: 2}),
         "12 items seen for 10 in the dataset; seen more than once 0 (2x), 1 (2x)"),
        (Coverage(n_items=2, seen=6, duplicated={0: 3, 1: 3}),
         "6 items seen for 2 in the dataset: every item 3 times"),
    ],
)
def test_coverage_text(cov, text):
    assert str(cov) == text


@pytest.mark.parametrize(
    ("shards", "n", "fragment"),
    [
        ({0: [0, 10]}, 10, r"indices in 0\.\.9"),
        ({0: [-1]}, 10, "indices in"),
        ({0: [1.0]}, 10, "indices in"),
        ({0: "012"}, 10, "a list of item indices"),
        ([[0, 1]], 10, "a dict"),
        ({0: [0]}, -1, "n_items"),
        ({0: [0]}, True, "n_items"),
    ],
)
def test_coverage_rejects(shards, n, fragment):
    with pytest.raises(InputError, match=fragment):
        coverage(shards, n_items=n)


def test_ownership_plot_one_panel_per_epoch_with_duplicates_framed():
    own = {0: {0: [0, 3, 6, 9], 1: [1, 4, 7, 0], 2: [2, 5, 8, 1]},
           1: {0: [0, 3, 6], 1: [1, 4, 7], 2: [2, 5, 8]}}
    fig = plot_ownership(own, n_items=10, title="padding")
    assert len(fig.axes) == 2
    ax0, ax1 = fig.axes
    assert [t.get_text() for t in ax0.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert ax0.get_title() == "epoch 0: repeated [0, 1]"
    assert ax1.get_title() == "epoch 1: missing [9]"
    assert sorted(int(t.get_text()) for t in ax0.texts) == sorted([0, 3, 6, 9, 1, 4, 7, 0, 2, 5, 8, 1])
    framed = sorted(int(t.get_text()) for t, p in zip(ax0.texts, ax0.patches)
                    if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0))
    assert framed == [0, 0, 1, 1]
    assert fig._suptitle.get_text() == "padding"
    assert ax0.get_xlabel() == "position in the rank's shard"


def test_ownership_plot_exact_epoch_title_and_long_shards_stack():
    own = {e: {0: list(range(12)), 1: list(range(12))} for e in range(3)}
    fig = plot_ownership(own, n_items=12)
    assert len(fig.axes) == 3
    w, h = fig.get_size_inches()
    assert w <= 14 and h > w / 3  # panels stacked, one per row
    exact = plot_ownership({0: {0: [1, 0], 1: [2, 3]}}, n_items=4)
    assert exact.axes[0].get_title() == "epoch 0: each item once"


@pytest.mark.parametrize(
    ("own", "n", "fragment"),
    [({}, 3, "at least one epoch"), ([1], 3, "at least one epoch"),
     ({0: {0: [5]}}, 3, r"indices in 0\.\.2")],
)
def test_ownership_plot_rejects(own, n, fragment):
    with pytest.raises(InputError, match=fragment):
        plot_ownership(own, n_items=n)


SAMPLER_RUN = '''
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from labutils.dist import init, report

rank, world_size, _ = init()
for epoch in range(2):
    sampler = DistributedSampler(range(12), shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    report(setup="correct", epoch=epoch, items=list(sampler))
    bad = DistributedSampler(range(12), shuffle=True, seed=rank)
    bad.set_epoch(epoch)
    report(setup="seed=rank", epoch=epoch, items=list(bad))
report(setup="padded", epoch=0, items=list(DistributedSampler(range(10), shuffle=False)))
# No rank leaves before every rank has joined: a script with no collective of its own
# could end on one rank while a peer still connects to it in init_process_group.
dist.barrier()
'''


@pytest.mark.slow
def test_real_ranks_shard_exactly_and_seed_rank_does_not(runs_dir, write_script):
    result = launch(write_script("sampler_run.py", SAMPLER_RUN), nproc=3, display="none",
                    hang_timeout=60, timeout=240)
    assert result.ok, result.summary()
    correct = ownership(result.records, setup="correct")
    assert all(coverage(shards, n_items=12).exact for shards in correct.values())
    assert correct[0] != correct[1]  # set_epoch reshuffles
    broken = ownership(result.records, setup="seed=rank")
    assert not any(coverage(shards, n_items=12).exact for shards in broken.values())
    assert ownership(result.records, setup="padded") == {0: {0: [0, 3, 6, 9], 1: [1, 4, 7, 0], 2: [2, 5, 8, 1]}}
