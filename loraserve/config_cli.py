"""Command-line flags derived from configuration dataclasses, and configurations written back as flags.

A dataclass field is a setting on the command line when its metadata has a "help" text (`setting`
writes such a field). Its flag is `--field-name` unless the metadata names another ("flag"; a name
without dashes is a positional argument). The annotation gives the flag's type and form:

- `int`, `float`, `str`, `Path` (or any of them `| None`): one value of that type;
- `bool`: `--x` alone when the default is False, `--x/--no-x` when it is True or None ("negatable"
  forces the pair);
- `tuple[X, ...]`: a repeatable flag, one item each time;
- a dataclass (not `| None`, no help of its own): its settings, flattened into the same parser.

"choices" and "metavar" pass through. Where the flag speaks other units than the field (GiB for
bytes), "flag_type" is the flag's type, "parse" turns the flag's value into the field's, and
"show" turns the field's back (None included: `--shared-memory-root ""` is None). "switch" adds
a second flag that sets the field to one value (`--enforce-eager` sets `cuda_graphs` to "off"):
`(flag, value, help)`.

The default is the dataclass's, or the one `add_config_arguments` is given for a role whose default
differs (`defaults`). A setting that two nested configurations have (the same field name) is one flag
that sets both (`settings_of`); across roles, `add_roles_arguments` does the same for a command that
starts several (`loraserve up`). Environment twins (`LORASERVE_*`) come from the parser (`flags.py`), as for
every flag. `config_to_argv` writes a configuration back as the flags that rebuild it, which is how
`loraserve up` hands every role its configuration (`changed_only`: the settings it chose, and every
one not at its default).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_UNSET: Any = object()


def setting(default: Any = _UNSET, help: str = "", *, factory: Callable[[], Any] | None = None, **meta: Any) -> Any:
    """A dataclass field that is a command-line setting: its default (or default factory), help text,
    and any of the metadata keys this module reads (flag, choices, metavar, flag_type, parse, show,
    switch, negatable)."""
    metadata = {"help": help, **meta}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    if default is _UNSET:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def directory_setting(default: Path | None, help: str, **meta: Any) -> Any:
    """A setting naming a directory that may be unset: the flag takes DIR, and an empty value means None
    (so a default directory can be turned off: `--flag ''`)."""
    return setting(
        default,
        help,
        metavar="DIR",
        flag_type=str,
        parse=lambda text: Path(text) if text else None,
        show=lambda path: "" if path is None else str(path),
        **meta,
    )


@dataclasses.dataclass(frozen=True)
class Flag:
    """One setting's flag, as read from its field."""

    field: dataclasses.Field
    kind: Any  # the flag's value type (after `| None` and `tuple[...]` are taken off)
    repeated: bool
    nested: type | None  # a dataclass whose settings this field holds

    @property
    def name(self) -> str:
        return self.field.metadata.get("flag", "--" + self.field.name.replace("_", "-"))

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def positional(self) -> bool:
        return not self.name.startswith("-")

    @property
    def dest(self) -> str:
        return self.field.name

    @property
    def negatable(self) -> bool:
        return self.field.metadata.get("negatable", self.default is not False)

    @property
    def default(self) -> Any:
        if self.field.default is not dataclasses.MISSING:
            return self.field.default
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return _UNSET

    def parse(self, value: Any) -> Any:
        """The flag's value as the field's; None (a repeatable flag not given, or a caller such as a test stack
        leaving a setting unset) is the field's default."""
        if value is None:
            return None if self.default is _UNSET else self.default
        if self.repeated and value is not None:
            value = tuple(value)
        convert = self.field.metadata.get("parse")
        return convert(value) if convert is not None and value is not None else value

    def show(self, value: Any) -> Any:
        """The field's value as the flag's ("show" is given None too: None may have a flag value)."""
        convert = self.field.metadata.get("show")
        value = convert(value) if convert is not None else value
        return list(value) if self.repeated and value is not None else value


