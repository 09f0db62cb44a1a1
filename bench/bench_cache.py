"""Token cache benchmark: figures measured side by side in one run, printed as ratios against the anchors.

    python bench/bench_cache.py [--rounds 3] [--vocab-size 8192] [--skip-large]

1. Throughput on the default corpus (every stdlib `*.py` file, byte-level BPE trained once on it; training time is
   reported apart and excluded, as the anchor does), each method in its own fresh process, interleaved over rounds:
     ours   `prepare(force=True)`: key, read, encode, write, checksum, fsync, rename (the whole build)
     map    `datasets.Dataset.map(batched=True, num_proc=<cores>)` + `save_to_disk`, the same tokenizer
     raw    `Tokenizer.encode_batch` over all documents held in memory (the anchor's practical limit)
     raw_fast  the same with `encode_batch_fast` (no character offsets), the call the build itself makes
   Targets: ours >= 1.5x map and >= 0.95x raw.
2. Peak RSS of a build, for the default corpus and, through a local JSONL source, for 1x against 3x the corpus
   (bounded: it must not grow with the source).
3. Cache-hit wall time of `python prepare_dataset.py` (target <= 1 s).
4. Reading: 2 processes memory-map a large cache and read all of it through BatchSampler; their private memory (USS)
   and anonymous memory growth against the file size, next to a reader that loads a private copy (np.fromfile).

Corpora of the size users bring (1 GB, 10 GB) are `bench_cache_scale.py`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from trainer.config import Config  # noqa: E402
from trainer.data.cache import (  # noqa: E402
    OFFSETS_FILE,
    TOKENS_FILE,
    VAL_OFFSETS_FILE,
    VAL_TOKENS_FILE,
    TokenCache,
    digest,
    prepare,
    write_manifest,
)
from trainer.data.corpus import StdlibCorpus  # noqa: E402
from trainer.data.staging import publish, staging  # noqa: E402
from trainer.data.token_stream import TokenStream  # noqa: E402
from trainer.data.tokenizer import export, load_fast  # noqa: E402

ANCHORS = {"map": 0.47, "raw": 0.74}  # M tokens/s on the reference 2-core machine (ANCHORS.md)


def config_for(cache_dir: Path, **data: object) -> Config:
    return Config.from_dict({"data": {"source": "stdlib", "tokenizer": "bpe", "vocab_size": 8192,
                                      "context_length": 1024, "max_samples": None, "val_fraction": 0.01,
                                      "cache_dir": str(cache_dir), **data}})


def child(mode: str, *args: str) -> dict:
    """Run one measurement in a fresh interpreter (no warm tokenizer threads, no forked parallelism, own RSS)."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", mode, *args], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def proc_status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status: VmHWM (peak RSS of this process image; unlike
    ru_maxrss it does not inherit the parent's peak across fork+exec), VmRSS, or RssAnon (private, not file-backed)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def max_rss_mb() -> float:
    return proc_status_mb("VmHWM")


def cpu_seconds() -> float:
    """CPU time of this process, all threads, plus its finished child processes (map's workers)."""
    own, children = os.times()[:2], os.times()[2:4]
    return sum(own) + sum(children)


# ---------------------------------------------------------------------------------------------------------------------
# Child measurements


def child_ours(config: str) -> dict:
    cfg = Config.load(config)
    before = max_rss_mb()
    cpu, started = cpu_seconds(), time.perf_counter()
    info = prepare(cfg, force=True, show_progress=False)
    seconds = time.perf_counter() - started
    return {"tokens": info.tokens + info.val_tokens, "seconds": seconds, "cpu": cpu_seconds() - cpu,
            "rss_before_mb": before,
            "rss_peak_mb": max_rss_mb(), "documents": info.documents}


def child_raw(tokenizer_folder: str, method: str = "encode_batch") -> dict:
    tokenizer = load_fast(Path(tokenizer_folder))
    documents = list(StdlibCorpus().documents())
    cpu, started = cpu_seconds(), time.perf_counter()
    encodings = getattr(tokenizer, method)(documents)
    tokens = sum(len(e.ids) for e in encodings)
    return {"tokens": tokens, "seconds": time.perf_counter() - started, "cpu": cpu_seconds() - cpu}


def child_map(tokenizer_folder: str) -> dict:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    documents = list(StdlibCorpus().documents())
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(tokenizer_folder) / "tokenizer.json"),
                                 eos_token="<|endoftext|>")
    work = Path(tempfile.mkdtemp(prefix="bench-map-"))
    try:
        cpu, started = cpu_seconds(), time.perf_counter()
        dataset = datasets.Dataset.from_dict({"text": documents})

        def tokenize(batch: dict) -> dict:
            ids = hf(batch["text"])["input_ids"]
            return {"ids": [x + [hf.eos_token_id] for x in ids], "len": [len(x) + 1 for x in ids]}

        mapped = dataset.map(tokenize, batched=True, remove_columns=["text"], num_proc=os.cpu_count(),
                             cache_file_name=str(work / "m.arrow"))
        mapped.save_to_disk(str(work / "saved"))
        seconds = time.perf_counter() - started
        return {"tokens": int(sum(mapped["len"])), "seconds": seconds, "cpu": cpu_seconds() - cpu}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def child_map_files(tokenizer_folder: str, path: str) -> dict:
    """datasets' own way on the files: load (Arrow conversion), map(num_proc=cores), save_to_disk. `path`: a
    `.jsonl`, a `.txt` (by paragraphs), or a folder of Parquet shards."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(tokenizer_folder) / "tokenizer.json"),
                                 eos_token="<|endoftext|>")
    work = Path(tempfile.mkdtemp(prefix="bench-map-", dir=Path(path).parent))
    try:
        cpu, started = cpu_seconds(), time.perf_counter()
        files = sorted(str(p) for p in Path(path).rglob("*.parquet")) if Path(path).is_dir() else [path]
        builder, options = (("parquet", {}) if Path(path).is_dir() else ("json", {}) if path.endswith(".jsonl")
                            else ("text", {"sample_by": "paragraph"}))
        dataset = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=str(work / "hf"),
                                        **options)

        def tokenize(batch: dict) -> dict:
            ids = hf(batch["text"])["input_ids"]
            return {"ids": [x + [hf.eos_token_id] for x in ids], "len": [len(x) + 1 for x in ids]}

        mapped = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, num_proc=os.cpu_count())
        mapped.save_to_disk(str(work / "saved"))
        seconds = time.perf_counter() - started
        tokens = int(np.sum(mapped.with_format("numpy")["len"]))
        return {"tokens": tokens, "seconds": seconds, "cpu": cpu_seconds() - cpu, "rss_peak_mb": max_rss_mb()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def child_reader(path: str, copy: str) -> dict:
    """Read the whole cache (one epoch of BatchSampler windows), say READ, wait for the parent, then measure."""
    from trainer.data.batches import BatchSampler  # here: that module also holds the torch DataLoader wrapper

    process = psutil.Process()
    base = process.memory_full_info()
    cache = TokenCache.open(Path(path))
    tokens = np.fromfile(cache.path / "tokens.bin", dtype=cache.train.dtype) if copy == "1" else cache.train
    sampler = BatchSampler(tokens, context_length=1024, micro_batch_size=64, grad_accum=1, world_size=1, rank=0,
                           seed=0)
    total = 0
    for step in range(-(-sampler.windows_per_epoch // 64)):
        total += int(sampler.get(step, 0)[:, 0].sum())
    print("READ", flush=True)
    sys.stdin.readline()  # both readers hold their mappings while each measures
    after = process.memory_full_info()
    print(json.dumps({"uss_mb": after.uss / 2**20, "pss_mb": after.pss / 2**20, "rss_mb": after.rss / 2**20,
                      "uss_growth_mb": (after.uss - base.uss) / 2**20, "anon_mb": proc_status_mb("RssAnon"),
                      "checksum": total}), flush=True)
    sys.stdin.readline()  # exit only once the other reader has measured too
    return {}


# ---------------------------------------------------------------------------------------------------------------------
# Parent steps


def throughput(work: Path, rounds: int, vocab_size: int) -> tuple[Config, Path]:
    cfg = config_for(work / "cache", vocab_size=vocab_size)
    config = work / "ours.json"
    cfg.save(config)
    first = prepare(cfg, show_progress=False)  # trains the BPE once (excluded, reported apart) and builds
    manifest = TokenCache.open(first.path).manifest
    tokenizer_folder = first.path
    print(f"corpus: {first.documents:,} documents, {first.tokens + first.val_tokens:,} tokens with BPE "
          f"{vocab_size:,}; tokenizer training {manifest['tokenizer']['train_seconds']:.1f} s (excluded below)")
    print(f"{'round':<6} {'ours':>7} {'map':>7} {'raw':>7} {'raw_fast':>9} {'ours/map':>9} {'ours/raw':>9}"
          f" {'ours/raw_fast':>14} {'build RSS peak':>15}   (M tokens/s)")
    ratios: dict[str, list[float]] = {"map": [], "raw": [], "raw_fast": []}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in ratios}  # tokens per CPU-second: robust to other load
    rows = []
    for r in range(rounds):
        ours = child("ours", str(config))
        results = {"map": child("map", str(tokenizer_folder)),
                   "raw": child("raw", str(tokenizer_folder), "encode_batch"),
                   "raw_fast": child("raw", str(tokenizer_folder), "encode_batch_fast")}
        rate = {k: v["tokens"] / v["seconds"] / 1e6 for k, v in (("ours", ours), *results.items())}
        per_cpu = {k: v["tokens"] / v["cpu"] / 1e6 for k, v in (("ours", ours), *results.items())}
        for name in ratios:
            ratios[name].append(rate["ours"] / rate[name])
            cpu_ratios[name].append(per_cpu["ours"] / per_cpu[name])
        rows.append((rate, ours))
        print(f"{r + 1:<6} {rate['ours']:>7.3f} {rate['map']:>7.3f} {rate['raw']:>7.3f} {rate['raw_fast']:>9.3f} "
              f"{ratios['map'][-1]:>8.2f}x {ratios['raw'][-1]:>8.2f}x {ratios['raw_fast'][-1]:>13.2f}x "
              f"{ours['rss_peak_mb']:>12.0f} MB")
    median = {name: statistics.median(values) for name, values in ratios.items()}
    best = {name: max(rate[name] for rate, _ in rows) for name in ("ours", *ratios)}
    print(f"median of the rounds: ours/map {median['map']:.2f}x (target >= 1.5x), ours/raw {median['raw']:.2f}x "
          f"(target >= 0.95x), ours/raw_fast {median['raw_fast']:.2f}x")
    print(f"best of the rounds (least disturbed by other load): ours/map {best['ours'] / best['map']:.2f}x, "
          f"ours/raw {best['ours'] / best['raw']:.2f}x, ours/raw_fast {best['ours'] / best['raw_fast']:.2f}x")
    print("tokens per CPU-second (all threads and worker processes; barely moved by other load on the machine): "
          + ", ".join(f"ours/{name} {statistics.median(values):.2f}x" for name, values in cpu_ratios.items()))
    print(f"anchors (reference machine): map {ANCHORS['map']}, raw {ANCHORS['raw']} M tok/s; here, best: ours "
          f"{best['ours']:.2f}, map {best['map']:.2f}, raw {best['raw']:.2f} (compare ratios, not absolute figures)")
    print(f"build RSS: {rows[-1][1]['rss_before_mb']:.0f} MB after imports, peak {rows[-1][1]['rss_peak_mb']:.0f} MB")
    return cfg, config


def hit_seconds(config: Path, runs: int = 5) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system: what other load on the machine does not inflate) of
    `python prepare_dataset.py` (a fresh process) hitting the cache of `config`."""
    walls, cpus = [], []
    for _ in range(runs):
        started, cpu = time.perf_counter(), sum(os.times()[2:4])
        subprocess.run([sys.executable, str(ROOT / "prepare_dataset.py"), "--config", str(config)], check=True,
                       capture_output=True, cwd=ROOT)
        walls.append(time.perf_counter() - started)
        cpus.append(sum(os.times()[2:4]) - cpu)
    return statistics.median(walls), statistics.median(cpus)


