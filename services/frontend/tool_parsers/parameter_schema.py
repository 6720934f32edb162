"""What a tool's `parameters` schema says about each named parameter, for formats that
write arguments one by one outside JSON (qwen3_coder's XML, pythonic's keywords): the
declared properties in order, which are required, and each one's JSON types."""

from __future__ import annotations

_DEFINITION_KEYS = ("$defs", "definitions")
_INSIDE = tuple(f"#/{key}/" for key in _DEFINITION_KEYS)
JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
# anyOf / oneOf levels read for a parameter's types (deeper options add none): keeps a
# deeply nested schema from exhausting the interpreter's stack.
MAX_NESTING = 32


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


def resolve(schema: dict, parameters: dict | None, seen: set[str] | None = None) -> dict:
    """Follow local `$ref`s to the schema they name. Each reference is followed at most once
    per `seen` (one walk's set; a fresh one when None), so a cycle stops: a reference met
    again, or one that names nothing, is left as is and the value is read without a type."""
    seen = set() if seen is None else seen
    while True:
        ref = schema.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/") or ref in seen:
            return schema
        seen.add(ref)
        target = _target(ref, parameters)
        if target is None:
            return schema
        schema = target


def types(schema: dict, parameters: dict | None = None) -> list[str]:
    """The JSON types a parameter admits, in the schema's order: from `type` (a name or a
    list), else from `anyOf` / `oneOf` options, else from `enum` / `const` values. One walk
    follows each reference once (a union gains nothing from reading one twice), so the work
    is bounded by the schema's size however its references loop."""
    return list(dict.fromkeys(_types(schema, parameters, set(), 0)))


def _types(schema: dict, parameters: dict | None, seen: set[str], depth: int) -> list[str]:
    schema = resolve(schema, parameters, seen)
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared] if declared in JSON_TYPES else []
    if isinstance(declared, list):
        return [t for t in declared if t in JSON_TYPES]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            if depth >= MAX_NESTING:
                return []
            nested = (
                _types(o, parameters, seen, depth + 1) for o in options if isinstance(o, dict)
            )
            return [t for found in nested for t in found]
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list):
        return [_value_type(v) for v in values]
    return []


def foreign_references(schema: dict) -> list[str]:
    """The local `$ref`s in `schema` that point outside `$defs` / `definitions`: a parameter
    taken out of its tool's schema (with_definitions) can no longer reach them."""
    found, stack = [], [schema]
    while stack:  # iterative: a deeply nested schema must not exhaust the stack
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/") and not ref.startswith(_INSIDE):
                found.append(ref)
            stack.extend(node.values())
    return found


def _target(ref: str, parameters: dict | None) -> dict | None:
    target = parameters
    for part in ref[2:].split("/"):
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target if isinstance(target, dict) else None


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
