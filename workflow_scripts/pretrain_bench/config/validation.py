"""Validation with short errors: a config that breaks its schema is refused in a few lines that name the dotted key
(`report.gpu_hour_price`), the value given, what is allowed (type, range or enum, with a "did you mean" for a near
miss) and the key's description: never jsonschema's dump of the schema, never a traceback.

It also checks what JSON schema cannot say: every number in the config is finite (YAML's .nan and .inf are floats
that pass `minimum`, since NaN compares false), and the run name is one Snakemake accepts as a wildcard value.
"""
from __future__ import annotations

import difflib
import math
import re
import textwrap

from pretrain_bench.config.schema import ConfigError, fill_defaults_and_validate

# A key's description is wrapped to this width and cut after this many lines: with the key, the value and what is
# allowed, an error stays within ~10 lines.
WIDTH = 110
DESCRIPTION_LINES = 4
# Snakemake refuses a wildcard value that ends in a substring repeated this many times (snakemake.io's
# PeriodicityDetector, min_repeat=20: it reads it as a rule matching its own output), and the run's name is one.
SNAKEMAKE_PERIODIC_REPEATS = 20
_PERIODIC = re.compile(rf"(?P<value>.+?)(?P=value){{{SNAKEMAKE_PERIODIC_REPEATS - 1},}}$")
_TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "null": "null", "array": "a list", "object": "a mapping"}


def validate_config(config: dict, schema: dict) -> dict:
    """Check every number is finite, fill in the schema's defaults and validate (fill_defaults_and_validate), then
    check the run name; returns config. Raises ConfigError with a short message naming the dotted key."""
    from jsonschema import ValidationError

    check_finite(config)
    try:
        fill_defaults_and_validate(config, schema)
    except ValidationError as error:
        raise ConfigError(describe_error(error, schema)) from None
    check_name(config["name"])
    return config


def dotted(path) -> str:
    """("train", "adam_betas", 1) → "train.adam_betas[1]"."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(the config)"


def check_finite(value, path=()) -> None:
    """Every float anywhere in `value` (the config) is finite; else ConfigError naming its dotted key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{dotted(path)}: {value} is not a finite number; give a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, (*path, key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_finite(item, (*path, index))


def check_name(name: str) -> None:
    """A name Snakemake takes as the value of the `name` wildcard: none ending in a substring repeated 20 times."""
    found = _PERIODIC.search(name)
    if found:
        part = found.group("value")
        raise ConfigError(f"name {name!r} ends in {part!r} repeated {len(found.group(0)) // len(part)} times, which "
                          f"Snakemake refuses in a wildcard (it reads it as endless recursion); choose a name "
                          f"without {SNAKEMAKE_PERIODIC_REPEATS} repeats of one part at its end")


def describe_error(error, schema: dict) -> str:
    """A jsonschema ValidationError in a few lines: key, value, what is allowed, the key's description."""
    path = list(error.absolute_path)
    node = _node(schema, path)
    if error.validator == "additionalProperties":
        known = list(node.get("properties") or {})
        unknown = [key for key in error.instance if key not in known]
        lines = []
        for key in unknown:
            key_path = dotted([*path, key])
            lines.append(f"{key_path}: not a config key (given: {_short(error.instance[key])})"
                         + _did_you_mean(key, known))
        lines.append(f"  keys of {dotted(path)}: {_short(', '.join(known), 300)}")
        return "\n".join(lines)
    if error.validator == "required":
        return (f"{dotted(path)}: {error.message}\n  given: {_short(error.instance)}"
                + _description(dotted(path), node))
    allowed = _allowed(error, node)
    return f"{dotted(path)}: {_short(error.instance)} is not allowed\n  allowed: {allowed}" \
        + _description(dotted(path), node)


def _node(schema: dict, path: list) -> dict:
    """The schema of the config value at `path`."""
    node = schema
    for part in path:
        if isinstance(part, int):
            node = node.get("items") or {}
        else:
            node = (node.get("properties") or {}).get(part) or node.get("additionalProperties") or {}
            node = node if isinstance(node, dict) else {}
    return node


def _allowed(error, node: dict) -> str:
    """What `node` allows, as words, with a did-you-mean for a near-miss enum value."""
    types = node.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    parts = []
    if "enum" in node:
        text = "one of " + ", ".join(map(repr, node["enum"]))
        if error.validator == "enum" and isinstance(error.instance, str):
            text += _did_you_mean(error.instance, [v for v in node["enum"] if isinstance(v, str)])
        parts.append(text)
    elif types:
        literal = re.fullmatch(r"\^(\w+)\$", node.get("pattern", ""))  # a string key that takes one word: its word
        parts.append(" or ".join(repr(literal.group(1)) if literal and name == "string" else _TYPE_NAMES.get(name, name)
                                 for name in types))
    bounds = [f"{word} {node[key]}" for key, word in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                      ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in node]
    if bounds:
        parts.append("numbers " + " and ".join(bounds))
    if "pattern" in node:
        literal = re.fullmatch(r"\^(\w+)\$", node["pattern"])
        if not literal and error.validator == "pattern":  # a long regex, shown only when it is what failed
            parts.append(f"strings matching {node['pattern']}")
        elif error.validator == "pattern":
            parts[-1] += _did_you_mean(error.instance, [literal.group(1)])
    for key, word in (("minLength", "at least {} characters"), ("maxLength", "at most {} characters"),
                      ("minItems", "at least {} items"), ("maxItems", "at most {} items")):
        if key in node:
            parts.append(word.format(node[key]))
    if error.validator == "uniqueItems":
        parts.append("no repeated items")
    return "; ".join(parts) or error.message


def _did_you_mean(given: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(given, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _description(key: str, node: dict) -> str:
    text = " ".join(str(node.get("description", "")).split())
    if not text:
        return ""
    lines = textwrap.wrap(f"{key}: {text}", WIDTH, initial_indent="  ", subsequent_indent="    ")
    if len(lines) > DESCRIPTION_LINES:
        lines = lines[:DESCRIPTION_LINES]
        lines[-1] = lines[-1][:WIDTH - 2] + " …"
    return "\n" + "\n".join(lines)


def _short(value, limit: int = 80) -> str:
    text = value if isinstance(value, str) and limit > 80 else repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
