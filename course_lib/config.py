"""Typed recipe configs: one dataclass per recipe, its command line generated from it (torchtitan's job config).

A recipe declares what it takes once, as fields; the parser, `--help`, and the command line a notebook
launches it with all come from that declaration:

    @dataclass
    class Config(cl.config.RecipeConfig, cl.config.ModelSize):
        chapter = "05"                                        # its defaults come from this chapter's gpu preset
        steps: int = cl.config.preset("DDP steps compared with one process")
        lr: float = cl.config.opt(0.1, "SGD learning rate")   # not in the preset: the default is written here

    cfg = Config.parse()                                  # in the recipe's main(): from sys.argv
    cfg = Config.from_preset(P, steps=3)                  # in a notebook: the profile's values, then overrides
    run = cl.launch(cfg, nproc=P.nproc)                   # the launcher turns it into `cfg.to_argv()`
    replace(cfg, act_ckpt=True)                           # a variant (dataclasses.replace), as the capstone does

One flag vocabulary for every recipe: model size `--hidden-size --num-hidden-layers ...` (`ModelSize`),
`--micro-batch` (sequences per rank per micro-batch), `--accum` (micro-batches per optimizer step),
`--seq-len`, `--steps`, `--lr`, `--seed`. A field whose default is `preset(...)` takes its value from the
gpu profile of the recipe's `chapter` (course_lib/presets.py): run by hand (`torchrun ddp.py` on a cluster) a recipe
gets the real sizes, written once; a notebook builds its config from its own profile (`from_preset`), so the command
line it launches names every size that differs.
Introduced in chapter 05; every recipe in course_lib/recipes/ has a `Config`.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

DEFAULTS_PROFILE = "gpu"  # real sizes: what a recipe run by hand should get
PRESET = "<the gpu preset's value>"  # a sentinel default: filled in from the recipe chapter's gpu preset


class ConfigError(ValueError):
    """A combination of settings a recipe cannot run; the message is one line that says what to change."""


def opt(default, help: str = "", **extra):
    """A field with a default and the help line `--help` shows."""
    return field(default=default, metadata={"help": help, **extra})


def preset(help: str = "", knob: str | None = None):
    """A field whose default is the gpu preset's value of the same name (chapter block, then profile),
    or of the knob named `knob` where the chapter calls it something else (e.g. `comm_steps`)."""
    return field(default=PRESET, metadata={"help": help, "knob": knob})


def _knob(f) -> str:
    return f.metadata.get("knob") or f.name


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _none_or(kind):
    """A parser type for an optional field: the word `none` is None."""
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _kind(hint) -> tuple[type, bool, bool]:
    """(element type, is a list, may be None) of a field's annotation: int, str | None, list[int], ..."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
        origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


