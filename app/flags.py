"""The command line's settings flags, made from `Settings` (app/config.py): one flag per field, its help the field's
description, so `python -m app serve --help`, the env vars and docs/configuration.md's table cannot drift apart.

A flag's value goes to `Settings` as the text typed, and pydantic checks it as it checks the env var of the same
name (so `--kv-cache-bytes 8GiB`, `--cors-origins a,b` and `--log-level INFO` read as their env vars do, and a bad
value's error names the setting). A flag left out is not passed at all, so the env var, else the default, applies:
CLI over env over default.
"""

from __future__ import annotations

import argparse
import typing
from pathlib import Path

from app.config import Settings


def flag(name: str) -> str:
    """A field's flag: `max_active` -> `--max-active`."""
    return "--" + name.replace("_", "-")


def metavar(name: str, annotation: object) -> str:
    """What the flag takes, as `--help` shows it: the choices of a Literal, else a word for the kind of value."""
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) is not list:  # Optional[X] / X | None / Annotated[X, ...]
        return metavar(name, args[0])
    if typing.get_origin(annotation) is list:
        return "A,B,..."
    if name.endswith("_bytes"):
        return "BYTES"
    return {int: "N", float: "SECONDS" if name.endswith("_s") else "X", Path: "DIR"}.get(
        annotation, name.split("_")[-1].upper())


def add_settings_flags(parser: argparse.ArgumentParser, names: typing.Iterable[str] | None = None) -> None:
    """One flag per Settings field (or per field in `names`); `prepack` gets its two spellings."""
    for name in names or Settings.model_fields:
        field = Settings.model_fields[name]
        if name == "prepack":
            add_prepack_flags(parser)
        else:
            parser.add_argument(flag(name), metavar=metavar(name, field.annotation),
                                help=escape(f"{field.description} (env {name.upper()})" if field.description
                                            else f"env {name.upper()}"))


def add_prepack_flags(parser: argparse.ArgumentParser) -> None:
    """`--prepack [auto|true|false]` (bare: true, fail at start where it cannot) and `--no-prepack` (false)."""
    parser.add_argument("--prepack", nargs="?", const="true", choices=("auto", "true", "false"),
                        help=escape(f"{Settings.model_fields['prepack'].description} (env PREPACK; a bare "
                                    "--prepack means true)"))
    parser.add_argument("--no-prepack", dest="prepack", action="store_const", const="false", help="PREPACK=false")


def escape(help: str) -> str:
    """argparse %-formats help (`%(default)s`), so a description's own `10%` is written `10%%`."""
    return help.replace("%", "%%")


def settings_from(args: argparse.Namespace, keys: tuple[str, ...] | None = None) -> Settings:
    """CLI flags override env vars, which override defaults."""
    given = {k: v for k, v in vars(args).items() if v is not None and (keys is None or k in keys)}
    return Settings(**{k: v for k, v in given.items() if k in Settings.model_fields})
