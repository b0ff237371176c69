"""The checkpoint entry (``checkpoint/format.py``'s ``Entry``): every field it declares survives
its tree form, in memory and through a rank file; a malformed entry is one line naming the file;
an entry of another shard's shape or range is refused; and the format's name matches its version
while the names older checkpoints carry still load."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megapretrain.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    LEGACY_FORMAT,
    Entry,
    LazyTensor,
    RankFile,
    metadata,
    rank_file,
    rank_state,
    read_entries,
    read_metadata,
    read_rank_state,
    write_metadata,
    write_rank_state,
)
from megapretrain.errors import CheckpointError

# what an entry declares: a field added to Entry must be added to its tree form and to SAMPLES
FIELDS = ["name", "start", "end", "values", "whole"]


def _samples() -> list[tuple[str, Entry]]:
    """(section, entry) of every form a rank's state holds, each field away from its default."""
    g = torch.Generator().manual_seed(0)
    def r(*shape):
        return torch.randn(*shape, generator=g)

    return [
        ("model", Entry("w.range", 3, 9, {"master": r(6)})),  # zero >= 1
        ("model", Entry.shards("w.whole", {"master": r(2, 3)})),  # zero 0, converted, resharded
        ("optimizer", Entry("m.range", 4, 6, {"exp_avg": r(2), "exp_avg_sq": r(2)})),
        ("optimizer", Entry.shards("m.whole", {"exp_avg": r(3, 2), "exp_avg_sq": r(3, 2)})),
        ("optimizer", Entry.shards("m.none", {})),  # saved before the first step
        ("optimizer", Entry("m.empty", 2, 2, {})),
    ]


def _same(a: Entry, b: Entry, read=lambda entry, key: entry.values[key]) -> None:
    for f in dataclasses.fields(Entry):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "values":
            assert list(x) == list(y), (a.name, f.name)
            for key in x:
                assert torch.equal(x[key], read(b, key)), (a.name, key)
        else:
            assert x == y, (a.name, f.name, x, y)


def test_every_field_of_an_entry_round_trips_through_its_tree(tmp_path):
    assert [f.name for f in dataclasses.fields(Entry)] == FIELDS, \
        "a new Entry field: store it in Entry.tree, read it in Entry.from_tree, add it to _samples"
    samples = _samples()
    for _, entry in samples:  # in memory: the state a load hands over
        assert entry.problem() is None
        _same(entry, read_entries({entry.name: entry.tree()}, "memory")[entry.name])
    # through a rank file: its header describes every entry before any tensor is read
    state = rank_state(iteration=1, consumed_samples=2, optimizer_step=3, scaler=None,
                       model={e.name: e.tree() for s, e in samples if s == "model"},
                       moments={e.name: e.tree() for s, e in samples if s == "optimizer"})
    write_rank_state(rank_file(str(tmp_path), 0), state)
    f = RankFile(str(tmp_path), 0, FORMAT_VERSION)
    try:
        for section, entry in samples:
            def read(e, key, shapes=entry.values):
                return f.flat(e, key, e.start, e.end).view(shapes[key].shape)
            _same(entry, f.entries[section][entry.name], read)
    finally:
        f.close()
    loaded = read_rank_state(str(tmp_path), 0, FORMAT_VERSION)
    for section, entry in samples:
        tree = loaded["model"] if section == "model" else loaded["optimizer"]["params"]
        _same(entry, Entry.from_tree(entry.name, tree[entry.name], "memory"))


def test_a_lazy_entry_is_sized_without_being_read():
    never = LazyTensor(torch.float32, (4, 2), lambda: pytest.fail("read"))
    entry = Entry.shards("w", {"master": never})
    assert (entry.start, entry.end, entry.whole, entry.problem()) == (0, 8, True, None)
    assert entry.tree() is never