def hit_wall(config: Path, runs: int = 5) -> None:
    wall, cpu = hit_seconds(config, runs)
    print(f"cache hit, python prepare_dataset.py: median {wall:.2f} s wall ({cpu:.2f} s CPU) over {runs} runs "
          f"(target <= 1.0 s)")


def large_source_rss(work: Path, cfg: Config, scale: int = 3) -> None:
    """RSS peak building from a local JSONL of the corpus repeated `scale` times, against 1x of the same file."""
    info = prepare(cfg, show_progress=False)
    source = work / "stdlib_x3.jsonl"
    documents = list(StdlibCorpus().documents())
    with open(source, "w") as f:
        for _ in range(scale):
            for text in documents:
                f.write(json.dumps({"text": text}) + "\n")
    peaks = {}
    for label, max_samples in (("1x", len(documents)), (f"{scale}x", None)):
        config = work / f"large_{label}.json"
        config_for(work / "cache", source=str(source), tokenizer=str(info.path), max_samples=max_samples).save(config)
        peaks[label] = child("ours", str(config))
    for label, result in peaks.items():
        print(f"build from {source.name} at {label}: {result['tokens']:,} tokens, "
              f"{result['tokens'] / result['seconds'] / 1e6:.2f} M tok/s, RSS peak {result['rss_peak_mb']:.0f} MB "
              f"(after imports {result['rss_before_mb']:.0f} MB)")
    a, b = peaks["1x"]["rss_peak_mb"], peaks[f"{scale}x"]["rss_peak_mb"]
    print(f"RSS peak {scale}x / 1x source: {b / a:.2f} (bounded: stays near 1.0 while the tokens grow {scale}x)")


