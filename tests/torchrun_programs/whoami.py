"""A rank's process seen from inside: ``whoami.py DIR`` writes ``DIR/rank<RANK>.json`` (where its ``import trainer``
found that package, its ``sys.argv[0]`` and ``sys.executable``, PYTHONPATH, OMP_NUM_THREADS,
TORCHELASTIC_SIGNALS_TO_HANDLE) and prints ``rank <RANK> here``. The package imported is the user's own ``trainer``
where PYTHONPATH names one.
"""

import json
import os
import sys
from pathlib import Path

import trainer

VARIABLES = ("PYTHONPATH", "OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE")
record = {"trainer": trainer.__file__, "argv0": sys.argv[0], "python": sys.executable,
          **{name: os.environ.get(name) for name in VARIABLES}}
Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
print("rank", os.environ["RANK"], "here")
