"""bench/bench_gpu.py in its smoke mode (tiny shapes, a few steps, CPU): every code path of the GPU benchmark runs on
CPU, the rank through the real supervisor (configured and a preset as shipped), the textbook loop, the cache-scaling
builds, the pieces it writes and the page made of them; the anchor script's rows through a stand-in script, since the
real one needs CUDA; and what the GPU runs and ablations will be, resolved without running them. The two tests that
train (the whole command, the plain loop) are in the slow tier, which CI runs: they test the benchmark, not the
product."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rank_scripts.harness import ROOT, clean_env

sys.path.insert(0, str(ROOT / "bench"))
import bench_gpu  # noqa: E402
import gpu_runs  # noqa: E402
import textbook_loop  # noqa: E402

NUMBER = r"[\d,]+"
SCRIPT = str(ROOT / "bench" / "bench_gpu.py")


def bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def options(tmp_path: Path, **changes: object) -> gpu_runs.Options:
    base = gpu_runs.Options(smoke=False, work=tmp_path, cache_dir=tmp_path / "cache", out=None,
                             sections=bench_gpu.SECTIONS, shapes=tuple(gpu_runs.SHAPES), runs=gpu_runs.RUN_KINDS,
                             anchor=None, corpus_tokens=0)
    return dataclasses.replace(base, **changes)


def fake_anchor(path: Path, line: str, exit_code: int = 0) -> Path:
    """A stand-in for gpu_textbook_loop.py: records its arguments beside itself, prints `line`, exits `exit_code`."""
    path.write_text(f"import json, sys\n"
                    f"open({str(path.with_suffix('.argv'))!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                    f"print('warming up')\nprint({line!r})\nsys.exit({exit_code})\n")
    return path


def smoke_line(compiled: bool, tokens_per_s: str = "12,345") -> str:
    """The anchor's line for the smoke shape (0.0M parameters, as the script rounds them)."""
    return f"anchor{' compile' if compiled else ''}: params 0.0M | {tokens_per_s} tokens/s | MFU 3.5% | peak mem 1.2 GiB"


def table_rows(piece: Path) -> list[list[str]]:
    """The cells of a piece's table, below its header."""
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in piece.read_text().splitlines()[4:]
            if line.startswith("|")]


