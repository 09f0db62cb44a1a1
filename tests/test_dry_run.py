"""--dry-run and the memory estimate: sizes from the meta device, per-GPU memory under DDP and FSDP, the verdict."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rank_scripts.harness import clean_env, run
from rank_support import MAIN, PYTHON, base_env, set_flags, tiny_dict
from supervisor.launch.cli import main as supervisor_main
from trainer.config import Config, apply_layer
from trainer.config.resolve import preset_layer
from trainer.config.sizes import flops_per_token, human, parameter_count
from trainer.model.estimate import GiB, estimate, format_estimate, size
from trainer.rank_cli import main

PRODUCTION_PARAMETERS = 7_241_732_096


def preset(name: str, **training: object) -> Config:
    cfg = Config()
    apply_layer(cfg, preset_layer(name), name)
    apply_layer(cfg, {"training": dict(training)}, "test")
    return cfg


def test_debug_dry_run_prints_sizes_and_the_estimate(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SUPERVISOR_FAKE_GPUS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever the machine has
    assert main(["--debug", "--dry-run", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    cfg = preset("debug")
    assert f"parameters: {human(parameter_count(cfg))} ({parameter_count(cfg):,})" in out
    assert "tokens per step: 1,024 (4 sequences × 128 tokens × 1 micro-step × 2 CPU ranks)" in out
    assert f"FLOPs per token: {human(flops_per_token(cfg))}" in out
    assert "FSDP (2 ranks)" in out and "optimizer state" in out and "activations" in out
    assert "GPUs: none detected; estimate for 2 rank(s) on CPUs" in out
    assert "host memory (DDP, training.strategy): 2 CPU ranks × " in out and "available (RAM and swap): fits" in out


def test_dry_run_reports_the_gpus_this_process_may_use(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's detection: CUDA_VISIBLE_DEVICES limits it, as it limits the ranks."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SUPERVISOR_FAKE_GPUS", "0,1,2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert supervisor_main(["--debug", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: 2 × fake, 80.0 GiB each; estimate for 2 rank(s)" in out and "no GPU detected" not in out


def test_world_size_comes_first(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--debug", "--dry-run", "--nproc", "2"]) == 0
    assert "estimate for 4 rank(s)" in capsys.readouterr().out


def test_production_estimate_on_eight_80_gib_gpus() -> None:
    cfg = preset("production", strategy="ddp")
    est = estimate(cfg, world_size=8, gpu_memory_bytes=80 * GiB)
    p = est.shape.parameters
    assert p == PRODUCTION_PARAMETERS == parameter_count(cfg)
    ddp, fsdp = est.strategies["ddp"], est.strategies["fsdp"]
    assert (ddp.weights, ddp.gradients, ddp.optimizer) == (4 * p + 2 * p, 4 * p, 8 * p)  # fp32 + bf16 copies
    assert fsdp.optimizer == 8 * p // 8 and fsdp.gradients < ddp.gradients / 4
    assert ddp.fits is False and fsdp.fits is True
    text = format_estimate(est)
    assert "WARNING: DDP (training.strategy) will NOT fit" in text and "training.strategy=fsdp would fit" in text
    assert "FSDP (training.strategy) fits" in format_estimate(estimate(preset("production"), 8, 80 * GiB))


def test_the_supervisor_can_estimate_without_torch() -> None:
    code = ("import sys\n"
            "from trainer.config import Config, apply_layer\nfrom trainer.config.resolve import preset_layer\n"
            "from trainer.model.estimate import GiB, estimate, format_estimate\n"
            "cfg = Config()\n"
            "apply_layer(cfg, preset_layer('production'), 'production')\n"
            "print(format_estimate(estimate(cfg, 8, 80 * GiB)))\n"
            "assert 'torch' not in sys.modules\n")
    result = subprocess.run([PYTHON, "-c", code], env=base_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "FSDP (training.strategy) fits" in result.stdout


def test_checkpointing_compile_loss_and_batch_drive_activations() -> None:
    base = estimate(preset("production"), 8, None)  # full checkpointing, compiled layers, chunked loss (GPU defaults)
    assert (base.gradient_checkpointing, base.compiled, base.loss) == ("full", True, "chunked")

    def activations(**changes: object) -> int:
        cfg = preset("production")
        for dotted, value in changes.items():
            section, key = dotted.split("__")
            setattr(getattr(cfg, section), key, value)
        return estimate(cfg, 8, None).selected.activations

    none = activations(model__gradient_checkpointing="none")
    assert none > 4 * base.selected.activations
    assert base.selected.activations < activations(model__gradient_checkpointing="selective") < none
    assert activations(model__gradient_checkpointing=False) == none  # the boolean of older configs
    assert activations(model__gradient_checkpointing="none", system__compile=False) > 1.5 * none  # eager keeps more
    # 16k tokens per micro-batch: the full logits hold 4 chunks' worth more than the chunked loss's single chunk
    assert (activations(training__loss="full", training__batch_size=8)
            > activations(training__batch_size=8) + 3 * GiB)
    assert activations(training__loss="full", training__batch_size=4) == 2 * activations(training__loss="full")


def test_production_dry_run_never_allocates_the_weights(tmp_path: Path) -> None:
    """The real command; its peak memory stays far below the 29 GB that 7.2B fp32 parameters would take."""
    # The entry point exits with os._exit, so the peak is read from a parent whose only child is the dry run.
    code = ("import resource, subprocess, sys\n"
            f"done = subprocess.run([sys.executable, {MAIN!r}, '--preset', 'production', '--dry-run', '--nproc', '8'])\n"
            "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(done.returncode)\n")
    result = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, env=base_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"parameters: 7.2B ({PRODUCTION_PARAMETERS:,})" in result.stdout
    assert "tokens per step: 262,144" in result.stdout and "FSDP (8 ranks)" in result.stdout
    peak_kib = int(result.stderr.split("peak_kib")[1].split()[0])
    assert peak_kib < 2 * 1024 * 1024


@pytest.mark.parametrize("command, env, ranks", [
    (["-m", "supervisor"], {}, 2),  # no GPU: the supervisor's two CPU ranks
    pytest.param(["-m", "supervisor", "--nproc", "3"], {}, 3, marks=pytest.mark.slow),
    pytest.param(["-m", "supervisor", "--set", "system.device=cpu"], {"SUPERVISOR_FAKE_GPUS": "0,1"}, 2,
                 marks=pytest.mark.slow),  # GPUs, not used
    ([MAIN], {}, 1),  # by hand: this process alone
], ids=["supervisor", "supervisor-nproc", "forced-cpu", "by-hand"])
def test_without_gpus_the_dry_run_sizes_the_cpu_ranks_that_would_run(tmp_path: Path, command: list[str],
                                                                       env: dict[str, str], ranks: int) -> None:
    """The small preset asks for the GPU fast path (bf16 autocast, compiled layers, the chunked loss); CPU ranks run
    it in fp32, eager, with the full loss, which takes several times the memory: the dry run sizes that, for the
    ranks that would start, against the host's memory."""
    done = subprocess.run([PYTHON, *command, "--preset", "small", "--dry-run"], cwd=tmp_path,
                          env=clean_env(**env), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"estimate for {ranks} rank(s) on CPUs, strategy ddp" in out and "per-rank memory" in out
    assert "fp32 compute, activation checkpointing none, eager layers, full loss" in out
    per_rank = estimate(preset("small"), ranks, None, cuda=False).selected.total
    assert f"host memory (DDP, training.strategy): {ranks} CPU rank{'s' * (ranks > 1)} × {size(per_rank)} = " in out
    assert per_rank > 2 * estimate(preset("small"), ranks, None).selected.total  # the GPU's figures, far below


def test_the_cpu_dry_run_takes_the_settings_the_cpu_ranks_run_with(tmp_path: Path, token_cache_dir: Path) -> None:
    """One config asking for the GPU fast path (AMP, compile and loss on auto), dry run and real run: the dry run's
    ranks, precision, layers and loss are what the ranks' banner says they run with."""
    layer = tiny_dict(tmp_path, token_cache_dir, system={"device": "auto", "compile": "auto"},
                      training={"max_steps": 1, "warmup_steps": 0, "use_amp": True, "precision": "auto",
                                "loss": "auto"})
    del layer["logging"]["run_dir"]  # the supervisor's to choose
    flags = ["--debug", *set_flags(layer)]
    dry = run(tmp_path, *flags, "--dry-run", entry=None, tag="-dry")
    assert dry.returncode == 0, dry.stderr
    assert "estimate for 2 rank(s) on CPUs" in dry.stdout
    assert "fp32 compute, activation checkpointing none, eager layers, full loss" in dry.stdout
    trained = run(tmp_path, *flags, entry=None, timeout=180)
    assert trained.returncode == 0, trained.stderr[-3000:]
    banner = (trained.run_dir() / "cpu0.log").read_text()
    assert "world size: 2 (gloo)" in banner and "precision: fp32" in banner, banner[-3000:]
    assert "compute: torch.compile off | loss full" in banner, banner[-3000:]


GPUS = {"SUPERVISOR_FAKE_GPUS": "0,1,2,3"}


@pytest.mark.parametrize("flags", [("--gpus", "abc"), ("--gpus", "0,0"), ("--gpus", "-1"), ("--gpus", "1-2"),
                                   ("--gpus", "0,1,2,3,4"), ("--nproc", "8"), ("--gpus", "0,1", "--nproc", "3")])
def test_the_dry_run_refuses_the_gpus_the_run_refuses(tmp_path: Path, flags: tuple[str, ...]) -> None:
    """The dry run chooses its GPUs as the run does: what the run refuses is the same one line, exit 2."""
    dry = run(tmp_path, "--debug", *flags, "--dry-run", entry=None, env=clean_env(**GPUS), tag="-dry")
    real = run(tmp_path, "--debug", *flags, entry=None, env=clean_env(**GPUS))
    assert dry.returncode == real.returncode == 2 and dry.stdout == ""
    assert dry.stderr == real.stderr and dry.stderr.startswith("error: ") and dry.stderr.count("\n") == 1, dry.stderr
    assert not dry.log_dir.exists() and not real.log_dir.exists()


@pytest.mark.parametrize("flags, ranks", [
    (("--gpus", "0,1,2"), 3),
    pytest.param(("--gpus", "3"), 1, marks=pytest.mark.slow),
    pytest.param(("--nproc", "2"), 2, marks=pytest.mark.slow),
    ((), 4),
])
def test_the_dry_run_sizes_the_gpus_chosen(tmp_path: Path, flags: tuple[str, ...], ranks: int) -> None:
    r = run(tmp_path, "--debug", *flags, "--dry-run", entry=None, env=clean_env(**GPUS))
    assert r.returncode == 0, r.stderr
    assert f"GPUs: {ranks} × fake, 80.0 GiB each; estimate for {ranks} rank(s)" in r.stdout
    assert f"× {ranks} GPU{'s' * (ranks > 1)})" in r.stdout and f"FSDP ({ranks} ranks)" in r.stdout


def test_the_dry_run_says_the_run_would_be_refused_for_the_host_memory(tmp_path: Path) -> None:
    r = run(tmp_path, "--debug", "--batch-size", "10000000", "--dry-run", entry=None)
    assert r.returncode == 0, r.stderr
    assert "host memory (DDP, training.strategy): 2 CPU ranks × " in r.stdout
    assert "does NOT fit: the run would be refused; lower training.batch_size" in r.stdout


@pytest.mark.parametrize("command", [["-m", "supervisor"], [MAIN]], ids=["supervisor", "by-hand"])
def test_the_dry_run_checks_the_data_source_as_the_run_does(tmp_path: Path, command: list[str]) -> None:
    """The same line the run gives (its token cache's build opens the source), from a dry run of a few seconds."""
    bad = ["--debug", "--set", "data.source=corpus/missing.jsonl", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    dry = subprocess.run([PYTHON, *command, *bad, "--dry-run"], cwd=tmp_path, env=clean_env(), capture_output=True,
                         text=True, timeout=120)
    real = subprocess.run([PYTHON, *command, *bad], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert dry.returncode == real.returncode == 2 and dry.stdout == ""
    assert dry.stderr == real.stderr.splitlines(keepends=True)[-1], (dry.stderr, real.stderr)
    assert dry.stderr.startswith("error: data.source corpus/missing.jsonl does not exist; give an existing file")
