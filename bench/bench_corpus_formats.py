"""Corpus formats side by side: the same rows as JSONL, `.jsonl.zst`, `.jsonl.gz` and Parquet shards laid out as a hub
snapshot, each tokenized into a token cache by `prepare_dataset.py`'s code, and `datasets.map` on the same Parquet
shards; tokens/s and peak RSS, measured in one run (generated data: the standard library's text repeated; nothing is
downloaded).

    python bench/bench_corpus_formats.py [--mb 1024]

The BPE (8,192) is trained once on the standard library and given by path, so every build does the same tokenizing
work; each measurement runs in a fresh interpreter (`bench_cache.child`: `child_ours`, and `child_map_files` for the Parquet shards). Goals: Parquet
≥ 1.0× JSONL's tokens/s with a peak RSS ≤ 600 MB; compressed JSONL ≥ 0.9× plain JSONL.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from bench_cache import child, config_for, prepare, work_folder  # beside this file (sets the path)
from bench_cache_scale import generate_corpus

SHARDS = 4  # Parquet files, as data/train-0000i-of-00004.parquet
ROW_GROUP_ROWS = 2_000  # rows per Parquet row group (a few tens of MB of text: what hub shards hold)
COPY_CHUNK = 1 << 20



def compressed_copies(jsonl: Path) -> dict[str, Path]:
    """The JSONL file as .jsonl.zst (level 3, zstd's default) and .jsonl.gz (level 6, gzip's), streamed."""
    import zstandard

    zst, gz = jsonl.with_name(jsonl.name + ".zst"), jsonl.with_name(jsonl.name + ".gz")
    with open(jsonl, "rb") as source, open(zst, "wb") as out:
        zstandard.ZstdCompressor(level=3).copy_stream(source, out)
    with open(jsonl, "rb") as source, gzip.open(gz, "wb", compresslevel=6) as out:
        shutil.copyfileobj(source, out, COPY_CHUNK)
    return {".jsonl.zst": zst, ".jsonl.gz": gz}


def parquet_snapshot(jsonl: Path, folder: Path) -> Path:
    """The JSONL rows as `SHARDS` Parquet files in a hub snapshot's layout (snappy, pyarrow's default), streamed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(jsonl) as f:
        rows = sum(1 for _ in f)
    data = folder / "data"
    data.mkdir(parents=True)
    per_shard = -(-rows // SHARDS)
    schema = pa.schema([("text", pa.string())])
    with open(jsonl) as f:
        for shard in range(SHARDS):
            with pq.ParquetWriter(data / f"train-{shard:05d}-of-{SHARDS:05d}.parquet", schema) as writer:
                left = per_shard
                while left > 0:
                    texts = [json.loads(line)["text"] for _, line in zip(range(min(ROW_GROUP_ROWS, left)), f)]
                    if not texts:
                        break
                    writer.write_table(pa.table({"text": texts}, schema=schema))
                    left -= len(texts)
    return folder



def formats(work: Path, tokenizer: Path, megabytes: int) -> None:
    jsonl, txt = generate_corpus(work, megabytes)
    txt.unlink()
    sources = {"JSONL": jsonl, **{f"JSONL {k}": v for k, v in compressed_copies(jsonl).items()},
               "Parquet, 4 shards (ours: pyarrow)": parquet_snapshot(jsonl, work / "snapshot")}
    sizes = {label: sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*.parquet")))
             for label, path in sources.items()}
    print(f"{megabytes} MB corpus: " + ", ".join(f"{label} {size / 1e6:,.0f} MB" for label, size in sizes.items()),
          flush=True)
    results = {}
    for label, path in sources.items():
        config = work / f"{len(results)}.json"
        config_for(work / "formats-cache", source=str(path), tokenizer=str(tokenizer)).save(config)
        results[label] = child("ours", str(config))
        report(label, results[label])
    results["datasets.map on the Parquet shards"] = child("map_files", str(tokenizer), str(work / "snapshot"))
    report("datasets.map on the Parquet shards", results["datasets.map on the Parquet shards"])
    rate = {label: r["tokens"] / r["seconds"] for label, r in results.items()}
    per_cpu = {label: r["tokens"] / r["cpu"] for label, r in results.items()}
    for label, goal in (("JSONL .jsonl.zst", "0.9"), ("JSONL .jsonl.gz", "0.9"),
                        ("Parquet, 4 shards (ours: pyarrow)", "1.0")):
        print(f"  {label} / JSONL: {rate[label] / rate['JSONL']:.2f}x per second, "
              f"{per_cpu[label] / per_cpu['JSONL']:.2f}x per CPU-second (goal >= {goal}x)", flush=True)
    ours, theirs = "Parquet, 4 shards (ours: pyarrow)", "datasets.map on the Parquet shards"
    print(f"  Parquet, ours / datasets.map: {rate[ours] / rate[theirs]:.2f}x per second, "
          f"{per_cpu[ours] / per_cpu[theirs]:.2f}x per CPU-second; peak RSS {results[ours]['rss_peak_mb']:.0f} MB "
          f"(goal <= 600 MB)", flush=True)


def report(label: str, result: dict) -> None:
    print(f"  {label:<36} {result['tokens']:>12,} tokens {result['tokens'] / result['seconds'] / 1e6:6.2f} M tok/s "
          f"{result['tokens'] / result['cpu'] / 1e6:6.2f} M tok/CPU-s  peak RSS {result['rss_peak_mb']:>5.0f} MB "
          f"({result['seconds']:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=1024, help="the generated corpus, in MB of text")
    args = parser.parse_args()
    with work_folder("bench-formats-") as work:
        tokenizer = prepare(config_for(work / "formats-cache"), show_progress=False).path  # BPE 8192, stdlib
        formats(work, tokenizer, args.mb)

if __name__ == "__main__":
    main()
