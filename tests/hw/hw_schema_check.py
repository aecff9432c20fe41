"""A small JSON Schema validator: the subset offload/hw/schema.json uses.

Keywords: type (name or list), properties, required, additionalProperties (bool), items, enum,
const, anyOf, $ref to `#/$defs/<name>`. `validate(instance, schema) -> list[str]` returns one
line per problem with its JSON path (empty: valid). Unknown keywords are an error, so the schema
cannot silently use more than this checks.
"""

from __future__ import annotations

from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
_KNOWN = {"$schema", "$id", "$defs", "title", "description", "type", "properties", "required",
          "additionalProperties", "items", "enum", "const", "anyOf", "$ref"}


def _is(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def validate(instance: Any, schema: dict[str, Any], root: dict[str, Any] | None = None,
             path: str = "$") -> list[str]:
    root = schema if root is None else root
    unknown = set(schema) - _KNOWN
    if unknown:
        return [f"{path}: schema uses unsupported keywords {sorted(unknown)}"]
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return validate(instance, root["$defs"][name], root, path)
    problems: list[str] = []
    if "anyOf" in schema:
        if all(validate(instance, s, root, path) for s in schema["anyOf"]):
            problems.append(f"{path}: matches none of anyOf")
    if "const" in schema and instance != schema["const"]:
        problems.append(f"{path}: {instance!r} is not {schema['const']!r}")
    if "enum" in schema and instance not in schema["enum"]:
        problems.append(f"{path}: {instance!r} is not one of {schema['enum']}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(instance, t) for t in types):
            return problems + [f"{path}: {type(instance).__name__} is not {types}"]
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in instance:
                problems.append(f"{path}: missing required key {key!r}")
        for key, value in instance.items():
            if key in props:
                problems += validate(value, props[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                problems.append(f"{path}: unexpected key {key!r}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            problems += validate(item, schema["items"], root, f"{path}[{i}]")
    return problems
