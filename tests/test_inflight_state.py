"""InFlightState, a tier link's in-flight bookkeeping (hybridkv.inflight_state), on its own:
which computing markers stay in the store and when they go, and how a wait's start is kept.
The store is a real HostTier; marker names are read back from it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.inflight import InFlightRule, Markers
from hybridkv.inflight_state import InFlightState
from hybridkv.models.layout import cache_layout
from hybridkv.tiers import HostTier, ObjectStore

LAYOUT = cache_layout("deepseek-v4-flash")


def new_state(clock=lambda: 0.0):
    tier = HostTier(1 << 20)
    store = ObjectStore(tier, LAYOUT)
    markers = Markers(tier, store.namespace, InFlightRule(wait=5, ttl=50, clock=clock))
    return InFlightState(markers), markers, tier


def live(markers, tier, keys):
    """Per key, whether any of its computing marker slots holds an object in the tier."""
    return [any(tier.contains(markers.names("computing", k))) for k in keys]


def test_a_published_block_loses_its_marker_at_the_second_retire():
    state, markers, tier = new_state()
    markers.put("computing", [11, 12, 13], "a")
    state.marked("a", [11, 12, 13])
    state.published(12)
    state.published(99)  # nobody's marker: nothing to retire
    state.retire()  # the engine may not have put block 12 yet: its marker stays
    assert live(markers, tier, [11, 12, 13]) == [True, True, True]
    state.retire()
    assert live(markers, tier, [11, 12, 13]) == [True, False, True]
    assert state.marked_by(12) is None and state.marked_by(11) == "a"
    state.forget("a")  # freed: the rest go, and only this link's record of them
    assert live(markers, tier, [11, 12, 13]) == [False, False, False]
    assert state.marked_by(11) is None and state.marked_by(13) is None


def test_forget_drops_only_that_requests_markers():
    state, markers, tier = new_state()
    markers.put("computing", [1, 2], "a")
    markers.put("computing", [3], "b")
    state.marked("a", [1, 2])
    state.marked("b", [3])
    state.forget("a")
    assert live(markers, tier, [1, 2, 3]) == [False, False, True]
    assert state.marked_by(3) == "b"


def test_forget_leaves_another_links_marker_of_the_same_block():
    state, markers, tier = new_state()
    other = Markers(tier, markers.namespace, markers.rule)  # another instance on the same store
    assert other.put("computing", [5], "x") == [True]
    assert markers.put("computing", [5], "a") == [True]  # both compute block 5 (a race)
    state.marked("a", [5])
    state.forget("a")
    assert [m.request_id for m in markers.read("computing", [5])[0]] == ["x"]


def test_a_wait_keeps_its_start_across_a_resume_and_ends_when_freed():
    clock = [0.0]
    state, _, _ = new_state(lambda: clock[0])
    assert state.start_wait("a", 7, now=1.0) is True
    clock[0] = 3.0
    assert state.waited("a", 3.0) == 2.0
    state.resuming = True  # the link frees and adds the request again to resume it
    state.forget("a")
    state.resuming = False
    assert "a" not in state.waiting
    assert state.start_wait("a", 8, now=4.0, checkpoint=True) is False  # the same wait, not a new one
    assert state.waited("a", 4.0) == 3.0 and state.waiting["a"] == 8 and "a" in state.checkpoint_waits
    state.forget("a")  # freed for good
    assert state.waited("a", 9.0) == 0.0 and not state.waiting and not state.checkpoint_waits


def test_without_a_rule_nothing_is_on():
    state = InFlightState(None)
    assert not state.on and not state.waiting and state.marked_by(1) is None
    state.forget("a")  # nothing marked: no store call


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 9)), max_size=30, unique_by=lambda x: x[1]),
       st.lists(st.integers(0, 12), max_size=20))
def test_retired_markers_are_exactly_the_published_ones_two_retires_back(marks, published):
    """Against a reference: after publishing some keys and retiring twice, the markers left are
    those put and never published; every request's record agrees with the store."""
    state, markers, tier = new_state()
    for rid, key in marks:
        markers.put("computing", [key], rid)
        state.marked(rid, [key])
    for key in published:
        state.published(key)
    state.retire()
    state.retire()
    gone = set(published)
    keys = [key for _, key in marks]
    assert live(markers, tier, keys) == [key not in gone for key in keys]
    for rid, key in marks:
        assert state.marked_by(key) == (None if key in gone else rid)
