"""YAML output a person can read: multi-line strings (embedded LMCache configs) as blocks.

Why: rendered ConfigMaps embed whole YAML files; PyYAML's default quoted-and-escaped form
is unreadable in `kvpool-operator render` output and in golden-file diffs.
"""

from __future__ import annotations

from typing import Any

import yaml


class _BlockDumper(yaml.SafeDumper):
    """SafeDumper that writes strings containing newlines in literal block style."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_BlockDumper.add_representer(str, _str)


def dump_all(objects: list[dict[str, Any]]) -> str:
    """Objects as a multi-document YAML stream, keys in render order."""
    return yaml.dump_all(objects, Dumper=_BlockDumper, sort_keys=False)
