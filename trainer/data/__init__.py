"""The data pipeline, from documents to the batches a rank trains on; the tokenizing half runs once per run, in the
supervisor (or `prepare_dataset.py`), the reading half in every rank.

* `corpus` — where documents come from (the standard library, local files, a hub dataset) and its content key;
* `tokenizer` — a byte-level BPE trained on the corpus, or any AutoTokenizer;
* `token_stream` — tokenizing into flat files, streaming, on every core;
* `cache` — the token cache: build once under a content key, publish atomically, memory-map read-only;
* `staging` — building a folder among concurrent builders: the lock, the staging folder, atomic publication;
* `build_progress` — what a build shows while it runs;
* `batches` — deterministic, rank-sharded batches straight from the memory map;
* `prepare_cli` — the command line of `prepare_dataset.py`.
"""