@pytest.mark.parametrize("tree, message", [
    ({"start": 5, "end": 3, "master": torch.zeros(0)}, r"holds elements \[5, 3\), which is not a"),
    ({"start": 0, "end": 4, "master": torch.zeros(3)}, r"holds 3 values of master for its range"),
    ({"start": "0", "end": 4, "master": torch.zeros(4)}, r"holds elements \['0', 4\), which"),
    ({"exp_avg": torch.zeros(2, 2), "exp_avg_sq": torch.zeros(5)}, r"holds 5 values of exp_avg_sq"),
    ("abc", r"is 'abc', not a tensor or a range of one"),
], ids=["end_before_start", "shape_mismatch", "start_not_int", "moments_differ", "not_an_entry"])
def test_a_malformed_entry_is_one_line_naming_the_file(tree, message, tmp_path):
    section = "moments" if isinstance(tree, dict) and "exp_avg" in tree else "model"
    entries = {"layers.0.w": tree}
    model, moments = (entries, {}) if section == "model" else ({}, entries)
    state = rank_state(iteration=1, consumed_samples=2, optimizer_step=3, scaler=None, model=model,
                       moments=moments)
    path = rank_file(str(tmp_path), 0)
    write_rank_state(path, state)
    with pytest.raises(CheckpointError) as err:
        read_rank_state(str(tmp_path), 0, FORMAT_VERSION)
    text = str(err.value)
    assert "\n" not in text and "damaged" in text
    assert text.startswith(f"{path}: the entry of 'layers.0.w' ")
    assert len(re.findall(message, text)) == 1, text
    with pytest.raises(CheckpointError, match=message):  # a state handed over in memory: the same
        read_entries(entries, "checkpoint X")


def test_an_entry_of_another_shard_is_refused():
    whole = Entry.shards("w", {"master": torch.arange(6.0).view(2, 3)})
    assert torch.equal(whole.cut("master", 2, 5, (2, 3), "checkpoint X"), torch.arange(2.0, 5.0))
    shape = r"checkpoint X: 'w' has shape \(2, 3\), the model expects \(3, 2\)"
    with pytest.raises(CheckpointError, match=shape):
        whole.cut("master", 0, 6, (3, 2), "checkpoint X")
    part = Entry("w", 4, 8, {"master": torch.arange(4.0)})
    assert torch.equal(part.cut("master", 5, 7, (8,), "checkpoint X"), torch.tensor([1.0, 2.0]))
    with pytest.raises(CheckpointError, match=r"'w' holds elements \[4, 8\) of a tp shard of 6: it "
                                              "was saved from another model"):
        part.cut("master", 4, 6, (6,), "checkpoint X")
    with pytest.raises(CheckpointError, match=r"on this rank, which needs \[2, 6\): it was saved "
                                              "with another parallel.zero"):
        part.cut("master", 2, 6, (8,), "checkpoint X")


@pytest.mark.parametrize("name, version, refused", [
    (FORMAT, FORMAT_VERSION, None),
    (LEGACY_FORMAT, 2, None),  # version 2 as written before the name carried its version
    (LEGACY_FORMAT, 1, None),
    ("megapretrain-per-rank-v2", 1, "does not match its format_version 1; the file is damaged"),
    ("megapretrain-per-rank-v3", 3, "format version 3 is newer than this megapretrain reads .2."),
    ("megapretrain-per-rank-v3", 2, "format version 3 is newer"),
    ("megapretrain-per-rank", 2, "is not 'megapretrain-per-rank-v2'; it was not written by"),
    ("other", 2, "is not 'megapretrain-per-rank-v2'"),
])
def test_the_format_name_matches_its_version(name, version, refused, tmp_path):
    assert FORMAT == f"megapretrain-per-rank-v{FORMAT_VERSION}"
    meta = metadata(iteration=1, world_size=1, layout={"tp": 1, "pp": 1, "dp": 1}, vocab_size=300,
                    padded_vocab=384, files={})
    assert (meta["format"], meta["format_version"]) == (FORMAT, FORMAT_VERSION)
    write_metadata(str(tmp_path), {**meta, "format": name, "format_version": version})
    if refused is None:
        assert read_metadata(str(tmp_path))["format_version"] == version
        return
    with pytest.raises(CheckpointError, match=refused) as err:
        read_metadata(str(tmp_path))
    assert "\n" not in str(err.value) and str(tmp_path / "metadata.json") in str(err.value)
