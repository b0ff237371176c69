"""A field given under the wrong section is suggested where it belongs: walked over every field of
the schema, put under every section that lacks it, as a command-line option and as a YAML key."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megapretrain.config import Config, _all_paths, load_config
from megapretrain.errors import ConfigError

FIELDS = _all_paths(Config)
SECTIONS = [f.metadata.get("name", f.name) for f in dataclasses.fields(Config)]


def _misplaced(path):
    """``path``'s field name under each section that has no field (or sub-section) of that name."""
    name = path.rsplit(".", 1)[-1]
    return [f"{s}.{name}" for s in SECTIONS
            if not any(p == f"{s}.{name}" or p.startswith(f"{s}.{name}.") for p in FIELDS)]


@pytest.mark.parametrize("path", FIELDS)
def test_a_field_under_the_wrong_section_suggests_its_own(path, tmp_path):
    wrong_places = _misplaced(path)
    assert wrong_places  # every field is missing from some section
    for wrong in wrong_places:
        with pytest.raises(ConfigError) as raised:
            load_config(None, [f"--{wrong}", "1"])
        assert f"'--{path}'" in str(raised.value), (wrong, str(raised.value))
        section, name = wrong.split(".")
        file = tmp_path / "c.yaml"
        file.write_text(yaml.safe_dump({section: {name: 1}}))
        with pytest.raises(ConfigError) as raised:
            load_config(str(file))
        assert f"'{path}'" in str(raised.value), (wrong, str(raised.value))
