import pytest

from hybridkv.spec import CacheGroupSpec, PagedCacheGroupSpec


def test_page_tokens_is_rows_times_stride():
    spec = CacheGroupSpec("g", "full_history", rows_per_page=2, entry_stride_tokens=128)
    assert spec.page_tokens == 256
    assert spec.family == "history"
    assert PagedCacheGroupSpec is CacheGroupSpec


def test_frozen():
    spec = CacheGroupSpec("g", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")
    with pytest.raises(AttributeError):
        spec.rows_per_page = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(retention="sliding_window", sliding_window_tokens=None), "required"),
        (dict(retention="sliding_window", sliding_window_tokens=0), "positive"),
        (dict(retention="sliding_window", sliding_window_tokens=-3), "positive"),
        (dict(retention="full_history", sliding_window_tokens=8), "must be None"),
        (dict(retention="ring"), "retention"),
        (dict(family="other"), "family"),
        (dict(rows_per_page=0), "rows_per_page"),
        (dict(entry_stride_tokens=-1), "entry_stride_tokens"),
        (dict(rows_per_page=True), "rows_per_page"),
        (dict(rows_per_page=2.0), "rows_per_page"),
        (dict(group_id=""), "group_id"),
    ],
)
def test_invalid_combinations_raise(kwargs, match):
    base = dict(group_id="g", retention="full_history", rows_per_page=4, entry_stride_tokens=1)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CacheGroupSpec(**base)


def test_checkpoint_window_tokens_is_a_sliding_groups_part_of_its_window():
    spec = CacheGroupSpec("s", "sliding_window", 4, 1, sliding_window_tokens=8, family="state",
                          checkpoint_window_tokens=4)
    assert spec.checkpoint_window_tokens == 4
    assert CacheGroupSpec("s", "sliding_window", 4, 1, sliding_window_tokens=8).checkpoint_window_tokens is None
    assert CacheGroupSpec("s", "sliding_window", 4, 1, sliding_window_tokens=8,
                          checkpoint_window_tokens=0).checkpoint_window_tokens == 0
    for bad, match in [(9, "exceeds the window"), (-1, "non-negative"), (2.0, "integer")]:
        with pytest.raises(ValueError, match=match):
            CacheGroupSpec("s", "sliding_window", 4, 1, sliding_window_tokens=8, checkpoint_window_tokens=bad)
    with pytest.raises(ValueError, match="sliding groups only"):
        CacheGroupSpec("h", "full_history", 4, 1, checkpoint_window_tokens=0)