def flags_of(cls: type) -> Iterator[Flag]:
    """Every setting of dataclass `cls`, in field order; a nested dataclass's field is one Flag with `nested` set."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, optional = _strip_optional(hints[f.name])
        if dataclasses.is_dataclass(kind) and not optional and "help" not in f.metadata:
            yield Flag(f, kind, False, kind)
            continue
        if "help" not in f.metadata:
            continue
        repeated = typing.get_origin(kind) is tuple
        if repeated:
            kind = typing.get_args(kind)[0]
        yield Flag(f, f.metadata.get("flag_type", kind), repeated, None)


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False


def settings_of(cls: type, skip: frozenset[str] | set[str] = frozenset()) -> list[Flag]:
    """Every setting of `cls` and of the dataclasses it nests, flattened in field order, except the fields in
    `skip`. A setting two nested configurations share (the same field name, as the fcfs and adaptive
    strategies' max_queue_length) is one flag that sets both: it comes once, and must have one default."""
    seen: dict[str, Flag] = {}
    for flag in flags_of(cls):
        if flag.dest in skip:
            continue
        for leaf in settings_of(flag.nested, skip) if flag.nested is not None else [flag]:
            _check_shared(seen.setdefault(leaf.dest, leaf), leaf, leaf.default)
    return list(seen.values())


def _check_shared(first: Flag, other: Flag, default: Any) -> None:
    if first.name != other.name or first.default != default:
        raise ValueError(f"setting {other.dest!r} is {first.name} and {other.name}, or has two defaults")


def add_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: frozenset[str] | set[str] = frozenset(),
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
    notes: dict[str, str] | None = None,
) -> None:
    """Add a flag for every setting of `cls` (and of the dataclasses it nests), except the fields in
    `skip`. `defaults` and `helps` replace a field's default (as the field's value) or help text for a
    command where they differ; `notes` says what a default the command works out itself will be."""
    defaults, helps, notes = defaults or {}, helps or {}, notes or {}
    for flag in settings_of(cls, skip):
        help_text = helps.get(flag.dest, flag.help)
        if flag.dest in notes:
            help_text += f" (default: {notes[flag.dest]})"
        _add_flag(parser, flag, defaults.get(flag.dest, flag.default), help_text)


@dataclasses.dataclass(frozen=True)
class RoleFlags:
    """One role's configurations on the parser of a command that starts the role (`loraserve up`): a flag
    for each of their settings but those in `chosen`, which that command decides itself."""

    title: str  # the role's group of flags
    configs: tuple[type, ...]
    chosen: frozenset[str] = frozenset()
    description: str | None = None  # the group's
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # as `add_config_arguments`'s
    notes: dict[str, str] = dataclasses.field(default_factory=dict)  # as `add_config_arguments`'s


def add_roles_arguments(parser: argparse.ArgumentParser, roles: list[RoleFlags]) -> None:
    """A group of flags per role. A setting several roles have (the same field name, as max_lora_rank) is one
    flag, in the first one's group, that sets it in each: its default must be the same in all, and its help
    gives each role's, named by the role's title where they differ."""
    holders: dict[str, list[tuple[RoleFlags, Flag]]] = {}
    for role in roles:
        for cls in role.configs:
            for flag in settings_of(cls, role.chosen):
                holders.setdefault(flag.dest, []).append((role, flag))
    groups = {role.title: parser.add_argument_group(role.title, role.description) for role in roles}
    for held in holders.values():
        role, flag = held[0]
        default = role.defaults.get(flag.dest, flag.default)
        for other_role, other in held[1:]:
            _check_shared(flag, other, other_role.defaults.get(other.dest, other.default))
        helps = {other_role.title: other.help for other_role, other in held if other.help}
        help_text = "; ".join(f"{title}: {text}" for title, text in helps.items())
        if len(set(helps.values())) == 1:
            help_text = next(iter(helps.values()))
        if flag.dest in role.notes:
            help_text += f" (default: {role.notes[flag.dest]})"
        _add_flag(groups[role.title], flag, default, help_text)


def _add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: Flag, default: Any, help_text: str):
    kwargs = _argument(flag, flag.show(None if default is _UNSET else default), help_text)
    switch = flag.field.metadata.get("switch")
    if switch is not None:  # before the flag itself: its environment twin's value then wins over the flag's
        name, value, switch_help = switch
        parser.add_argument(
            name, dest=flag.dest, action="store_const", const=flag.show(value), default=argparse.SUPPRESS,
            help=switch_help,
        )  # fmt: skip
    if flag.positional:
        parser.add_argument(flag.name, **kwargs)
    else:
        parser.add_argument(flag.name, dest=flag.dest, **kwargs)


