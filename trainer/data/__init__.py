"""The data pipeline, from documents to the batches a rank trains on; the tokenizing half runs once per run, in the
supervisor (or `prepare_dataset.py`), the reading half in every rank.

* `corpus` — where documents come from (the standard library, local files, a hub dataset) and its content key;
* `formats` — the file formats a local corpus is read from: plain or compressed JSON Lines and text, Parquet;
* `tokenizer` — a byte-level BPE trained on the corpus, or any AutoTokenizer;
* `token_stream` — tokenizing into flat files, streaming, on every core;
* `pieces` — how a `.txt` file becomes documents (``data.sample_by``) and a document of any size becomes pieces cut
  where pre-tokenizers split words anyway;
* `digests` — content digests of files, and the memo that re-reads only the files that changed;
* `cache` — the token cache: build once under a content key, publish atomically, memory-map read-only;
* `cache_folder` — the caches on disk as ``prepare_dataset.py --list`` and ``--remove`` see them;
* `paths` — a path the OS cannot use (too long, a link leading nowhere, no permission) said as the key that named it;
* `staging` — building a folder among concurrent builders: the lock, the staging folder, atomic publication;
* `build_progress` — what a build shows while it runs;
* `mixture` — weighted mixtures of sources: which source each sample comes from, the record naming their caches;
* `batches` — deterministic, rank-sharded batches straight from the memory map (of one cache, or of a mixture's);
* `training_data` — what a rank trains on: a cache or a mixture's caches, with their samplers and reports;
* `documents` — which documents of the corpus a step's batch holds (offsets, first characters);
* `prepare_cli` — the command line of `prepare_dataset.py`.
"""

# The token cache (or mixture record) the supervisor found for the run's config before starting any rank: its ranks
# open it as it is instead of keying the corpus again (a stat per source file, every rank of every group).
TOKEN_CACHE_ENV = "SUPERVISOR_TOKEN_CACHE"