def rate(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.mark.slow
def test_smoke_mode_writes_the_tables(tmp_path: Path, token_cache_dir: Path) -> None:
    """The whole command on CPU, with the anchor's stand-in and a choice of runs: the rank eager through the real
    supervisor, compared with the anchor; the `debug` preset as shipped, trained but not compared; the ablation of
    that preset; the cache builds; each piece in its file and the page made of them."""
    anchor = fake_anchor(tmp_path / "anchor.py", smoke_line(compiled=False))
    out = tmp_path / "out"
    done = bench("--smoke", "--runs", "eager,shipped", "--anchor", str(anchor), "--out", str(out),
                 "--cache-dir", str(token_cache_dir), cwd=tmp_path)
    pieces = [out / "bench_gpu_training_smoke_eager-shipped.md", out / "bench_gpu_ablation_smoke.md",
              out / "bench_gpu_cache.md"]
    assert sorted(out.iterdir()) == sorted([out / "bench_gpu.md", out / gpu_runs.CONSOLES, *pieces])
    # the 3 rank runs' consoles: 2 training rows, the ablation's change (its first row is the training's shipped run)
    consoles = (out / gpu_runs.CONSOLES).read_text()
    assert len(re.findall(r"^== smoke rank", consoles, re.M)) == 3 and "Step [" in consoles, consoles[-2000:]
    assert "smoke rank, `debug` preset as shipped: measured earlier in this command" in done.stderr
    text = (out / "bench_gpu.md").read_text()
    assert text.strip() == done.stdout.strip() == "\n\n".join(p.read_text().strip() for p in pieces)
    assert "| run | tokens/s | MFU | peak memory | rank / loop |" in text
    rows = table_rows(pieces[0])
    assert [row[0] for row in rows] == ["rank eager", "rank, `debug` preset as shipped",
                                        "textbook loop (anchors/gpu_textbook_loop.py) eager"], text
    (rank_rate, _, _, ratio), (shipped_rate, _, _, unlike), (anchor_rate, mfu, peak, _) = (row[1:] for row in rows)
    assert (anchor_rate, mfu, peak) == ("12,345", "3.5%", "1.2 GiB")
    assert abs(float(ratio.rstrip("×")) - rate(rank_rate) / 12_345) < 0.01
    assert rate(shipped_rate) > 0
    assert unlike.startswith("not compared: the `debug` preset is not the smoke shape: ")
    assert "model.num_layers 2 (shape: 1)" in unlike and "training.batch_size" not in unlike
    s = gpu_runs.SMOKE_SHAPE  # H L A K F V CTX B ACCUM STEPS, the timed steps after the script's own warm-up
    expected = [s.hidden, s.layers, s.heads, s.kv_heads, s.ffn, s.vocab, s.context, s.batch, s.accum, s.steps - s.warmup]
    assert [json.loads(line) for line in anchor.with_suffix(".argv").read_text().splitlines()] == [
        [str(n) for n in expected]]
    # The ablation: the preset as shipped, then with the chunked loss; each row says what the rank ran.
    (base, chunked) = table_rows(pieces[1])
    assert (base[0], chunked[0]) == ("rank, `debug` preset as shipped",
                                     "rank, `debug` preset as shipped with training.loss=chunked")
    assert base[4] == "1.00×" and base[1] == shipped_rate
    # the ratio is of the measured rates, the cells show them rounded to whole tokens/s: a slow base (a loaded
    # machine) moves the cells' own ratio by more than the ratio's last digit
    shown, chunked_rate, base_rate = float(chunked[4].rstrip("×")), rate(chunked[1]), rate(base[1])
    measured = chunked_rate / base_rate
    assert abs(shown - measured) <= 0.005 + (chunked_rate + 0.5) / (base_rate - 0.5) - measured, (chunked, base)
    assert "loss full" in base[5] and "loss chunked" in chunked[5] and "torch.compile off" in base[5], text
    assert "| cores | tokens | tokens/s | of linear scaling |" in text
    assert re.search(rf"^\| 1 \| {NUMBER} \| \d+\.\d\d M \| 100% \|$", text, re.M), text


@pytest.mark.slow
def test_the_plain_loop_without_an_anchor(tmp_path: Path) -> None:
    """Without --anchor the rows are compared with bench/textbook_loop.py's loop, run in a child process."""
    loop = gpu_runs.loop_throughput(gpu_runs.SMOKE_SHAPE, False, options(tmp_path, smoke=True))
    assert (loop.name, loop.error, loop.device) == ("plain loop eager", "", "cpu"), loop
    assert loop.tokens_per_s is not None and loop.tokens_per_s > 0
    rank = gpu_runs.Result("rank eager", compiled=False, loop=False, tokens_per_s=2 * loop.tokens_per_s)
    assert bench_gpu.ratio(rank, [rank, loop]) == "2.00×"


def test_a_failing_anchor_is_a_failed_cell(tmp_path: Path) -> None:
    def row(anchor: Path, compiled: bool = False) -> str:
        result = gpu_runs.loop_throughput(gpu_runs.SMOKE_SHAPE, compiled, options(tmp_path, anchor=anchor))
        assert result.tokens_per_s is None
        return bench_gpu.describe(result)

    # the cell keeps the first 160 characters of the last line: the interpreter's complaint, however long the path
    assert re.fullmatch(r"failed \(exit 2: .*can't open file .*\)", row(tmp_path / "missing.py"))
    crashed = fake_anchor(tmp_path / "crashed.py", "Traceback: CUDA error | out of memory", exit_code=1)
    assert row(crashed) == r"failed (exit 1: Traceback: CUDA error \| out of memory)"  # a | would end the cell
    silent = fake_anchor(tmp_path / "silent.py", "done")
    assert row(silent) == "failed (no figures line: done)"
    assert row(fake_anchor(tmp_path / "eager.py", smoke_line(compiled=False)), compiled=True).startswith(
        "failed (it ran a different model: 0.0M parameters, not compiled")
    bigger = fake_anchor(tmp_path / "bigger.py", smoke_line(compiled=False).replace("0.0M", "1100.0M"))
    assert row(bigger).startswith("failed (it ran a different model: 1100.0M parameters")
    # A rank row whose loop failed has no ratio, and the table is still written.
    rank = gpu_runs.Result("rank eager", compiled=False, loop=False, tokens_per_s=1000.0)
    loop = gpu_runs.loop_throughput(gpu_runs.SMOKE_SHAPE, False, options(tmp_path, anchor=silent))
    table = bench_gpu.training_table("smoke", gpu_runs.SMOKE_SHAPE, options(tmp_path, anchor=silent), [rank, loop])
    assert "| rank eager | 1,000 | n/a | n/a |  |" in table


def test_a_rank_run_s_console_is_on_disk_while_it_runs(tmp_path: Path) -> None:
    """A run that outlasts a GPU lease is stopped from outside: what it printed by then (the compile time, the first
    MFU lines) must already be in the consoles file, not held in a pipe that dies with the bench."""
    import threading
    import time

    consoles, release = tmp_path / "out" / gpu_runs.CONSOLES, tmp_path / "release"
    child = tmp_path / "rank.py"  # a file, so that the console's header names it rather than quoting its lines
    child.write_text(f"import os, sys, time\nprint('step 1 | MFU 40.0%', flush=True)\n"
                     f"sys.stderr.write('a warning\\n')\n"
                     f"while not os.path.exists({str(release)!r}): time.sleep(0.05)\nprint('done')\nsys.exit(3)\n")
    done: list[gpu_runs.ConsoleRun] = []
    runner = threading.Thread(target=lambda: done.append(gpu_runs.console_run(
        [sys.executable, str(child)], tmp_path, clean_env(), consoles, "1.1B shipped", timeout_s=120)))
    runner.start()
    deadline = time.monotonic() + 60
    while "a warning" not in (consoles.read_text() if consoles.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    text = consoles.read_text()
    assert text == f"== 1.1B shipped: {child}\nstep 1 | MFU 40.0%\na warning\n" and not done
    release.touch()
    runner.join(60)
    (run,) = done
    assert run.returncode == 3 and run.stdout == "step 1 | MFU 40.0%\na warning\ndone\n"
    assert gpu_runs.failure(run) == "exit 3: done"


def test_a_run_past_its_time_limit_is_stopped_with_what_it_started(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One hung run must not take the rows after it: past `--run-timeout` it gets SIGTERM (the supervisor stops its
    ranks), and SIGKILL with everything it started once the grace period ends; its row says so."""
    import psutil

    monkeypatch.setattr(gpu_runs, "STOP_GRACE_S", 0.5)
    pid_file = tmp_path / "grandchild.pid"
    child = ("import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
             f"open({str(pid_file)!r}, 'w').write(str(p.pid))\nprint('compiling', flush=True)\ntime.sleep(600)\n")
    run = gpu_runs.console_run([sys.executable, "-c", child], tmp_path, clean_env(), tmp_path / gpu_runs.CONSOLES,
                               "1.1B shipped", timeout_s=3)
    assert run.stopped_after_s == 3 and run.returncode == -9 and run.stdout == "compiling\n"
    assert gpu_runs.failure(run) == "stopped after 3 s (--run-timeout): compiling"
    try:
        grandchild = psutil.Process(int(pid_file.read_text()))
    except psutil.NoSuchProcess:
        return
    _, alive = psutil.wait_procs([grandchild], timeout=10)  # SIGKILLed: gone as soon as the kernel has reaped it
    assert alive == [], "the run's own child was left running"


def test_anchor_line_parser() -> None:
    parse = textbook_loop.parse_anchor_line
    assert parse("anchor compile: params 1100.0M | 62,800 tokens/s | MFU 44.7% | peak mem 44.6 GiB\n") == \
        textbook_loop.AnchorFigures(compiled=True, params_m=1100.0, tokens_per_s=62_800.0, mfu=0.447, peak_gib=44.6)
    output = ("W1123 torch._dynamo: recompiling\nanchor: params 134.1M | 207,000 tokens/s | MFU 15.4% | peak mem "
              "9.8 GiB\nanchor: params 134.1M | 213,500 tokens/s | MFU 15.9% | peak mem 9.9 GiB  \n")
    assert parse(output) == textbook_loop.AnchorFigures(False, 134.1, 213_500.0, 0.159, 9.9)  # the last line counts
    assert parse("anchor: params 134.1M | nan tokens/s | MFU 15.9% | peak mem 9.9 GiB") is None
    assert parse("") is None


def test_the_gpu_runs_as_they_resolve(tmp_path: Path) -> None:
    """Without a GPU, what each row of the real benchmark will run: the eager rows do not compile (`auto` would on
    CUDA), the presets as shipped get no flag but max_steps and the cache folder, compile as `auto` does on CUDA and
    are the shapes they are compared with."""
    opts = options(tmp_path)
    jobs = {(run.shape, run.kind): gpu_runs.rank_job(run, gpu_runs.SHAPES[run.shape], opts)
            for run in gpu_runs.RANK_RUNS}
    assert {key: job.compiled for key, job in jobs.items()} == {
        ("125M", "eager"): False, ("125M", "compiled"): True, ("125M", "shipped"): True,
        ("1.1B", "eager"): False, ("1.1B", "compiled"): True, ("1.1B", "shipped"): True}
    for shape, preset in (("125M", "small"), ("1.1B", "1b")):
        shipped = jobs[shape, "shipped"]
        assert shipped.run.name == f"rank, `{preset}` preset as shipped"
        assert shipped.flags == ("--preset", preset, "--max-steps", str(gpu_runs.SHAPES[shape].steps),
                                 "--set", f"data.cache_dir={opts.cache_dir}")
        assert shipped.cfg.training.loss == "auto" and shipped.cfg.system.compile == "auto"
        assert gpu_runs.SHAPES[shape].differences(shipped.cfg) == []
        for kind in ("eager", "compiled"):
            assert jobs[shape, kind].cfg.preset == preset
            assert gpu_runs.SHAPES[shape].differences(jobs[shape, kind].cfg) == []
    assert gpu_runs.SHAPES["125M"].differences(jobs["1.1B", "shipped"].cfg)[:2] == [
        "model.num_layers 16 (shape: 12)", "model.hidden_size 2048 (shape: 768)"]


def key_and_value(flag: str) -> tuple[str, object]:
    """`--set KEY=VALUE` as the supervisor reads it: VALUE as JSON where it parses, else the string."""
    key, value = flag.split("=", 1)
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def test_each_ablation_changes_only_what_it_names(tmp_path: Path) -> None:
    """The ablation rows of the real benchmark, resolved: each is the preset as shipped with its change and nothing
    else (every change is valid for both presets), and `batch` keeps the tokens per step."""
    opts = options(tmp_path)
    for shape_name, preset in (("125M", "small"), ("1.1B", "1b")):
        shape = gpu_runs.SHAPES[shape_name]
        shipped = gpu_runs.rank_job(gpu_runs.RankRun("shipped", shape_name, preset), shape, opts).cfg.to_dict()
        for name, sets in gpu_runs.ablations(shape).items():
            job = gpu_runs.rank_job(gpu_runs.RankRun("shipped", shape_name, preset, sets), shape, opts)
            assert job.run.name == f"rank, `{preset}` preset as shipped with {', '.join(sets)}"
            changed = {f"{section}.{key}": value for section, values in job.cfg.to_dict().items()
                       if isinstance(values, dict) for key, value in values.items() if shipped[section][key] != value}
            assert changed == dict(map(key_and_value, sets)), name
            assert job.compiled == (name != "eager"), name
            t = job.cfg.training
            assert t.batch_size * t.grad_accum_nums == shape.batch * shape.accum, name


def test_shapes_and_runs_name_the_pieces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def parsed(*argv: str) -> gpu_runs.Options:
        opts = bench_gpu.parse([*argv, "--out", str(tmp_path)])
        assert isinstance(opts, gpu_runs.Options)
        opts.work.rmdir()  # the run's scratch folder, not needed here
        return opts

    default = parsed()
    assert (default.shapes, default.runs) == (("125M", "1.1B"), ("eager", "compiled", "shipped"))
    chosen = parsed("--shapes", " 1.1B", "--runs", "shipped,compiled")
    assert (chosen.shapes, chosen.runs) == (("1.1B",), ("compiled", "shipped"))
    assert bench_gpu.Piece("training", "1.1B", chosen.runs).file_name == "bench_gpu_training_1.1B_compiled-shipped.md"
    assert bench_gpu.Piece("training", "125M").file_name == "bench_gpu_training_125M.md"
    assert parsed("--smoke").shapes == ("smoke",)
    assert default.ablations == () and parsed("--ablations", "eager,cudnn,flash,full_loss,chunked_loss,selective,"
                                                              "batch").ablations == ()  # every one
    assert parsed("--ablations", "cudnn, eager").ablations == ("eager", "cudnn")
    for argv in (["--shapes", "7B"], ["--smoke", "--shapes", "125M"], ["--runs", "fast"], ["--ablations", "fp8"]):
        with pytest.raises(SystemExit):
            bench_gpu.parse(argv)
        assert "unknown" in capsys.readouterr().err


def test_pieces_from_separate_commands_make_one_page(tmp_path: Path) -> None:
    names = ["bench_gpu_logpump.md", "bench_gpu_training_1.1B_compiled-shipped.md", "bench_gpu_cache.md",
             "bench_gpu_ablation_1.1B_flash-cudnn-selective-batch.md", "bench_gpu_training_1.1B_eager.md",
             "bench_gpu_ablation_125M.md", "bench_gpu_training_125M.md",
             "bench_gpu_ablation_1.1B_eager-full_loss-chunked_loss.md"]
    for name in names:
        (tmp_path / name).write_text(f"table of {name}\n")
    (tmp_path / "notes.md").write_text("not a piece\n")
    done = bench("--collect", str(tmp_path), cwd=tmp_path)
    order = ["training_125M", "training_1.1B_eager", "training_1.1B_compiled-shipped", "ablation_125M",
             "ablation_1.1B_eager-full_loss-chunked_loss", "ablation_1.1B_flash-cudnn-selective-batch", "cache",
             "logpump"]
    page = "\n\n".join(f"table of bench_gpu_{name}.md" for name in order) + "\n"
    assert done.stdout == page == (tmp_path / "bench_gpu.md").read_text()
