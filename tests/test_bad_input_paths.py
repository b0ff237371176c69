"""Paths are never taken literally: every path field of the config schema (``_f(path=True)``, found
by walking the schema, so a new one is covered at once) has ``~`` and environment variables
expanded, and an unset variable is one line naming the field; a data prefix given as one of its
files is read as its prefix, and one missing its ``_text_document`` is one line naming the prefix
to use; ``preprocess_data.py --output-prefix`` never doubles the suffix nor writes a file named
after a directory."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import yaml

from megapretrain.commands import preprocess_data
from megapretrain.config import Config, load_config
from megapretrain.errors import ConfigError
from megapretrain.train import main

from conftest import assert_one_line
from helpers import run_argv


def _all_fields(node, where=""):
    """(dotted name, field) of every field of the schema under ``node``."""
    for f in dataclasses.fields(node):
        value, path = getattr(node, f.name), f"{where}.{f.metadata.get('name', f.name)}".lstrip(".")
        if dataclasses.is_dataclass(value):
            yield from _all_fields(value, path)
        else:
            yield path, f


FIELDS = dict(_all_fields(Config()))
PATHS = {path: f for path, f in FIELDS.items() if f.metadata.get("path")}


def test_every_field_that_names_a_file_is_marked_as_a_path():
    assert {"run.dir", "data.paths", "data.tokenizer.model", "data.cache_dir",
            "checkpoint.load"} <= set(PATHS)
    for node_path, f in FIELDS.items():
        if f.name.endswith(("dir", "path", "paths", "file", "prefix")):
            assert node_path in PATHS, f"{node_path} names a file but is not _f(path=True)"


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, {"async": "async_"}.get(part, part))
    return cfg


@pytest.mark.parametrize("form", ["~/{}", "$MPT_PLACE/{}", "${{MPT_PLACE}}/{}"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_field_expands_home_and_variables(path, form, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MPT_PLACE", str(tmp_path / "home"))
    given, want = form.format("x"), str(tmp_path / "home" / "x")
    is_list = isinstance(_get(Config(), path), list)
    section, *rest = path.split(".")
    tree: dict = {}
    node = tree
    for part in [section, *rest[:-1]]:
        node = node.setdefault(part, {})
    node[rest[-1]] = [given] if is_list else given
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump(tree))
    expect = [want] if is_list else want
    assert _get(load_config(str(file)), path) == expect  # from YAML
    override = f"['{given}']" if is_list else given
    assert _get(load_config(None, [f"--{path}", override]), path) == expect  # from the command line

    monkeypatch.delenv("MPT_PLACE")
    if "MPT_PLACE" in given:
        with pytest.raises(ConfigError, match=f"^{path}=.*MPT_PLACE is not set"):
            load_config(str(file))


def test_a_run_dir_under_home_is_not_a_directory_named_tilde(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(run_argv("~/run", corpus, 1)) == 0
    assert os.path.isdir(tmp_path / "home" / "run" / "checkpoints")
    assert not os.path.exists(tmp_path / "~")


# -- data prefixes ---------------------------------------------------------------------------------


@pytest.fixture
def data(corpus, tmp_path):
    """A copy of the corpus as ``DIR/code_text_document.bin/.idx``."""
    folder = tmp_path / "data"
    folder.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus + suffix, folder / f"code_text_document{suffix}")
    return folder


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_data_path_given_as_one_of_its_files_is_read_as_its_prefix(suffix, data, tmp_path):
    assert main(run_argv(tmp_path / "run", str(data / f"code_text_document{suffix}"), 1)) == 0


def test_a_data_prefix_without_its_suffix_names_the_one_to_use(data, tmp_path, capsys):
    status = main(run_argv(tmp_path / "run", str(data / "code"), 1))
    assert_one_line(capsys, status, 2, f"did you mean data.paths [{data / 'code_text_document'}]")


# -- preprocess_data.py --output-prefix -------------------------------------------------------------


def _preprocess(tmp_path, prefix):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n{"text": "world"}\n')
    return preprocess_data.main(["--input", str(source), "--output-prefix", prefix,
                                 "--tokenizer-type", "ByteTokenizer"])


def test_an_output_prefix_ending_in_the_suffix_is_not_doubled(tmp_path, unchanged):
    assert _preprocess(tmp_path, "out/corpus_text_document") == 0
    assert sorted(os.listdir(tmp_path / "out")) == [f"corpus_text_document{s}" for s in
                                                    (".bin", ".idx", ".summary.json")]


@pytest.mark.parametrize("case", ["slash", "directory", "under_a_file"])
def test_an_output_prefix_that_is_no_file_prefix_is_one_line(case, tmp_path, capsys, unchanged):
    (tmp_path / "out").mkdir()
    (tmp_path / "a_file").write_text("mine")
    prefix = {"slash": "new/", "directory": "out", "under_a_file": "a_file/corpus"}[case]
    unchanged()
    status = _preprocess(tmp_path, prefix)
    assert_one_line(capsys, status, 1, f"--output-prefix {prefix}",
                    "is a file" if case == "under_a_file" else "is a directory")
    assert not os.path.exists(tmp_path / "new")
