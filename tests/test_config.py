"""Config: precedence, presets, validation messages, and the inspection flags."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from trainer.config import SECTIONS, Config, field_types
from trainer.config.bounds import BOUNDS
from trainer.config.json_text import strip_json_comments
from trainer.config.resolve import add_config_arguments, preset_names, presets_table, resolve
from trainer.config.sizes import parameter_count
from trainer.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def parse(*argv: str) -> Config:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return resolve(parser.parse_args(list(argv)))


def write(tmp_path: Path, name: str, data: dict | str) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_presets_exist_and_state_their_use_case() -> None:
    assert {"debug", "small", "1b", "production"} <= set(preset_names())
    for name in preset_names():
        cfg = parse("--preset", name)
        assert cfg.description, f"preset {name} must state its use case"


def test_debug_preset_shape() -> None:
    cfg = parse("--debug")
    assert cfg.preset == "debug"
    assert cfg.model.num_layers == 2 and cfg.training.max_steps == 10
    assert cfg.logging.level == "DEBUG" and cfg.debug.nan_localize and cfg.debug.nan_dump
    assert cfg.training.precision == "fp32"


def test_production_preset_is_llama3_8b_shaped() -> None:
    cfg = parse()  # production is the default
    m = cfg.model
    assert cfg.preset == "production"
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (32, 4096, 32, 8, 14336)
    assert cfg.training.max_steps == 10_000 and cfg.training.precision == "bf16" and cfg.training.strategy == "fsdp"


def test_1b_preset_is_llama32_1b_shaped_and_fits_one_80_gib_gpu() -> None:
    from trainer.model.estimate import GiB, estimate

    cfg = parse("--preset", "1b")
    m, t = cfg.model, cfg.training
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (16, 2048, 32, 8, 8192)
    assert (cfg.data.source, cfg.data.tokenizer, cfg.data.vocab_size, cfg.data.context_length) == (
        "stdlib", "bpe", 32000, 2048)
    assert t.batch_size * t.grad_accum_nums >= 16 and t.strategy == "ddp"
    assert 1.0e9 < parameter_count(cfg) < 1.3e9
    assert estimate(cfg, 1, 80 * GiB).selected.fits  # with the GPU defaults (compiled layers, chunked loss)
    cfg.system.compile = False
    assert estimate(cfg, 1, 80 * GiB).selected.fits  # and eager, for a run that turns compilation off


def test_small_preset_is_about_125m_parameters() -> None:
    assert 100e6 < parameter_count(parse("--preset", "small")) < 150e6


def test_parameter_count_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = parse("--debug")
    m = cfg.model
    llama = LlamaConfig(vocab_size=cfg.data.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                        num_key_value_heads=m.num_kv_heads, tie_word_embeddings=m.tie_word_embeddings)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())


def test_precedence_preset_then_files_in_order_then_flags(tmp_path: Path) -> None:
    a = write(tmp_path, "a.json", {"training": {"max_steps": 50, "batch_size": 3}, "model": {"init_std": 0.01}})
    b = write(tmp_path, "b.json", {"training": {"max_steps": 60}})
    cfg = parse("--debug", "--config", a, "--config", b)
    assert (cfg.training.max_steps, cfg.training.batch_size, cfg.model.init_std) == (60, 3, 0.01)
    cfg = parse("--debug", "--config", a, "--config", b, "--max-steps", "70", "--set", "training.batch_size=5")
    assert (cfg.training.max_steps, cfg.training.batch_size) == (70, 5)


def test_legacy_user_keys_keep_their_meaning(tmp_path: Path) -> None:
    single_gpu = {
        "system": {"device": "cuda", "device_id": 2},
        "training": {"batch_size": 8, "grad_accum_nums": 4, "num_workers": 2, "learning_rate": 1e-4,
                     "max_grad_norm": 0.5, "use_amp": True},
        "model": {"init_std": 0.006},
        "data": {"context_length": 512},
    }
    cfg = parse("--preset", "small", "--config", write(tmp_path, "single_gpu.json", single_gpu))
    assert cfg.system.device_id == 2 and cfg.training.grad_accum_nums == 4 and cfg.data.context_length == 512
    assert cfg.training.learning_rate == 1e-4 and cfg.model.init_std == 0.006 and cfg.training.use_amp is True


def test_config_file_may_name_its_base_preset(tmp_path: Path) -> None:
    cfg = parse("--config", write(tmp_path, "c.json", {"preset": "debug", "training": {"max_steps": 4}}))
    assert cfg.preset == "debug" and cfg.model.num_layers == 2 and cfg.training.max_steps == 4


def test_a_config_file_may_repeat_the_preset_the_flags_chose(tmp_path: Path) -> None:
    cfg = parse("--debug", "--config", write(tmp_path, "c.json", {"preset": "debug", "training": {"max_steps": 4}}))
    assert cfg.preset == "debug" and cfg.model.num_layers == 2 and cfg.training.max_steps == 4


def test_config_files_naming_presets_name_the_same_one(tmp_path: Path) -> None:
    """Only one preset is the base: a second one named would be silently ignored."""
    first = write(tmp_path, "a.json", {"preset": "debug"})
    second = write(tmp_path, "b.json", {"preset": "small", "training": {"max_steps": 4}})
    with pytest.raises(UserError, match=r"b.json names preset 'small', which conflicts with .*a.json's preset 'debug'"):
        parse("--config", first, "--config", second)
    with pytest.raises(UserError, match=r"b.json names preset 'small', which conflicts with --preset debug"):
        parse("--preset", "debug", "--config", second)


def test_set_parses_json_else_string() -> None:
    cfg = parse("--debug", "--set", "data.source=/data/corpus/*.txt", "--set", "training.use_amp=true",
                "--set", "debug.inject_nan_step=3", "--set", "debug.inject_nan_module=lm_head",
                "--set", "training.learning_rate=2e-4")
    assert cfg.data.source == "/data/corpus/*.txt" and cfg.training.use_amp is True
    assert cfg.debug.inject_nan_step == 3 and cfg.training.learning_rate == 2e-4


@pytest.mark.parametrize("text,expected", [("500", 500), ("500k", 500_000), ("5M", 5_000_000), ("50M", 50_000_000),
                                           ("500M", 500_000_000)])
def test_max_samples_accepts_suffixes(text: str, expected: int) -> None:
    assert parse("--debug", "--max-samples", text).data.max_samples == expected


@pytest.mark.parametrize("argv,message", [
    (["--set", "training.bacth_size=4"], "unknown key 'bacth_size' in section 'training'; did you mean 'batch_size'?"),
    (["--set", "trainng.batch_size=4"], "unknown section 'trainng'; did you mean 'training'?"),
    (["--set", "training.batch_size=\"four\""], "training.batch_size expects int, got str"),
    (["--set", "training.use_amp=1"], "training.use_amp expects bool, got int"),
    (["--set", "model.num_heads=3"], "model.num_heads (3) must divide model.hidden_size (128)"),
    (["--set", "model.num_kv_heads=3"], "model.num_kv_heads (3) must divide model.num_heads (4)"),
    (["--context-length", "4096"], "data.context_length (4096) must be between 1 and model.max_position_embeddings"),
    (["--batch-size", "0"], "training.batch_size must be positive"),
    (["--lr", "-1"], "training.learning_rate must be positive"),
    (["--max-steps", "2", "--set", "training.warmup_steps=2"],
     "training.warmup_steps (2) must be shorter than the run"),
    (["--max-samples", "lots"], "data.max_samples: expected a count"),
    (["--set", "training.strategy=zero3"], "training.strategy must be one of ddp, fsdp"),
    (["--set", "nodot"], "expected SECTION.KEY=VALUE"),
    (["--preset", "prod"], "unknown preset 'prod'; did you mean 'production'?"),
    (["--set", "model.attention_backend=efficient"],
     "model.attention_backend efficient has no grouped-query attention (num_kv_heads 2 < num_heads 4)"),
    (["--set", "model.attention_backend=flash"], "model.attention_backend flash needs bf16 or fp16 compute"),
])
def test_validation_messages(argv: list[str], message: str) -> None:
    with pytest.raises(UserError) as err:
        parse("--debug", *argv) if argv[0] != "--preset" else parse(*argv)
    assert message in str(err.value)


def test_invalid_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.json", '{\n  "training": {"max_steps": 5,}\n}')
    with pytest.raises(UserError, match=r"bad.json: invalid JSON at line 2, column 31"):
        parse("--debug", "--config", path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        parse("--config", str(tmp_path / "nope.json"))


def test_line_comments_are_accepted_outside_strings(tmp_path: Path) -> None:
    text = '{\n  // from the docs\n  "data": {"source": "http://x//y"}, // trailing\n  "training": {"max_steps": 20}\n}'
    assert json.loads(strip_json_comments(text))["data"]["source"] == "http://x//y"
    cfg = parse("--debug", "--config", write(tmp_path, "c.json", text))
    assert cfg.data.source == "http://x//y" and cfg.training.max_steps == 20


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = parse("--debug", "--max-steps", "7")
    cfg.save(tmp_path / "config.json")
    assert Config.load(tmp_path / "config.json") == cfg


def test_presets_table_rows() -> None:
    rows = {row["name"]: row for row in presets_table()}
    assert rows["production"]["layers/heads/hidden"] == "32/32/4096"
    assert rows["production"]["params"].endswith("B")


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    code = ("import argparse, sys\n"
            "from trainer.config.resolve import add_config_arguments, handle_inspection_flags\n"
            "from trainer.errors import UserError\n"
            "p = argparse.ArgumentParser(); add_config_arguments(p)\n"
            "try:\n    handle_inspection_flags(p.parse_args(sys.argv[1:]))\n"
            "except UserError as e:\n    print(f'error: {e}', file=sys.stderr)\n    sys.exit(2)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT)


def test_config_module_imports_no_torch_and_prints_config() -> None:
    out = run_cli("--debug", "--print-config", "--max-steps", "3")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout[: out.stdout.rindex("}") + 1])["training"]["max_steps"] == 3
    assert "no torch" in out.stdout


def test_list_presets_prints_a_table() -> None:
    out = run_cli("--list-presets")
    assert out.returncode == 0 and "production" in out.stdout and "32/32/4096" in out.stdout


def test_user_error_is_one_line_exit_2() -> None:
    out = run_cli("--debug", "--set", "training.bacth_size=4")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_readme_documents_every_key() -> None:
    """The README and its docs pages (the key table is in docs/configuration.md)."""
    import dataclasses

    docs = "\n".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    cfg = Config()
    missing = [f"{section}.{f.name}" for section in ("system", "model", "data", "training", "checkpoint", "logging",
                                                     "debug")
               for f in dataclasses.fields(getattr(cfg, section)) if f"{section}.{f.name}`" not in docs]
    assert not missing, f"neither README.md nor docs/*.md documents {missing}"


@pytest.mark.parametrize("preset, steps, fitted", [("small", 10, 1), ("production", 10, 1), ("debug", 2, 0),
                                                   ("debug", 25, 2)])
def test_a_preset_warmup_longer_than_a_trial_run_shrinks_with_a_note(preset: str, steps: int, fitted: int) -> None:
    cfg = parse("--preset", preset, "--max-steps", str(steps))
    original = parse("--preset", preset).training.warmup_steps
    if original < steps:
        assert cfg.training.warmup_steps == original and cfg.notes == []
        return
    assert cfg.training.warmup_steps == fitted
    assert cfg.notes == [f"training.warmup_steps {original} (preset '{preset}') does not fit a {steps}-step run: "
                         f"shortened to {fitted} (10 % of the run); set training.warmup_steps to choose"]


def test_the_note_survives_the_resolved_config_file(tmp_path: Path) -> None:
    cfg = parse("--preset", "small", "--max-steps", "10")
    cfg.save(tmp_path / "config.json")
    assert Config.load(tmp_path / "config.json").notes == cfg.notes != []


def test_a_warmup_the_user_set_is_never_changed(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"training.warmup_steps \(100\) must be shorter than the run"):
        parse("--preset", "small", "--max-steps", "10", "--set", "training.warmup_steps=100")
    with pytest.raises(UserError, match=r"training.warmup_steps \(50\) must be shorter than the run"):
        parse("--debug", "--max-steps", "10", "--config", write(tmp_path, "w.json", {"training": {"warmup_steps": 50}}))
    assert parse("--preset", "small", "--max-steps", "10", "--set", "training.warmup_steps=3").notes == []


def test_every_numeric_key_has_bounds() -> None:
    """A new int or float key gets its line in BOUNDS: unbounded, NaN or 1e30 would reach torch as a traceback."""
    numeric = {f"{section}.{key}" for section in SECTIONS
               for key, tp in field_types(type(getattr(Config(), section))).items()
               if {int, float} & {tp, *typing.get_args(tp)}}
    assert numeric == set(BOUNDS), f"missing: {sorted(numeric - set(BOUNDS))}, stale: {sorted(set(BOUNDS) - numeric)}"


@pytest.mark.parametrize("key, value, message", [
    ("training.learning_rate", float("nan"), "must be a finite number, got nan"),
    ("training.weight_decay", -0.5, "must be 0 or more, got -0.5"),
    ("data.vocab_size", 100, "must be at least 257, got 100"),
    ("debug.inject_fault_code", 256, "must be at most 255, got 256"),
    ("model.rope_theta", 0.0, "must be positive, got 0"),
    ("system.seed", 10**40, f"must be at most 18,446,744,073,709,551,615, got {10**40}"),
])
def test_bounds_name_the_side_broken(key: str, value: float, message: str) -> None:
    section, name = key.split(".")
    with pytest.raises(UserError, match=f"^{re.escape(key)} {re.escape(message)}$"):
        Config.from_dict({section: {name: value}})
