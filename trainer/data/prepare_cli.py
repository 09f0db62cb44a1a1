"""`prepare_dataset.py`: build (or reuse) the token cache for a config, and inspect or prune the cache folder.

Same configuration flags as every entry point (preset < --config files < flags), plus --force, --verify, --list and
--remove KEY. A cache hit imports neither torch, transformers nor datasets, so it answers well under a second.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from trainer.config import Config
from trainer.config.resolve import add_config_arguments, handle_inspection_flags
from trainer.data.cache import (
    CacheInfo,
    TokenCache,
    cache_root,
    config_paths,
    prepare,
)
from trainer.data.cache_folder import CacheEntry, list_caches, remove_cache
from trainer.data.mixture import MIXTURES_DIR, read_mixture
from trainer.data.paths import path_errors_named
from trainer.errors import USER_ERROR_EXIT_CODE, UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_dataset.py",
        description="Tokenize the configured corpus once into cache/datasets/<key>/ (or reuse it) for every rank.")
    add_config_arguments(parser)
    g = parser.add_argument_group("cache")
    g.add_argument("--force", action="store_true", help="rebuild even when a valid cache exists")
    g.add_argument("--verify", action="store_true",
                   help="read every source file by content (not trusting digests remembered under unchanged stats) "
                        "and re-hash every file of the cache against its manifest")
    g.add_argument("--list", action="store_true", help="list the caches: size, age, key material")
    g.add_argument("--remove", metavar="KEY", help="remove the cache with this key (or a unique prefix)")
    g.add_argument("--quiet", action="store_true", help="no progress output while building")
    return parser


def interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT while the dataset is prepared: the first interrupts it (KeyboardInterrupt); any later one is ignored, so
    that an impatient second Ctrl-C cannot cut short what follows (the build's clean-up, which waits for the batch
    being encoded, the exit) and print a traceback from the middle of it. The supervisor and its build child (which
    gets the terminal's Ctrl-C too) both prepare under it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, interrupt_once)
    args = build_parser().parse_args(argv)
    try:
        cfg = handle_inspection_flags(args)
        if cfg is None:
            return 0
        with path_errors_named(config_paths(cfg.data)):
            if args.list:
                print_caches(cfg)
            elif args.remove is not None:
                print(f"removed {remove_cache(cache_root(cfg.data), args.remove)}")
            else:
                started = time.perf_counter()
                info = prepare(cfg, force=args.force, show_progress=False if args.quiet else None, rehash=args.verify)
                print_info(info, cfg, time.perf_counter() - started)
                if args.verify:
                    verify(info)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def verify(info: CacheInfo) -> None:
    """--verify: every file of the cache (each source's, for a mixture) re-hashed against its manifest."""
    caches = [TokenCache.open(source.path) for source in info.sources or [info]]
    for cache in caches:
        cache.verify()
    print(f"verify:     ok ({sum(len(c.manifest['files']) for c in caches)} files of {len(caches)} "
          f"cache{'s' * (len(caches) > 1)} match their blake2b checksums; the source files were read by content)")


def print_info(info: CacheInfo, cfg: Config, wall: float) -> None:
    """What was built or found: the cache, or the mixture and each of its sources' caches."""
    status = f"built in {wall:.2f} s" if info.built else f"hit in {wall:.2f} s (no tokenizing)"
    if not info.sources:
        print_cache(info, status, "")
        return
    assert cfg.data.mixture is not None
    print(f"{'mixture:':<11} {info.key} ({len(info.sources)} sources)\n{'path:':<11} {info.path}\n"
          f"{'status:':<11} {status}")
    for (name, weight), source in zip(cfg.data.mixture.items(), info.sources):
        print(f"source {name} (weight {weight:g}):")
        print_cache(source, "built" if source.built else "hit", "    ")


def print_cache(info: CacheInfo, status: str, indent: str) -> None:
    manifest = TokenCache.open(info.path).manifest
    train, val = manifest["train"], manifest["val"]
    rate = (info.tokens + info.val_tokens) / info.build_seconds if info.build_seconds > 0 else 0.0
    train_seconds = manifest["tokenizer"].get("train_seconds", 0.0)
    lines = [
        ("key", info.key),
        ("path", str(info.path)),
        ("status", status),
        ("source", manifest["description"]["source"]),
        ("tokenizer", f"{manifest['description']['tokenizer']} (vocabulary {info.vocab_size:,}"
                      + (f", trained in {train_seconds:.1f} s" if train_seconds else "") + ")"),
        ("documents", f"{info.documents:,} ({train['documents']:,} training, {val['documents']:,} validation)"),
        ("tokens", f"{info.tokens:,} training + {info.val_tokens:,} validation"),
        ("dtype", info.dtype),
        ("build time", f"{info.build_seconds:.2f} s" + ("" if info.built else " (when built)")),
        ("tokens/s", f"{rate / 1e6:.2f} M (tokenizing and writing; tokenizer training excluded)"),
        ("peak RSS", f"{info.peak_rss_bytes / 1e9:.2f} GB" + ("" if info.built else " (when built)")),
    ]
    for label, value in lines:
        print(f"{indent}{label + ':':<11} {value}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def material_lines(entry: CacheEntry) -> list[str]:
    """The key material, readable: what the source and tokenizer are, then the exact values that were hashed."""
    if entry.manifest is None:
        return []
    m = entry.manifest
    material = dict(m["key_material"])
    source, tokenizer = material.pop("source"), material.pop("tokenizer")
    return [f"source:    {m['description']['source']} {json.dumps(source, sort_keys=True)}",
            f"tokenizer: {m['description']['tokenizer']} {json.dumps(tokenizer, sort_keys=True)}",
            "settings:  " + ", ".join(f"{k} {v}" for k, v in sorted(material.items()))]


def print_mixtures(root: Path) -> None:
    """The mixtures prepared in `root`: each source with its weight and the key of its cache (listed below)."""
    for path in sorted((root / MIXTURES_DIR).glob("*.json")):
        try:
            key, sources = read_mixture(path)
        except UserError as e:
            print(f"mixture {path.stem}  invalid: {e}")
            continue
        print(f"mixture {key}  {len(sources)} sources")
        for source in sources:
            print(f"    {source.source}  weight {source.weight:g}  cache {source.key}")


def print_caches(cfg: Config) -> None:
    """A rich table on a terminal; plain, greppable blocks (nothing wrapped) when piped."""
    root = cache_root(cfg.data)
    entries = list_caches(root)
    if not entries:
        print(f"no token caches in {root}")
        return
    print_mixtures(root)
    rows = []
    for e in entries:
        m = e.manifest or {}
        rows.append((e.key, human_bytes(e.bytes), human_age(e.age_seconds),
                     f"{m['train']['documents'] + m['val']['documents']:,}" if m else "-",
                     f"{m['train']['tokens'] + m['val']['tokens']:,}" if m else "-", m.get("dtype", "-"),
                     "ok" if e.problem is None else f"invalid: {e.problem}", material_lines(e)))
    if not sys.stdout.isatty():
        print(f"token caches in {root}")
        for key, size, age, documents, tokens, dtype, status, material in rows:
            print(f"{key}  {size}  {age} old  {documents} documents  {tokens} tokens  {dtype}  {status}")
            for line in material:
                print(f"    {line}")
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"token caches in {root}")
    for column in ("key", "size", "age", "documents", "tokens", "dtype", "status", "key material"):
        table.add_column(column, overflow="fold", no_wrap=column != "key material")
    for *cells, material in rows:
        table.add_row(*map(escape, cells), escape("\n".join(material)))
    Console().print(table)