def _argument(flag: Flag, default: Any, help_text: str) -> dict[str, Any]:
    meta = flag.field.metadata
    kwargs: dict[str, Any] = {"help": help_text}
    if flag.positional:
        return {**kwargs, "choices": meta["choices"]} if "choices" in meta else kwargs
    if flag.kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if flag.negatable else "store_true"
        kwargs["default"] = default
        return kwargs
    if flag.repeated:
        kwargs["action"] = "append"
        default = list(default or [])
        if default:  # argparse would append to it: given flags replace it instead (`Flag.parse` puts it back)
            kwargs["help"] += f" (default: {', '.join(map(str, default))})"
            default = None
    if flag.kind is not str:
        kwargs["type"] = flag.kind
    kwargs["default"] = default
    for key in ("choices", "metavar"):
        if key in meta:
            kwargs[key] = meta[key]
    if "metavar" not in kwargs and "choices" not in kwargs and "flag" in meta:  # named after the flag, not the field
        kwargs["metavar"] = flag.name.lstrip("-").upper().replace("-", "_")
    return kwargs


def config_from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """An instance of `cls` from the parsed flags of its settings; `values` give the fields that are
    not settings (or replace parsed ones), a nested configuration's among them. A setting absent from
    `args` keeps the field's default."""
    own = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for flag in flags_of(cls):
        if flag.dest in values:
            continue
        if flag.nested is not None:
            inner = {k: v for k, v in values.items() if k not in own and k in _tree_fields(flag.nested)}
            kwargs[flag.dest] = config_from_args(flag.nested, args, **inner)
        elif hasattr(args, flag.dest):
            kwargs[flag.dest] = flag.parse(getattr(args, flag.dest))
    rest = {k: v for k, v in values.items() if k in own or k not in _tree_fields(cls)}  # unknown: TypeError
    return cls(**kwargs, **rest)


def _tree_fields(cls: type) -> set[str]:
    """The names of the fields of `cls` and of the configurations it nests."""
    names = {f.name for f in dataclasses.fields(cls)}
    return names.union(*(_tree_fields(flag.nested) for flag in flags_of(cls) if flag.nested is not None))


def config_to_argv(
    config: Any,
    *,
    changed_only: bool = False,
    always: frozenset[str] | set[str] = frozenset(),
    defaults: dict[str, Any] | None = None,
) -> list[str]:
    """The flags that rebuild `config` (its settings, nested ones included, a shared one once) in a process
    whose parser `add_config_arguments` built (with the same `defaults`). A setting that is None is left
    out, its flag having no way to say None.

    `changed_only` leaves out the settings at their default, except those in `always`: a process that
    starts another (`loraserve up`) then writes what it chose, and leaves the rest to the child's
    defaults and environment twins, as if it were not in between."""
    defaults = defaults or {}
    argv: list[str] = []
    for flag, value in _settings_with_values(config).items():
        if changed_only and flag.dest not in always and value == defaults.get(flag.dest, flag.default):
            continue
        shown = flag.show(value)
        if shown is None:
            continue
        if flag.positional:
            argv.append(_text(shown))
        elif flag.kind is bool:
            if shown or flag.negatable:
                argv.append(flag.name if shown else "--no-" + flag.name[2:])
        elif flag.repeated:
            argv += [item for v in shown for item in (flag.name, _text(v))]
        else:
            argv += [flag.name, _text(shown)]
    return argv


def _settings_with_values(config: Any) -> dict[Flag, Any]:
    """Each setting of `config` (as `settings_of` flattens them) with its value there (a shared one's first)."""
    values: dict[Flag, Any] = {}
    seen: set[str] = set()
    for flag in flags_of(type(config)):
        value = getattr(config, flag.dest)
        for leaf, leaf_value in _settings_with_values(value).items() if flag.nested is not None else [(flag, value)]:
            if leaf.dest not in seen:
                seen.add(leaf.dest)
                values[leaf] = leaf_value
    return values


def _text(value: Any) -> str:
    return str(Path(value)) if isinstance(value, Path) else str(value)
