"""The settings' seams: one config class per concern, each default in one place, nothing copied by hand.

Each section of `configs.settings.Settings` is a config class its package owns (blend_engine, kv_store,
runtime, retrieval, app). These tests read the product's source (its AST) for the ways the defaults used
to drift apart: a second class restating a setting's default, a converter copying a section field by
field into another class, a package importing the whole settings instead of its own config.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from configs import docgen
from configs.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("app", "blend_engine", "kv_store", "runtime", "retrieval", "configs", "bench")
PACKAGES = ("blend_engine", "kv_store", "runtime", "retrieval")


def _sections() -> dict[str, type]:
    return {name: field.annotation for name, field in Settings.model_fields.items() if docgen.is_section(field)}


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(encoding="utf-8"))) for package in PRODUCT
            for path in sorted((ROOT / package).rglob("*.py"))]


def _is_literal(node: ast.expr | None) -> bool:
    """A default written out as a value (a number, a string, a tuple of them, `2 << 30`), not None."""
    if node is None or (isinstance(node, ast.Constant) and node.value is None):
        return False
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field":  # Field(default, ...)
        return bool(node.args) and _is_literal(node.args[0])
    try:
        ast.literal_eval(node)
        return True
    except ValueError:
        return isinstance(node, ast.BinOp) and _is_literal(node.left) and _is_literal(node.right)


def _defaults() -> dict[str, set[object]]:
    """Field name -> the defaults the sections give it (as written in source: literals)."""
    found: dict[str, set[object]] = {}
    for config in _sections().values():
        for name, field in docgen.fields_of(config).items():
            default = field.get_default(call_default_factory=True)
            if isinstance(default, (frozenset, set, dict)):
                continue  # no class restates a set or a mapping
            found.setdefault(name, set()).add(default.value if hasattr(default, "value") else default)
    return found


def _literal(node: ast.expr) -> object:
    if isinstance(node, ast.Call):  # Field(default, ...)
        node = node.args[0]
    if isinstance(node, ast.BinOp):
        return eval(compile(ast.Expression(node), "<default>", "eval"), {})  # literals only: see _is_literal
    return ast.literal_eval(node)


def _restated_defaults(tree: ast.Module, section_fields: list[set[str]], defaults: dict[str, set[object]],
                       config_classes: set[str]) -> list[str]:
    """In a class other than a settings section: a field with a setting's name and its default written out
    again, or three fields or more named after one section's with written defaults (a mirror of it)."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name not in config_classes):
        written = {stmt.target.id: stmt.value for stmt in cls.body
                   if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _is_literal(stmt.value)}
        for name, value in written.items():
            literal = _literal(value)
            literal = tuple(literal) if isinstance(literal, list) else literal
            if name in defaults and not isinstance(literal, (dict, set)) and literal in defaults[name]:
                found.append(f"{cls.name}.{name} = {literal!r}")
        for fields in section_fields:
            if len(fields & set(written)) >= 3:
                found.append(f"{cls.name} mirrors {sorted(fields & set(written))}")
    return found


def _hand_copies(tree: ast.Module, section_fields: list[set[str]]) -> list[str]:
    """Calls of a config class passing three or more fields of one section as `name=<something>.name`."""
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if not callee.endswith(("Config", "Settings")):
            continue
        copied = {kw.arg for kw in call.keywords
                  if kw.arg and isinstance(kw.value, ast.Attribute) and kw.value.attr == kw.arg}
        for fields in section_fields:
            if len(copied & fields) >= 3:
                found.append(f"line {call.lineno}: {callee}({sorted(copied & fields)})")
                break
    return found


def test_no_setting_default_is_restated_in_another_class():
    section_fields = [set(docgen.fields_of(config)) for config in _sections().values()]
    config_classes = {c.__name__ for c in _sections().values()}
    restated = {str(path.relative_to(ROOT)): found for path, tree in _sources()
                if (found := _restated_defaults(tree, section_fields, _defaults(), config_classes))}
    assert restated == {}, "a setting's default lives in its config class only; refer to it (e.g. " \
                           f"`GenerationConfig.max_tokens`) instead of writing it again: {restated}"


def test_no_config_is_copied_field_by_field():
    section_fields = [set(docgen.fields_of(config)) for config in _sections().values()]
    copies = {str(path.relative_to(ROOT)): found for path, tree in _sources()
              if (found := _hand_copies(tree, section_fields))}
    assert copies == {}, f"pass the section's config itself rather than copying its fields: {copies}"


def test_packages_take_their_own_config_not_the_whole_settings():
    importers = [str(path.relative_to(ROOT)) for path, tree in _sources() if path.relative_to(ROOT).parts[0] in PACKAGES
                 for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module == "configs.settings"]
    assert importers == [], f"only the edge (app, bench, tests) resolves the settings: {importers}"


def test_every_section_is_a_frozen_dataclass_that_validates_its_values():
    for name, config in _sections().items():
        assert dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen, name
        field = next(iter(docgen.fields_of(config)))
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config(), field, None)


def test_the_checks_catch_a_restated_default_and_a_hand_copy():
    """The two scans above on code written the old way (a mirror class and a converter): they fail it."""
    section_fields = [set(docgen.fields_of(c)) for c in _sections().values()]
    restated = ast.parse("class Sampling:\n    max_tokens: int = 128\n")  # GenerationConfig's default, again
    assert _restated_defaults(restated, section_fields, _defaults(), set()) == ["Sampling.max_tokens = 128"]
    mirror = ast.parse("class BlendMirror:\n    recompute_ratio: float = 0.2\n    check_layers: tuple = (1,)\n"
                       "    probe_span: int = 1\n")  # other defaults than the section's: a drifting mirror
    assert _restated_defaults(mirror, section_fields, _defaults(), set()) == [
        "BlendMirror mirrors ['check_layers', 'probe_span', 'recompute_ratio']"]
    converter = ast.parse("SchedulerConfig(max_queue=s.max_queue, max_running=s.max_running, "
                          "retry_after_s=s.retry_after_s)")
    assert _hand_copies(converter, [set(docgen.fields_of(c)) for c in _sections().values()])
