"""Token cache at the scale users bring: corpora generated in a temporary folder (the standard library's text repeated;
nothing is downloaded), measured side by side with `datasets.map` in one run.

    python bench/bench_cache_scale.py [--scale-mb 1024] [--hit-mb 100] [--hit-gb 10]

`--scale-mb` of JSONL (one document per row) and the same text as ONE .txt document.
Each is built by `prepare_dataset.py` (the BPE trained once on the standard library, given by path) and, on the same
files, by `datasets.map(num_proc=<cores>)`: tokens/s and peak RSS. A single-document .txt cannot go through
`datasets` at all (one row of the whole file), so its map baseline reads the file with `sample_by="paragraph"`. At
`--hit-mb` the same pair is built, plus the .txt cut by paragraphs (one huge document against many small ones, same
text); then the wall time of a cache hit (`python prepare_dataset.py`, a fresh process) at both sizes, next to a hit
that must re-read the sources (digest memo removed). Last, the hit on a `--hit-gb` corpus (files of `--scale-mb`, each
its own copy on disk): the first launch hashes every byte, the next ones stat; the cache holds the first
`HIT_CORPUS_SAMPLES` documents (`data.max_samples`), which leaves the key, and so the hit's work, that of the whole
corpus, while sparing a build of billions of tokens. The page cache is dropped before the cold launches where the
machine allows it, so those read from the disk.
Each measurement runs in a fresh interpreter (`bench_cache.child`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from bench_cache import child, config_for, hit_seconds, prepare, work_folder  # beside this file (it puts the project on the path)

from trainer.data.corpus import StdlibCorpus

HIT_CORPUS_SAMPLES = 2_000  # documents cached of the --hit-gb corpus (its key still covers every byte)


def generate_corpus(folder: Path, megabytes: int) -> tuple[Path, Path]:
    """The standard library's text repeated to `megabytes`: as JSONL rows, and as one .txt document (files joined by
    blank lines). Written in streaming fashion; the same characters either way."""
    documents = [d for d in StdlibCorpus().documents() if "\0" not in d]
    jsonl, txt = folder / f"corpus_{megabytes}mb.jsonl", folder / f"corpus_{megabytes}mb.txt"
    written = 0
    with open(jsonl, "w") as rows, open(txt, "w") as text:
        while written < megabytes * 1_000_000:
            for document in documents:
                rows.write(json.dumps({"text": document}) + "\n")
                text.write(document + "\n\n")
                written += len(document.encode()) + 2
                if written >= megabytes * 1_000_000:
                    break
    return jsonl, txt


def build_ours(work: Path, tokenizer: Path, source: Path, sample_by: str = "document") -> tuple[dict, Path]:
    config = work / f"{source.name}-{sample_by}.json"
    config_for(work / "scale-cache", source=str(source), tokenizer=str(tokenizer), sample_by=sample_by).save(config)
    return child("ours", str(config)), config


def scale(work: Path, tokenizer: Path, megabytes: int, hit_megabytes: int) -> None:
    """The figures as they come (a long run on a shared machine: each line is printed when measured). Rates are given
    per second of wall time and per CPU-second (all threads and worker processes), the second barely moved by other
    load on the machine."""
    rates: dict[tuple[str, int], tuple[float, float]] = {}

    def measure(label: str, size: int, result: dict) -> None:
        rates[label, size] = result["tokens"] / result["seconds"], result["tokens"] / result["cpu"]
        print(f"  {label:<38} {size:>5} MB {result['tokens']:>12,} tokens {rates[label, size][0] / 1e6:6.2f} M tok/s "
              f"{rates[label, size][1] / 1e6:6.2f} M tok/CPU-s  peak RSS {result['rss_peak_mb']:>5.0f} MB "
              f"({result['seconds']:.0f} s)", flush=True)

    def ratio(a: str, b: str, size: int) -> str:
        return (f"{rates[a, size][0] / rates[b, size][0]:.2f}x per second, "
                f"{rates[a, size][1] / rates[b, size][1]:.2f}x per CPU-second")

    for size in (hit_megabytes, megabytes):
        jsonl, txt = generate_corpus(work, size)
        print(f"{size} MB corpus: {jsonl.stat().st_size / 1e6:,.0f} MB JSONL, {txt.stat().st_size / 1e6:,.0f} MB .txt",
              flush=True)
        measure("ours, .txt as one document", size, build_ours(work, tokenizer, txt)[0])
        result, config = build_ours(work, tokenizer, jsonl)
        measure("ours, JSONL", size, result)
        if size == hit_megabytes:
            measure("ours, the same .txt cut by paragraphs", size, build_ours(work, tokenizer, txt, "paragraph")[0])
            print(f"  one huge document / many small ones (same text): "
                  f"{ratio('ours, .txt as one document', 'ours, the same .txt cut by paragraphs', size)} "
                  f"(target: within 15 %)", flush=True)
        hit_seconds(config, runs=1)  # the first launch after the build remembers the digests of the new files
        hit = hit_seconds(config)
        (work / "scale-cache" / ".file-digests.json").unlink()
        cold = hit_seconds(config, runs=1)
        print(f"  cache hit, python prepare_dataset.py: median {hit[0]:.2f} s wall, {hit[1]:.2f} s CPU over 5 launches "
              f"(target <= 1 s); {cold[0]:.2f} s wall, {cold[1]:.2f} s CPU when the sources must be read again "
              f"(digest memo removed)", flush=True)
        if size == megabytes:
            measure("datasets.map, JSONL", size, child("map_files", str(tokenizer), str(jsonl)))
            print(f"  ours/map, JSONL: {ratio('ours, JSONL', 'datasets.map, JSONL', size)} (target >= 1.5x)",
                  flush=True)
            measure("datasets.map, .txt by paragraphs", size, child("map_files", str(tokenizer), str(txt)))
            print(f"  ours/map, .txt: {ratio('ours, .txt as one document', 'datasets.map, .txt by paragraphs', size)}"
                  f" (target >= 1.5x)", flush=True)
        for path in (jsonl, txt):
            path.unlink()


def drop_page_cache() -> bool:
    """Ask the kernel to forget cached file pages (root only), so the next reads come from the disk."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def large_corpus_hit(work: Path, tokenizer: Path, gigabytes: int, file_mb: int) -> None:
    """The hit on a corpus of `gigabytes`: files of `file_mb` each, copies of one generated JSONL file."""
    folder = work / f"corpus_{gigabytes}gb"
    folder.mkdir()
    first, txt = generate_corpus(work, file_mb)
    txt.unlink()
    files = [folder / f"part_{i:03d}.jsonl" for i in range(-(-gigabytes * 1000 // file_mb))]
    for path in files:
        shutil.copyfile(first, path)
    first.unlink()
    config = work / "hit-corpus.json"
    config_for(work / "hit-cache", source=str(folder), tokenizer=str(tokenizer),
               max_samples=HIT_CORPUS_SAMPLES).save(config)
    size = sum(path.stat().st_size for path in files)
    cold = drop_page_cache()
    build = hit_seconds(config, runs=1)  # hashes every byte, builds the capped cache, remembers the digests
    hit = hit_seconds(config)
    dropped = drop_page_cache()
    hit_cold = hit_seconds(config, runs=1)
    print(f"{size / 1e9:.1f} GB corpus ({len(files)} files): first launch (hash every byte{', page cache dropped' * cold}"
          f", build the first {HIT_CORPUS_SAMPLES:,} documents) {build[0]:.1f} s; cache hit, python prepare_dataset.py: "
          f"median {hit[0]:.2f} s wall, {hit[1]:.2f} s CPU over 5 launches, {hit_cold[0]:.2f} s wall "
          f"{'after dropping the page cache' if dropped else '(page cache not droppable here)'} (target <= 1 s)",
          flush=True)
    shutil.rmtree(folder)


# ---------------------------------------------------------------------------------------------------------------------
# Scaling with cores: bench_gpu.py's cache section, for a machine with cores to spare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale-mb", type=int, default=1024, help="the large generated corpus, in MB")
    parser.add_argument("--hit-mb", type=int, default=100, help="the smaller one (hit time, one vs many documents)")
    parser.add_argument("--hit-gb", type=int, default=10, help="the corpus whose cache hit is timed last (0: skip)")
    args = parser.parse_args()
    with work_folder("bench-cache-scale-") as work:
        tokenizer = prepare(config_for(work / "scale-cache"), show_progress=False).path  # BPE 8192, stdlib
        scale(work, tokenizer, args.scale_mb, args.hit_mb)
        if args.hit_gb:
            large_corpus_hit(work, tokenizer, args.hit_gb, args.scale_mb)

if __name__ == "__main__":
    main()
