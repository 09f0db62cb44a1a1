"""bench/bench_gpu.py in its smoke mode (tiny shapes, a few steps, CPU): every code path of the GPU benchmark runs in
CI, the rank through the real supervisor, the textbook loop, the cache-scaling builds, and the markdown it writes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from rank_scripts.harness import ROOT, clean_env
from rank_support import token_cache_dir  # noqa: F401 (fixture)

NUMBER = r"[\d,]+"


def test_smoke_mode_writes_the_tables(tmp_path: Path, token_cache_dir: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--smoke", "--out", str(tmp_path),
                           "--cache-dir", str(token_cache_dir)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "bench_gpu.md").read_text()
    assert text.strip() == done.stdout.strip()
    assert "| shape | run | tokens/s | MFU | peak memory | rank / plain loop |" in text
    rank = re.search(rf"^\| smoke \| rank eager \| ({NUMBER}) \| n/a \| n/a \| (\d+\.\d\d)× \|$", text, re.M)
    plain = re.search(rf"^\| smoke \| plain loop eager \| ({NUMBER}) \| n/a \| n/a \| +\|$", text, re.M)
    assert rank and plain, text
    rank_rate, plain_rate = (float(m.group(1).replace(",", "")) for m in (rank, plain))
    assert rank_rate > 0 and plain_rate > 0
    assert abs(float(rank.group(2)) - rank_rate / plain_rate) < 0.01
    assert "| cores | tokens | tokens/s | of linear scaling |" in text
    assert re.search(rf"^\| 1 \| {NUMBER} \| \d+\.\d\d M \| 100% \|$", text, re.M), text
