"""Where a run's config comes from: a preset, `--config` files, command-line flags; and the presets table.

Precedence, lowest first: dataclass defaults < preset JSON (`presets/<name>.json`) < each `--config FILE` in the
order given < CLI flags (`--max-steps` … and `--set section.key=value`). Every entry point (the supervisor,
`pretrain_main.py`, `prepare_dataset.py`) shares these flags.

No torch import here: the supervisor and `prepare_dataset.py` must start fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainer.config import (
    DEFAULT_PRESET,
    PROJECT_ROOT,
    Config,
    apply_layer,
    closest,
    coerce,
    read_config_file,
    validate,
)
from trainer.config.json_text import DuplicateKey, unique_keys
from trainer.config.sizes import human, parameter_count, tokens_per_step
from trainer.errors import UserError

PRESETS_DIR = PROJECT_ROOT / "presets"


# ---------------------------------------------------------------------------------------------------------------------
# Presets


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_path(name: str, origin: str = "--preset") -> Path:
    """The file of the preset `name`, as `origin` named it (--preset, or a config file's "preset" key): a name, not
    empty, not a path, one of presets/."""
    where = "" if origin == "--preset" else f"{origin}: "
    if not name.strip():
        raise UserError(f"{where}{'--preset' if not where else 'preset'} is empty; give a preset's name "
                        f"({', '.join(preset_names())})")
    if Path(name).name != name or name.endswith(".json") or name in (".", ".."):
        raise UserError(f"{where}preset '{name}' is a path, not a preset's name ({', '.join(preset_names())}); give a "
                        f"config file with --config FILE")
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        raise UserError(f"{where}unknown preset '{name}'{closest(name, preset_names(), 'presets')}")
    return path


def preset_layer(name: str) -> dict[str, Any]:
    raw = read_config_file(preset_path(name))
    raw["preset"] = name
    return raw


def preset_config(name: str) -> Config:
    """The preset alone, unvalidated: what the presets table shows and the CPU ranks' advice sizes."""
    cfg = Config()
    apply_layer(cfg, preset_layer(name), f"presets/{name}.json")
    return cfg


def base_preset(args: argparse.Namespace, files: list[tuple[str, dict[str, Any]]]) -> str:
    """The preset the other layers go over: --debug or --preset, else the "preset" a config file names, else
    production. A file's "preset" beside another choice would be silently overridden, so every preset named, by the
    flags and the files, must be the same one."""
    if args.debug and args.preset and args.preset != "debug":
        raise UserError(f"--debug selects the debug preset; drop it or drop --preset {args.preset}")
    chosen, chosen_by = ("debug", "--debug") if args.debug else (args.preset, f"--preset {args.preset}")
    if chosen is not None:
        preset_path(chosen)
    for origin, raw in files:
        if "preset" not in raw:
            continue
        name = coerce(raw["preset"], str, "preset", origin)
        preset_path(name, origin)
        if chosen is None:
            chosen, chosen_by = name, f"{origin}'s preset '{name}'"
        elif name != chosen:
            raise UserError(f"{origin} names preset '{name}', which conflicts with {chosen_by}; a run has one base "
                            f"preset: drop one of them")
    return DEFAULT_PRESET if chosen is None else chosen


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every entry point shares (supervisor, pretrain_main.py, prepare_dataset.py)."""
    g = parser.add_argument_group("configuration (preset < --config files < flags)")
    g.add_argument("--preset", help=f"a preset from presets/ (default: {DEFAULT_PRESET}; see --list-presets)")
    g.add_argument("--debug", action="store_true", help="the debug preset: 2 layers, 10 steps, NaN localisation")
    g.add_argument("--config", action="append", default=[], metavar="FILE", help="a JSON config; repeatable")
    g.add_argument("--max-steps", type=int, metavar="N")
    g.add_argument("--batch-size", type=int, metavar="N", help="sequences per GPU per micro-step")
    g.add_argument("--lr", type=float, metavar="X", help="peak learning rate")
    g.add_argument("--context-length", type=int, metavar="N")
    g.add_argument("--max-samples", metavar="N", help="documents to use: 500, 500k, 5M, 50M")
    g.add_argument("--model-name", metavar="NAME_OR_PATH", help="start from a hub name or local model folder")
    g.add_argument("--resume", metavar="auto|PATH", help="resume from the latest checkpoint or a given one")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="any key; the value is parsed as JSON when it parses, else taken as a string")
    g.add_argument("--list-presets", action="store_true", help="print the presets table and exit")
    g.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")


FLAG_KEYS = {
    "max_steps": "training.max_steps",
    "batch_size": "training.batch_size",
    "lr": "training.learning_rate",
    "context_length": "data.context_length",
    "max_samples": "data.max_samples",
    "model_name": "model.name_or_path",
    "resume": "checkpoint.resume",
}


def parse_set(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or "." not in key:
        raise UserError(f"--set {item}: expected SECTION.KEY=VALUE, for example --set training.max_steps=100")
    try:  # NaN and Infinity parse: the key's bound then says it must be finite
        value = json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKey as e:  # JSON all the same, that would silently lose a member
        raise UserError(f"--set {item}: {e}") from None
    except (ValueError, RecursionError):  # not JSON, or too deep for the parser: taken as a string
        value = text
    return key.strip(), value


def flags_layer(args: argparse.Namespace) -> dict[str, Any]:
    layer: dict[str, dict[str, Any]] = {}
    pairs = [(dotted, getattr(args, attr)) for attr, dotted in FLAG_KEYS.items() if getattr(args, attr, None) is not None]
    pairs += [parse_set(item) for item in getattr(args, "set", [])]
    for dotted, value in pairs:
        section, _, key = dotted.partition(".")
        layer.setdefault(section, {})[key] = value
    return layer


def resolve(args: argparse.Namespace) -> Config:
    """Apply preset < config files < flags, then validate."""
    if "" in (path.strip() for path in args.config):  # Path("") would be the working folder
        raise UserError("--config is empty; give a JSON config file's path")
    files = [(path, read_config_file(Path(path))) for path in args.config]
    name = base_preset(args, files)
    cfg = Config()
    apply_layer(cfg, preset_layer(name), f"presets/{name}.json")
    for origin, raw in files:
        apply_layer(cfg, raw, origin)
    flags = flags_layer(args)
    apply_layer(cfg, flags, "command line")
    cfg.preset = name
    users_layers = [raw for _, raw in files] + [flags]
    if not any("warmup_steps" in (raw.get("training") or {}) for raw in users_layers):
        fit_warmup(cfg)
    validate(cfg)
    return cfg


WARMUP_SHARE = 10  # a warm-up that came from a preset and does not fit a short run becomes 1/10 of it


def fit_warmup(cfg: Config) -> None:
    """A trial run (`--max-steps 10`) shorter than the preset's warm-up: shrink the warm-up to a tenth of the run and
    record why in `cfg.notes`. Only for a warm-up the user did not set: theirs stays, and `validate` rejects it."""
    t = cfg.training
    if t.warmup_steps < t.max_steps or t.max_steps <= 0:
        return
    fitted = t.max_steps // WARMUP_SHARE
    cfg.notes.append(f"training.warmup_steps {t.warmup_steps} (preset '{cfg.preset}') does not fit a "
                     f"{t.max_steps}-step run: shortened to {fitted} ({100 // WARMUP_SHARE} % of the run); set training.warmup_steps to "
                     f"choose")
    t.warmup_steps = fitted


# ---------------------------------------------------------------------------------------------------------------------
# The presets table


def presets_table() -> list[dict[str, str]]:
    rows = []
    for name in preset_names():
        cfg = preset_config(name)
        m = cfg.model
        rows.append({
            "name": name,
            "layers/heads/hidden": f"{m.num_layers}/{m.num_heads}/{m.hidden_size}",
            "params": human(parameter_count(cfg)),
            "tokens/step (per GPU)": human(tokens_per_step(cfg)),
            "steps": str(cfg.training.max_steps),
            "use case": cfg.description,
        })
    return rows


def print_presets_table() -> None:
    from rich.console import Console
    from rich.table import Table

    rows = presets_table()
    table = Table(title="presets")
    for column in rows[0]:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row.values())
    Console(width=160).print(table)


def handle_inspection_flags(args: argparse.Namespace) -> Config | None:
    """--list-presets and --print-config print and tell the caller to exit (None); otherwise the resolved config."""
    if args.list_presets:
        print_presets_table()
        return None
    cfg = resolve(args)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return None
    return cfg