@dataclass
class RecipeConfig:
    """The base of every recipe's config: parsing, `--help`, `to_argv()`, preset defaults, checks."""

    chapter: ClassVar[str | None] = None  # whose gpu preset fills the `preset(...)` defaults
    preset_model: ClassVar[str] = "model"  # the preset knob holding the model size (`ModelSize` fields)

    def __post_init__(self):
        unset = [f for f in fields(self) if getattr(self, f.name) is PRESET]
        if unset:
            values = preset_values(type(self), DEFAULTS_PROFILE)
            for f in unset:
                if _knob(f) not in values:
                    raise ConfigError(f"{type(self).__qualname__}.{f.name}: no {_knob(f)!r} in the gpu preset of "
                                      f"chapter {self.chapter}")
                setattr(self, f.name, values[_knob(f)])
        self.check()

    def check(self) -> None:
        """Raise `ConfigError` (one line) for settings that cannot work; recipes override it."""

    # --- the command line --------------------------------------------------------------------------
    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        doc = (cls.__doc__ or "").strip().splitlines()
        parser = argparse.ArgumentParser(description=doc[0] if doc else None, allow_abbrev=False)
        parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed's
        defaults, hints = cls(), typing.get_type_hints(cls)
        for f in fields(cls):
            kind, many, optional = _kind(hints[f.name])
            default = getattr(defaults, f.name)
            help_text = f.metadata.get("help", "").replace("%", "%%")
            names = (_flag(f.name), *f.metadata.get("aliases", ()))
            if kind is bool:  # argparse adds "(default: ...)" to these itself
                parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=default,
                                    help=help_text)
            else:
                if default is not None:
                    help_text += f" (default: {' '.join(map(str, default)) if many else default})"
                parser.add_argument(*names, type=_none_or(kind) if optional else kind,
                                    nargs="+" if many else None, default=default,
                                    help=help_text, required=f.metadata.get("required", False))
        return parser

    @classmethod
    def parse(cls, argv: list[str] | None = None):
        """The config from a command line (sys.argv when None); bad values end with one `error:` line.
        `--config run.yaml` (or .json): a file whose keys are the flags' names (dashes or underscores), read as if
        its flags came first on the command line, so the flags given there override it."""
        import sys

        parser = cls.parser()
        parser.add_argument("--config", metavar="FILE", help="a YAML or JSON file of flags (keys: the flags' names); "
                                                             "flags on the command line override it")
        argv = list(sys.argv[1:] if argv is None else argv)
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--config")
        path = pre.parse_known_args(argv)[0].config
        if path:
            try:
                argv = cls.config_argv(path) + argv
            except ConfigError as e:
                parser.exit(2, f"{parser.prog}: error: {e}\n")  # one line: the file's mistake, not the usage
        ns = vars(parser.parse_args(argv))
        ns.pop("config", None)
        ns.pop("local_rank", None)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if _kind(hints[f.name])[1] and ns[f.name] is not None:
                ns[f.name] = tuple(ns[f.name])  # sequences are tuples: a dataclass default cannot be a list
        try:
            return cls(**ns)
        except ConfigError as e:
            parser.error(str(e))

    @classmethod
    def config_argv(cls, path) -> list[str]:
        """The flags a `--config` file holds, as a command line; an unknown key or an unreadable file: one line."""
        path = Path(path)
        try:
            text = path.read_text()
            if path.suffix == ".json":
                import json

                values = json.loads(text)
            else:
                import yaml

                values = yaml.safe_load(text) or {}
        except Exception as e:  # missing, unreadable, or not JSON/YAML: what the reader says, on one line
            raise ConfigError(f"--config {path}: {' '.join(str(e).split())}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = [k for k in values if str(k).replace("-", "_") not in names]
        if unknown:
            raise ConfigError(f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(map(str, unknown))} (keys are the flags' names: --help lists them)")
        out = []
        for key, value in values.items():
            flag = _flag(str(key).replace("-", "_"))
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            elif value is None:
                out += [flag, "none"]
            elif isinstance(value, (list, tuple)):
                out += [flag, *map(str, value)]
            else:
                out.append(f"{flag}={value}")  # (a value that starts with "-" stays a value)
        return out

    def to_argv(self) -> list[str]:
        """The command line that parses back into this config: every field that differs from the default."""
        defaults, out = type(self)(), []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == getattr(defaults, f.name):
                continue
            if value is None:
                out += [_flag(f.name), "none"]
            elif isinstance(value, bool):
                out.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
            elif isinstance(value, (list, tuple)):
                out += [_flag(f.name), *map(str, value)]
            else:
                out += [_flag(f.name), str(value)]
        return out

    # --- from a notebook -----------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, P, **overrides):
        """The config with every field the preset `P` (`cl.preset(...)`) knows by name, then `overrides`."""
        values = _spread_model(dict(vars(P)), cls.preset_model)
        names = {f.name for f in fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ConfigError(f"{cls.__qualname__} has no field {', '.join(sorted(unknown))}: "
                              f"it has {', '.join(sorted(names))}")
        kwargs = {f.name: values[_knob(f)] for f in fields(cls) if _knob(f) in values}
        kwargs.update(overrides)
        kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items()}
        return cls(**kwargs)

    @classmethod
    def script(cls) -> Path:
        """The recipe file that defines this config (what `cl.launch(cfg)` runs)."""
        import sys

        return Path(sys.modules[cls.__module__].__file__).resolve()


def preset_values(cls, profile: str) -> dict:
    """The knob values of `cls.chapter`'s block in `profile` (`cl.preset`), with the model size's fields spread out."""
    from .presets import preset

    return _spread_model(dict(vars(preset(profile, cls.chapter))), cls.preset_model)


def _spread_model(values: dict, knob: str) -> dict:
    """The profile's `model` size, then the chapter's own model knob on top (e.g. a deeper pipeline model)."""
    size = {**(values.pop("model", None) or {}), **(values.pop(knob, None) or {})}
    return {**values, **size}


@dataclass
class ModelSize:
    """The shape of a random-init Qwen2 (`cl.models.tiny_qwen2(**cfg.size())`): the same flags in every recipe."""

    hidden_size: int = preset("width h")
    intermediate_size: int = preset("SwiGLU width I")
    num_hidden_layers: int = preset("decoder layers L")
    num_attention_heads: int = preset("query heads")
    num_key_value_heads: int = preset("key/value heads (grouped-query attention)")
    vocab_size: int = preset("vocabulary V")
    tie_word_embeddings: bool = preset("share the embedding with the output head")

    def size(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(ModelSize)}


replace = dataclasses.replace  # `cl.config.replace(cfg, act_ckpt=True)`: a variant of a config
