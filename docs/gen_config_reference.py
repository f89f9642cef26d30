"""Write docs/config-reference.md from schemas/config.schema.yaml.

The schema is the one home of every config key's type, default, bounds and description; this page is generated from
it so that it cannot drift. Pure Python + PyYAML (no import of the pretrain_bench package), so it runs anywhere:

    python docs/gen_config_reference.py            # rewrite docs/config-reference.md
    python docs/gen_config_reference.py --check    # exit 1 when the page is stale or a key lacks a description

tests/unit/test_docs.py runs the same checks.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "schemas" / "config.schema.yaml"
PAGE = ROOT / "docs" / "config-reference.md"


@dataclass(frozen=True)
class Key:
    """One config key as the reference lists it."""

    path: str  # dotted, array items as `[]`: corpus.sources[].uri
    node: dict  # its schema node
    required: bool  # its parent lists it under `required`


def keys(schema: dict) -> list[Key]:
    """Every key of the schema, depth first in the schema's own order (nested objects and array items included)."""
    found: list[Key] = []

    def walk(node: dict, prefix: str) -> None:
        required = set(node.get("required", []))
        for name, child in node.get("properties", {}).items():
            path = f"{prefix}{name}"
            found.append(Key(path, child, name in required))
            walk(child, f"{path}.")
            items = child.get("items")
            if isinstance(items, dict) and items.get("properties"):
                walk(items, f"{path}[].")

    walk(schema, "")
    return found


def missing_descriptions(schema: dict) -> list[str]:
    """The dotted keys whose schema node has no (or an empty) description."""
    return [key.path for key in keys(schema) if not str(key.node.get("description", "")).strip()]


def _types(node: dict) -> list[str]:
    declared = node.get("type")
    if declared is None:
        return []
    return declared if isinstance(declared, list) else [declared]


def type_text(node: dict) -> str:
    """`integer or null`, `array of string`, `mapping of string → string`."""
    parts = []
    for name in _types(node):
        if name == "array" and isinstance(node.get("items"), dict):
            inner = type_text(node["items"]) or "any"
            parts.append(f"array of {inner}")
        elif name == "object" and isinstance(node.get("additionalProperties"), dict):
            parts.append(f"mapping of string → {type_text(node['additionalProperties']) or 'any'}")
        else:
            parts.append(name)
    return " or ".join(parts)


def literal(value: object) -> str:
    """A schema value as YAML/JSON writes it, in a code span."""
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def bounds_text(node: dict) -> list[str]:
    """Allowed values and bounds of one node (not of its items)."""
    out = []
    if "enum" in node:
        out.append("one of " + ", ".join(literal(v) for v in node["enum"]))
    for word, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if word in node:
            out.append(f"{sign} {node[word]}")
    if "minLength" in node:
        out.append(f"at least {node['minLength']} characters")
    if "maxLength" in node:
        out.append(f"at most {node['maxLength']} characters")
    if "pattern" in node:
        out.append(f"matches `{node['pattern']}`")
    if "minItems" in node:
        out.append(f"at least {node['minItems']} item{'' if node['minItems'] == 1 else 's'}")
    if "maxItems" in node:
        out.append(f"at most {node['maxItems']} item{'' if node['maxItems'] == 1 else 's'}")
    if node.get("uniqueItems"):
        out.append("items unique")
    if node.get("additionalProperties") is False and node.get("properties"):
        out.append("no keys but those below")
    elif "object" in _types(node) and not node.get("properties") and node.get("additionalProperties") is not False:
        out.append("free-form mapping (see the description)")
    return out


def allowed_text(node: dict) -> str:
    out = bounds_text(node)
    items = node.get("items")
    if isinstance(items, dict) and not items.get("properties"):
        inner = bounds_text(items)
        if inner:
            out.append("each item " + ", ".join(inner))
    return "; ".join(out) or "—"


def default_text(key: Key) -> str:
    if "default" in key.node:
        return literal(key.node["default"])
    return "required" if key.required else "none (unset)"


def prose(text: str) -> str:
    """Schema text as Markdown that renders as written: `<name>` is not an HTML tag, `*` and `_` are no emphasis."""
    text = " ".join(str(text).split())
    text = html.escape(text, quote=False)
    for char in ("\\", "*", "_", "[", "]", "`"):
        text = text.replace(char, "\\" + char)
    return text


def anchor(path: str) -> str:
    """The heading id that mkdocs' toc and GitHub both derive from a key: word characters and `-`, lower case."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "_-")


def facts(key: Key) -> list[str]:
    """The type, default and allowed values of one key, as a list."""
    return [
        f"- **type:** {type_text(key.node) or 'any'}",
        f"- **default:** {default_text(key)}",
        f"- **allowed:** {allowed_text(key.node)}",
        "",
    ]


def render(schema: dict) -> str:
    """The whole page."""
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by docs/gen_config_reference.py from schemas/config.schema.yaml: do not edit by hand.",
        "     Edit the schema's descriptions, then run `python docs/gen_config_reference.py`;",
        "     tests/unit/test_docs.py fails while this page differs from what the script writes. -->",
        "",
        "Every key the pipeline reads, generated from `schemas/config.schema.yaml`, the one place where defaults",
        "and bounds are written. `config.yaml` (the default experiment) and `config/tiny-cpu.yaml` set only what",
        "departs from these defaults; a key not listed here is refused when the config is validated (inside a",
        "free-form mapping such as `train.deepspeed`, its description says what is accepted). Keys are dotted;",
        "`[]` stands for every item of a list (`corpus.sources[].uri`). Set a key in an overlay (`--configfile`)",
        "or on the command line (`--config 'train={\"gpus\": 8}'`); see [Getting started](getting-started.md).",
        "",
    ]
    all_keys = keys(schema)
    top_level = [key for key in all_keys if "." not in key.path]
    lines += ["Blocks: " + ", ".join(f"[`{key.path}`](#{anchor(key.path)})" for key in top_level) + ".", ""]
    for block in top_level:
        nested = [key for key in all_keys if key.path.startswith(block.path + ".")]
        lines += [f"## `{block.path}`", "", prose(block.node.get("description", "")), "", *facts(block)]
        if nested:
            lines += ["| key | type | default |", "|---|---|---|"]
            lines += [f"| [`{k.path}`](#{anchor(k.path)}) | {type_text(k.node)} | {default_text(k)} |" for k in nested]
            lines.append("")
        for key in nested:
            lines += [f"### `{key.path}`", "", *facts(key), prose(key.node.get("description", "")), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def load_schema(path: Path = SCHEMA) -> dict:
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 when the page is stale")
    args = parser.parse_args(argv)
    schema = load_schema()
    missing = missing_descriptions(schema)
    if missing:
        print("keys without a description in schemas/config.schema.yaml: " + ", ".join(missing), file=sys.stderr)
        return 1
    page = render(schema)
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `python docs/gen_config_reference.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(keys(schema))} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
