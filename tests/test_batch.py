"""The step's result classes (``hybridkv.runtime.batch``): frozen dataclasses, which the manager
makes without their ``__init__`` (storing the fields directly), must behave as the dataclasses
they declare, whichever way they were made."""

import dataclasses

import numpy as np
import pytest

from hybridkv.runtime.batch import GroupStep, StepBatch, TableUpdates
from hybridkv.runtime.manager import CacheManager
from test_table_updates import CONFIGS


def test_positional_and_keyword_construction_agree_with_the_declared_fields():
    slots = np.arange(3)
    by_position = GroupStep(None, slots, slots)
    by_name = GroupStep(write_slots=slots, base_pages=slots, block_table=None)
    assert [f.name for f in dataclasses.fields(GroupStep)] == ["block_table", "base_pages", "write_slots"]
    assert by_position.base_pages is slots and by_position.block_table is None
    assert all(a is b for a, b in zip(vars(by_name).values(), vars(by_position).values()))
    assert list(vars(by_name)) == ["block_table", "base_pages", "write_slots"]
    assert repr(by_position).startswith("GroupStep(block_table=None, base_pages=array([0, 1, 2])")


def test_defaults_replace_and_frozenness():
    batch = StepBatch(("a",), np.ones(1), np.arange(2), np.zeros(1), np.zeros(1), {})
    assert batch.table_rows is None and batch.table_updates is None
    updates = TableUpdates(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), (1, 2))
    assert updates.reset is False and updates.widths == (1, 2)
    moved = dataclasses.replace(batch, table_updates=updates)
    assert moved.table_updates is updates and moved.request_ids == ("a",) and batch.table_updates is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.groups = {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        updates.reset = True
    with pytest.raises(TypeError):
        GroupStep(None, None)  # a missing field is still an error


@pytest.mark.parametrize("mode", ["full", "updates"])
def test_a_managers_batch_holds_every_field_as_its_constructor_would(mode):
    specs, pages, ctx, step = CONFIGS["v4"]
    m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    m.add_request("a", prompt_tokens=100, max_new_tokens=10)
    for count in (64, 36, 1):  # a fresh row, a step the kernel reads the cells of, a decode
        batch = m.schedule([("a", count)], block_tables=mode)
        made = [batch, *batch.groups.values()] + ([batch.table_updates] if mode == "updates" else [])
        for obj in made:
            rebuilt = type(obj)(**vars(obj))  # through the generated ``__init__``
            assert list(vars(obj)) == [f.name for f in dataclasses.fields(obj)] == list(vars(rebuilt))
            assert repr(obj) == repr(rebuilt)
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, dataclasses.fields(obj)[0].name, None)
        assert (batch.table_updates is None) == (mode == "full")
