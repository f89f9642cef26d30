"""The documentation site: the config reference is what the schema generates now, every schema key is described,
and mkdocs builds the site with --strict (every nav entry, link and anchor resolves)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    """docs/gen_config_reference.py, imported from its path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_what_the_schema_generates_now():
    generator = load_generator()
    written = (ROOT / "docs" / "config-reference.md").read_text(encoding="utf-8")
    assert written == generator.render(generator.load_schema()), (
        "docs/config-reference.md differs from what schemas/config.schema.yaml generates (edited by hand, or the "
        "schema changed since): run `python docs/gen_config_reference.py` and commit the page"
    )


def test_every_schema_key_has_a_description():
    generator = load_generator()
    missing = generator.missing_descriptions(generator.load_schema())
    assert not missing, f"keys without a description in schemas/config.schema.yaml: {', '.join(missing)}"


def test_the_reference_lists_every_key_with_its_default(tmp_path):
    """The generator itself: nested keys and list items are listed, and a missing description is found."""
    generator = load_generator()
    schema = {
        "type": "object",
        "required": ["a"],
        "properties": {
            "a": {
                "type": "object",
                "description": "block a",
                "properties": {
                    "n": {"type": ["integer", "null"], "minimum": 1, "default": None, "description": "a count"},
                    "items": {
                        "type": "array",
                        "description": "a list",
                        "items": {"type": "object", "properties": {"uri": {"type": "string"}}},
                    },
                    "kinds": {"type": "array", "items": {"enum": ["x", "y"]}, "default": ["x"], "description": "k"},
                },
            }
        },
    }
    assert generator.missing_descriptions(schema) == ["a.items[].uri"]
    page = generator.render(schema)
    for heading in ("## `a`", "### `a.n`", "### `a.items`", "### `a.items[].uri`", "### `a.kinds`"):
        assert heading in page
    assert "- **allowed:** ≥ 1" in page and '- **default:** `["x"]`' in page and "each item one of" in page


def test_mkdocs_builds_the_site_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed in this environment (requirements.txt pins it; `make install`)")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config.get("strict", True) is not False
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's end-of-life banner, not a build warning
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "config-reference" / "index.html").exists()
