"""--dry-run and the memory estimate: sizes from the meta device, per-GPU memory under DDP and FSDP, the verdict."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rank_support import MAIN, PYTHON, base_env
from supervisor.launch.cli import main as supervisor_main
from trainer.config import Config, apply_layer
from trainer.config.resolve import preset_layer
from trainer.config.sizes import flops_per_token, human, parameter_count
from trainer.model.estimate import GiB, estimate, format_estimate
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
    assert "tokens per step: 1,024 (4 sequences × 128 tokens × 1 micro-step × 2 GPUs)" in out
    assert f"FLOPs per token: {human(flops_per_token(cfg))}" in out
    assert "FSDP (2 ranks)" in out and "optimizer state" in out and "activations" in out
    assert "GPUs: none detected" in out and "no GPU detected" in out


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
