"""Reading a run config: the YAML file, `--set section.key=value` overrides, and each value checked against the
type of its dataclass field (the real types, from `typing.get_type_hints`).

Relative paths. The inputs a recipe names (`deepspeed_config`, `model.path`, `data.path`, `data.blend`'s directories,
`eval.task`) resolve
against the project root (the directory holding the `deepseek_ds` package) when the recipe lives inside the project,
and against the recipe's own directory when it lives elsewhere; so a recipe means the same files from any current directory. The
default `deepspeed_config` (ds_configs/zero1.json) is the project's, and so is a recipe's relative one that its own
directory lacks but the project ships (a recipe copied out of the project still finds ds_configs/zero1.json). Paths given on the command line (`--set`,
`--deepspeed_config`) are relative to the current directory, as for any command, and so are the outputs
(`train.output_dir`, `checkpoint.dir`, `data.cache_dir`)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import types
import typing
from typing import Any

import yaml

from .schema import ConfigError, RunConfig, yaml_key

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
RECIPE_PATHS = (("deepspeed_config",), ("model", "path"), ("data", "path"), ("eval", "task"), ("preference", "reference"))


def _unknown_key(where: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else f" Known keys: {', '.join(known)}."
    return ConfigError(f"unknown key '{where}{key}' in the run config.{hint}")


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _members(typ: Any) -> tuple:
    return typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)


def _type_name(typ: Any) -> str:
    return " | ".join("None" if m is type(None) else str(m) if typing.get_origin(m) else m.__name__
                      for m in _members(typ))


def _coerce(where: str, value: Any, typ: Any) -> Any:
    """`value` as the field type `typ` wants it: ints are accepted for floats, booleans only for bools."""
    members = _members(typ)
    if value is None:
        if type(None) in members:
            return None
        raise ConfigError(f"{where} must not be null")
    for member in members:
        kind = typing.get_origin(member) or member
        if kind is float and isinstance(value, str):
            try:  # YAML 1.1 reads 3e-4 (no dot) as a string
                return float(value)
            except ValueError:
                continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(kind, type) and isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
    raise ConfigError(f"{where} = {value!r} has the wrong type: expected {_type_name(typ)}")


def _section_from_dict(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"'{where.rstrip('.')}' must be a mapping of keys to values, got {data!r}")
    types_ = _field_types(cls)
    names = {yaml_key(f): f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise _unknown_key(where, k, list(names))
        kwargs[names[k]] = _coerce(f"{where}{k}", v, types_[names[k]])
    return cls(**kwargs)


def run_config_from_dict(data: dict | None) -> RunConfig:
    types_ = _field_types(RunConfig)
    kwargs = {}
    for k, v in (data or {}).items():
        if k not in types_:
            raise _unknown_key("", k, list(types_))
        if dataclasses.is_dataclass(types_[k]):
            kwargs[k] = _section_from_dict(types_[k], v or {}, f"{k}.")
        else:
            kwargs[k] = _coerce(k, v, types_[k])
    return RunConfig(**kwargs)


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """`section.key=value` pairs; the value is parsed as YAML (numbers, booleans, lists, null)."""
    data = copy.deepcopy(data or {})
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.lr=3e-4")
        path, raw = item.split("=", 1)
        keys = path.strip().split(".")
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: '{k}' is not a section")
        try:
            node[keys[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({_yaml_problem(e)})") from e
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError):
        return "; ".join(p for p in (e.context, e.problem) if p)
    return str(e)


def read_yaml(path: str) -> dict:
    """A run YAML's mapping; a malformed file is one ConfigError naming file, line and column."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r} does not exist; pass a run YAML such as recipes/tiny-v3.yaml")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
            raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(e)}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a run YAML is a mapping of sections (model:, train:, ...), got {data!r}")
    return data


def recipe_base_dir(recipe: str | None) -> str:
    """What the relative input paths of `recipe` are relative to (see the module docstring)."""
    if recipe is None:
        return PROJECT_ROOT
    here = os.path.dirname(os.path.realpath(recipe))
    return PROJECT_ROOT if os.path.commonpath([here, PROJECT_ROOT]) == PROJECT_ROOT else here


def resolve_recipe_paths(data: dict, recipe: str | None) -> dict:
    """A copy of a recipe's mapping with its relative input paths made absolute, the default DeepSpeed JSON included."""
    data = copy.deepcopy(data)
    if "deepspeed_config" not in data:
        data["deepspeed_config"] = os.path.join(PROJECT_ROOT, RunConfig.deepspeed_config)
    base = recipe_base_dir(recipe)
    for *sections, key in RECIPE_PATHS:
        node = data
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(key), str) and not os.path.isabs(node[key]):
            path = os.path.normpath(os.path.join(base, node[key]))
            shipped = os.path.normpath(os.path.join(PROJECT_ROOT, node[key]))
            if key == "deepspeed_config" and not os.path.exists(path) and os.path.isfile(shipped):
                path = shipped
            node[key] = path
    blend = data.get("data", {}).get("blend") if isinstance(data.get("data"), dict) else None
    if isinstance(blend, dict):
        data["data"]["blend"] = {d if not isinstance(d, str) or os.path.isabs(d) else os.path.normpath(
            os.path.join(base, d)): w for d, w in blend.items()}
    return data


def load_run_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    data = read_yaml(path) if path else {}
    return run_config_from_dict(apply_overrides(resolve_recipe_paths(data, path), overrides))
