"""The disk tier's ``contains`` answers from an index while no other tier changed the directory.

Two ``DiskTier`` objects on one directory (as two processes would be) put, delete and read in a
random order; after every operation each one's ``contains`` must equal the directory itself
(a file per held name), worked out here from ``os.listdir``. A file removed by hand, not through
a tier, may be answered as held until a ``get`` misses it; then it never is again.
"""

import hashlib
import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers import DiskTier

NAMES = [f"n/{i}" for i in range(6)]


def in_directory(root, names):
    files = set(os.listdir(root))
    return [hashlib.sha256(n.encode()).hexdigest() + ".hkv" in files for n in names]


ops = st.lists(st.tuples(st.sampled_from(["put", "delete", "get"]), st.integers(0, 1),
                         st.lists(st.sampled_from(NAMES), min_size=1, max_size=3)), max_size=25)


@settings(max_examples=40, deadline=None)
@given(ops)
def test_contains_of_two_tiers_on_one_directory_is_the_directory(steps):
    with tempfile.TemporaryDirectory() as root:
        tiers = [DiskTier(root), DiskTier(root)]
        for op, who, names in steps:
            tier = tiers[who]
            if op == "put":
                tier.put([(n, n.encode() * 3) for n in names])
            elif op == "delete":
                tier.delete(names)
            else:
                tier.get(names)
            truth = in_directory(root, NAMES)
            for other in tiers:
                assert other.contains(NAMES) == truth


def test_a_file_removed_by_hand_is_not_held_once_a_get_misses_it(tmp_path):
    tier = DiskTier(tmp_path)
    assert tier.put([("a", b"1"), ("b", b"2")]) == [True, True]
    assert tier.contains(["a", "b", "c"]) == [True, True, False]
    os.unlink(tmp_path / (hashlib.sha256(b"a").hexdigest() + ".hkv"))  # no tier counts this
    assert tier.get(["a", "b"]) == [None, b"2"]  # the directory is the truth for get
    assert tier.contains(["a", "b"]) == [False, True]
    assert tier.put([("a", b"3")]) == [True] and tier.get(["a"]) == [b"3"]