def large_cache(work: Path, cfg: Config, target_bytes: int) -> Path:
    """A valid cache of about `target_bytes`: the default corpus's tokens repeated, written by the cache's own writer."""
    source = TokenCache.open(prepare(cfg, show_progress=False).path)
    ids = np.asarray(source.train, dtype=np.uint32)
    offsets = np.asarray(source.doc_offsets)
    lengths = np.diff(offsets)
    repeats = max(1, target_bytes // source.train.nbytes)
    material = {"synthetic": "the default corpus's training tokens repeated", "source_key": source.key,
                "repeats": int(repeats)}
    key = digest(material)
    root = work / "cache"
    with staging(root, key, "synthetic cache") as folder:
        export(load_fast(source.path), source.path, folder, source.manifest["eos_token"])
        train = TokenStream(folder / TOKENS_FILE, folder / OFFSETS_FILE)
        val = TokenStream(folder / VAL_TOKENS_FILE, folder / VAL_OFFSETS_FILE)
        for _ in range(repeats):
            train.append(ids, lengths)
        train.close()
        val.close()
        write_manifest(folder, key=key, material=material, description={"source": "synthetic", "tokenizer": "-"},
                       train=train, val=val, vocab_size=source.vocab_size, eos_id=source.eos_id,
                       eos_token=source.manifest["eos_token"], tokenizer_train_seconds=0.0, build_seconds=0.0)
        publish(folder, root / key)
    return root / key


def readers(path: Path, copy: bool) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "reader", str(path), "1" if copy else "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    def tell(message: str) -> None:
        for p in procs:
            p.stdin.write(message + "\n")
            p.stdin.flush()

    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READ"
        tell("measure")
        results = [json.loads(p.stdout.readline()) for p in procs]
        tell("exit")
        for p in procs:
            p.wait(timeout=60)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def reading_memory(work: Path, cfg: Config) -> None:
    small = TokenCache.open(prepare(cfg, show_progress=False).path)
    big = TokenCache.open(large_cache(work, cfg, target_bytes=1 << 30))
    print(f"{'cache':<28} {'file MB':>8} {'reader':>13} {'USS MB':>8} {'USS growth':>11} {'anon MB':>8} "
          f"{'PSS MB':>8} {'RSS MB':>8}")
    for label, cache, copy in (("default corpus, memmap", small, False), ("large, memmap", big, False),
                               ("large, private copy", big, True)):
        size = cache.train.nbytes / 2**20
        for i, r in enumerate(readers(cache.path, copy)):
            print(f"{label:<28} {size:>8.0f} {f'process {i + 1}':>13} {r['uss_mb']:>8.0f} {r['uss_growth_mb']:>11.0f} "
                  f"{r['anon_mb']:>8.0f} {r['pss_mb']:>8.0f} {r['rss_mb']:>8.0f}")
    print("memmap readers share one page-cache copy: their private memory (USS, anonymous) stays flat as the file grows; "
          "a private copy costs the whole file in every process")


# ---------------------------------------------------------------------------------------------------------------------
# Scale: generated corpora of the size users bring


SMOKE_SCALING_DOCUMENTS = 12  # the first stdlib files, about 100 kB: a build a second long


def child_pinned(config: str, cores: str) -> dict:
    """One build, pinned to the first `cores` CPUs (the encoder's threads were capped by RAYON_NUM_THREADS)."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:int(cores)])
    return child_ours(config)


def core_scaling(work: Path, cache_dir: Path, corpus_tokens: int, cores: list[int],
                 smoke_data: dict[str, object] | None = None) -> str:
    """Build the same large cache with each count of `cores`; tokens/s and the fraction of linear scaling from one
    core, as a markdown table. `smoke_data`: the tiny settings of a smoke run (a BPE of 300 on a few files)."""
    smoke = smoke_data is not None
    seed_cfg = config_for(cache_dir, vocab_size=300 if smoke else 8192, context_length=32 if smoke else 1024,
                          **(smoke_data or {}))
    seed = prepare(seed_cfg, show_progress=False)  # its trained BPE tokenizes the large corpus
    repeats = max(1, math.ceil(corpus_tokens / (seed.tokens + seed.val_tokens)))
    source = work / "corpus.jsonl"
    documents = list(StdlibCorpus().documents())[:SMOKE_SCALING_DOCUMENTS if smoke else None]
    with open(source, "w") as f:
        for _ in range(repeats):
            for text in documents:
                f.write(json.dumps({"text": text}) + "\n")
    config = work / "large.json"
    config_for(work / "scaling-cache", source=str(source), tokenizer=str(seed.path),
               context_length=seed_cfg.data.context_length).save(config)
    rows, base = [], None
    for n in cores:
        done = subprocess.run([sys.executable, __file__, "--child", "pinned", str(config), str(n)], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "RAYON_NUM_THREADS": str(n)})
        if done.returncode != 0:
            rows.append(f"| {n} | failed: {done.stderr.strip().splitlines()[-1:]} | | |")
            continue
        found = json.loads(done.stdout.strip().splitlines()[-1])
        rate = found["tokens"] / found["seconds"]
        base = base or rate / n
        rows.append(f"| {n} | {found['tokens']:,} | {rate / 1e6:.2f} M | {rate / (base * n):.0%} |")
        print(f"  cache build on {n} core(s): {rate / 1e6:.2f} M tokens/s", file=sys.stderr, flush=True)
    return "\n".join([f"Cache build scaling: {source.stat().st_size / 1e6:,.0f} MB of JSONL (the standard library "
                      f"× {repeats}), BPE {seed_cfg.data.vocab_size:,}",
                      "", "| cores | tokens | tokens/s | of linear scaling |", "|---|---|---|---|", *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--skip-large", action="store_true", help="skip the 3x-source and 1 GB-cache memory runs")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        result = {"ours": child_ours, "raw": child_raw, "map": child_map, "reader": child_reader,
                  "pinned": child_pinned, "map_files": child_map_files}[mode](*rest)
        if result:
            print(json.dumps(result))
        return
    with work_folder("bench-cache-") as work:
        cfg, config = throughput(work, args.rounds, args.vocab_size)
        hit_wall(config)
        if not args.skip_large:
            large_source_rss(work, cfg)
            reading_memory(work, cfg)


@contextmanager
def work_folder(prefix: str) -> Iterator[Path]:
    """A bench's temporary folder, removed however the bench ends (SIGTERM included), between a line that says the
    machine and its load at the start and one with the wall time and the load at the end."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; load average "
          f"{os.getloadavg()[0]:.1f} at start")
    work = Path(tempfile.mkdtemp(prefix=prefix))
    started = time.perf_counter()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"(benchmark wall time {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
