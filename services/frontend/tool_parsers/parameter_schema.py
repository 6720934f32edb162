"""What a tool's `parameters` schema says about each named parameter, for formats that
write arguments one by one outside JSON (qwen3_coder's XML, pythonic's keywords): the
declared properties in order, which are required, and each one's JSON types."""

from __future__ import annotations

_DEFINITION_KEYS = ("$defs", "definitions")
JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


def properties(parameters: dict | None) -> dict[str, dict]:
    """name -> schema of each declared parameter (empty when the schema declares none)."""
    if not isinstance(parameters, dict):
        return {}
    declared = parameters.get("properties")
    if not isinstance(declared, dict):
        return {}
    return {k: v if isinstance(v, dict) else {} for k, v in declared.items() if isinstance(k, str)}


def required(parameters: dict | None) -> set[str]:
    names = parameters.get("required") if isinstance(parameters, dict) else None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def with_definitions(schema: dict, parameters: dict) -> dict:
    """A parameter's schema as a root of its own, carrying the root's `$defs` /
    `definitions` so its `#/$defs/...` references still resolve."""
    hoisted = {k: parameters[k] for k in _DEFINITION_KEYS if k in parameters}
    return {**schema, **hoisted}


def resolve(schema: dict, parameters: dict | None, depth: int = 0) -> dict:
    """Follow a local `$ref` (a few levels: a reference chain longer than that is left as
    is, the value then being read without a type)."""
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/") or depth > 8:
        return schema
    target = parameters
    for part in ref[2:].split("/"):
        if not isinstance(target, dict) or part not in target:
            return schema
        target = target[part]
    return resolve(target, parameters, depth + 1) if isinstance(target, dict) else schema


def types(schema: dict, parameters: dict | None = None) -> list[str]:
    """The JSON types a parameter admits, in the schema's order: from `type` (a name or a
    list), else from `anyOf` / `oneOf` options, else from `enum` / `const` values."""
    schema = resolve(schema, parameters)
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared] if declared in JSON_TYPES else []
    if isinstance(declared, list):
        return [t for t in declared if t in JSON_TYPES]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            found = [t for o in options if isinstance(o, dict) for t in types(o, parameters)]
            return list(dict.fromkeys(found))
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list):
        return list(dict.fromkeys(_value_type(v) for v in values))
    return []


def _value_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
