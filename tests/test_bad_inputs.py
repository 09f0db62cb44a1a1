"""Bad inputs through the real entry points: one ``error:`` line on stderr, exit 2, no traceback, nothing left running,
no half-written token cache or checkpoint.

Each case runs a user's command as a subprocess (``bash run_training.sh``, ``python -m supervisor``,
``python prepare_dataset.py``, ``python pretrain_main.py``) with ``PYTHON`` set to this interpreter, so the shell
scripts' bootstrap installs nothing. Inputs rejected before any work leave stderr holding the error line alone; those
found while preparing the data may follow progress lines (``training BPE ...``) and, under the supervisor, its
``supervisor:`` lines announcing the run, but the error is still one line, the last. A folder on a full disk is a small
tmpfs mounted for the case (tests/small_disk.py). Values refused while the configuration is read are checked
in-process, through the supervisor's own main (the last section): the same one line, in milliseconds.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import sys
import zipfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from process_tree import watching
from rank_scripts.harness import ROOT, clean_env, project_pythonpath
from small_disk import FILLER, fill, small_disk
from supervisor.launch import cli
from trainer.checkpoint.layout import STEP_PREFIX, TMP_PREFIX
from trainer.data.cache_folder import list_caches
from trainer.data.staging import BUILD_PREFIX

COMMANDS = {
    "run_training.sh": ["bash", str(ROOT / "run_training.sh")],
    "supervisor": [sys.executable, "-m", "supervisor"],
    "prepare_dataset.py": [sys.executable, str(ROOT / "prepare_dataset.py")],
    "pretrain_main.py": [sys.executable, str(ROOT / "pretrain_main.py")],
}
SMALL_DATA = ("--set", "data.vocab_size=300", "--set", "data.context_length=32",
              "--set", "model.max_position_embeddings=64")
TIMEOUT = 120.0
UNFINISHED = {"ckpt/step_000004/meta.json": json.dumps({"config": {"training": {"max_steps": 10}}})}
OCCUPIED = {"occupied": "a file where a folder is asked for: not writable, even by root"}


def torch_archive(cut: bool = False) -> bytes:
    """A file shaped as torch.save writes one (a zip holding <name>/data.pkl), whole or cut short half-way."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("state/data.pkl", pickle.dumps({"scheduler": {}}))
        archive.writestr("state/data/0", bytes(4096))
    data = buffer.getvalue()
    return data[:len(data) // 2] if cut else data


def planted_checkpoint(step: int, cache_key: str = "0" * 32, cut: bool = False) -> dict[str, str | bytes]:
    """A checkpoint folder as the checkpoint layout sees it (meta.json and state.pt), without torch."""
    folder = f"ckpt/step_{step:06d}"
    meta = {"step": step, "format": "full", "cache_key": cache_key, "world_size": 1, "data": {}, "model_shapes": {},
            "config": {"training": {"max_steps": 10}}}
    return {f"{folder}/meta.json": json.dumps(meta), f"{folder}/state.pt": torch_archive(cut)}


@dataclass(frozen=True)
class BadInput:
    command: str  # a key of COMMANDS
    args: tuple[str, ...]
    message: str  # what the error line says (a part of it)
    files: dict[str, str | bytes] = field(default_factory=dict)  # files to write into the working folder first
    full_disks: tuple[str, ...] = ()  # folders to mount as a small disk that is full (tests/small_disk.py)
    env: dict[str, str] = field(default_factory=dict)
    before_any_work: bool = True  # rejected while reading the configuration: stderr holds the error line alone


CASES = {
    "unknown config key": BadInput(
        "run_training.sh", ("--debug", "--set", "training.max_stepz=5"),
        "command line: unknown key 'max_stepz' in section 'training'; did you mean 'max_steps'?"),
    "wrong type": BadInput(
        "pretrain_main.py", ("--debug", "--config", "run.json"), 'run.json: training.max_steps expects int, got str',
        files={"run.json": '{"training": {"max_steps": "many"}}'}),
    "invalid JSON": BadInput(
        "prepare_dataset.py", ("--debug", "--config", "run.json"), "run.json: invalid JSON at line 1, column 30",
        files={"run.json": '{"training": {"max_steps": 5,}\n}'}),
    "heads not dividing hidden size": BadInput(
        "supervisor", ("--debug", "--set", "model.num_heads=5"),
        "model.num_heads (5) must divide model.hidden_size (128)"),
    "context longer than positions": BadInput(
        "pretrain_main.py", ("--debug", "--context-length", "1024"),
        "data.context_length (1024) must be between 1 and model.max_position_embeddings (512)"),
    "warmup set by the user not shorter than the run": BadInput(
        "prepare_dataset.py", ("--debug", "--max-steps", "2", "--set", "training.warmup_steps=2"),
        "training.warmup_steps (2) must be shorter than the run (training.max_steps = 2)"),
    "warmup in the user's file not shorter than the run": BadInput(
        "run_training.sh", ("--preset", "small", "--max-steps", "10", "--config", "run.json"),
        "training.warmup_steps (100) must be shorter than the run (training.max_steps = 10)",
        files={"run.json": '{"training": {"warmup_steps": 100}}'}),
    "NaN injection without a module": BadInput(
        "run_training.sh", ("--debug", "--set", "debug.inject_nan_step=3"),
        "NaN injection needs both debug.inject_nan_module and debug.inject_nan_step"),
    "fault injection past the last step": BadInput(
        "supervisor", ("--debug", "--set", "debug.inject_fault=exit", "--set", "debug.inject_fault_step=10"),
        "debug.inject_fault_step 10 is never reached (the run's steps are 0-9"),
    "fault injection on a rank the run does not have": BadInput(
        "supervisor", ("--debug", "--nproc", "2", "--set", "debug.inject_fault=sigkill", "--set",
                       "debug.inject_fault_step=3", "--set", "debug.inject_fault_rank=2"),
        "debug.inject_fault_rank 2 is outside the run's 2 ranks (0-1)"),
    "W&B on without the wandb package": BadInput(
        "run_training.sh", ("--debug", "--set", "logging.wandb=true"),
        "logging.wandb is on but the wandb package is not installed: pip install -e '.[wandb]'",
        files={"no_wandb/sitecustomize.py": "import sys\nsys.modules['wandb'] = None  # as if not installed\n"},
        env={"PYTHONPATH": project_pythonpath("no_wandb")}),
    "PYTHON that does not exist": BadInput(
        "run_training.sh", ("--debug",), "PYTHON=no-such-python: not a command on PATH",
        env={"PYTHON": "no-such-python"}),
    "Slurm job with a task per GPU": BadInput(
        "supervisor", ("--debug",), "SLURM_NTASKS=16 on 2 nodes: the supervisor starts every rank of its node itself",
        env={"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "16",
             "SLURM_JOB_NODELIST": "gpu[1-2]"}),
    "unknown preset": BadInput("run_training.sh", ("--preset", "huge"), "unknown preset 'huge'"),
    "missing config file": BadInput(
        "supervisor", ("--debug", "--config", "nowhere.json"), "config file nowhere.json does not exist"),
    "GPU 9 does not exist": BadInput(
        "supervisor", ("--debug", "--gpus", "9"), "GPU 9 does not exist; this machine has GPUs 0-3",
        env={"SUPERVISOR_FAKE_GPUS": "0,1,2,3"}),
    "missing data path": BadInput(
        "pretrain_main.py", ("--debug", "--set", "data.source=data/corpus.jsonl", *SMALL_DATA),
        "data.source data/corpus.jsonl does not exist"),
    "missing data path under the supervisor": BadInput(
        "supervisor", ("--debug", "--set", "data.source=data/corpus.jsonl", *SMALL_DATA),
        "data.source data/corpus.jsonl does not exist"),
    "missing data path in a dry run": BadInput(
        "supervisor", ("--debug", "--dry-run", "--set", "data.source=data/*.jsonl", *SMALL_DATA),
        "data.source glob 'data/*.jsonl' matches no files"),
    "GPUs a dry run would not get": BadInput(
        "supervisor", ("--debug", "--dry-run", "--gpus", "0,1,2,3,4"),
        "GPU 4 does not exist; this machine has GPUs 0-3", env={"SUPERVISOR_FAKE_GPUS": "0,1,2,3"}),
    "CPU ranks beyond the host's memory": BadInput(
        "supervisor", ("--debug", "--max-steps", "1", "--batch-size", "10000000"),
        "2 CPU ranks would need about 113.8 TiB of host memory (56.9 TiB each) by the estimate, more than 1.5 times "),
    "CPU rank by hand beyond the host's memory": BadInput(
        "pretrain_main.py", ("--debug", "--max-steps", "1", "--batch-size", "10000000"),
        "1 CPU rank would need about 56.9 TiB of host memory by the estimate"),
    "empty corpus": BadInput(
        "prepare_dataset.py", ("--debug", "--set", "data.source=corpus", *SMALL_DATA),
        "data.source corpus holds no documents", files={"corpus/empty.txt": ""}, before_any_work=False),
    "corpus shorter than one window": BadInput(
        "prepare_dataset.py", ("--debug", "--set", "data.source=corpus", *SMALL_DATA),
        "fewer than one context window (32 + 1)", files={"corpus/short.txt": "Just a few words.\n"},
        before_any_work=False),
    "hub dataset while offline": BadInput(
        "run_training.sh", ("--debug", "--set", "data.source=someone/some-corpus", *SMALL_DATA),
        "data.source 'someone/some-corpus' is not a local path and the Hugging Face hub cannot be reached",
        before_any_work=False),
    "unknown tokenizer": BadInput(
        "prepare_dataset.py", ("--debug", "--set", "data.tokenizer=no-such-tokenizer", *SMALL_DATA),
        "unknown tokenizer 'no-such-tokenizer'", before_any_work=False),
    "resume path that does not exist": BadInput(
        "supervisor", ("--debug", "--resume", "ckpt/step_000500", *SMALL_DATA),
        "--resume ckpt/step_000500: no such file or folder"),
    "resume folder without checkpoints": BadInput(
        "supervisor", ("--debug", "--resume", "old_run", *SMALL_DATA), "--resume old_run: no checkpoint there",
        files={"old_run/notes.txt": "not a checkpoint\n"}),
    "resume a checkpoint of other data": BadInput(
        "supervisor", ("--debug", "--resume", "auto", *SMALL_DATA),
        f"ckpt/step_000002 was trained on dataset cache {'0' * 32}, but this run uses ",
        files=planted_checkpoint(2), before_any_work=False),
    "resume a file that is not a checkpoint": BadInput(
        "supervisor", ("--debug", "--resume", "/etc/passwd"),
        "--resume /etc/passwd cannot be resumed: /etc/passwd is not a torch.save archive, or one cut short"),
    "resume an empty file": BadInput(
        "run_training.sh", ("--debug", "--resume", "nan_grad_step_3.pt"),
        "--resume nan_grad_step_3.pt cannot be resumed: nan_grad_step_3.pt is empty",
        files={"nan_grad_step_3.pt": ""}),
    "resume a damaged checkpoint by its path": BadInput(
        "supervisor", ("--debug", "--resume", "ckpt/step_000004"),
        "--resume ckpt/step_000004 cannot be resumed: ckpt/step_000004/state.pt is not a torch.save archive, or one "
        "cut short (File is not a zip file); the newest intact checkpoint beside it is ckpt/step_000002: --resume "
        "ckpt/step_000002", files={**planted_checkpoint(2), **planted_checkpoint(4, cut=True)}),
    "resume auto with a corrupt meta.json": BadInput(
        "supervisor", ("--debug", "--resume", "auto"),
        "is damaged (1; the latest: ", files={"ckpt/step_000004/meta.json": '{"step": 4, "format": "fu'}),
    "resume a damaged checkpoint by hand": BadInput(
        "pretrain_main.py", ("--debug", "--resume", "ckpt/step_000004"),
        "--resume ckpt/step_000004 cannot be resumed: ckpt/step_000004/meta.json is not readable JSON",
        files={"ckpt/step_000004/meta.json": "not JSON", "ckpt/step_000004/state.pt": torch_archive()}),
    "log folder on a full disk": BadInput(
        "supervisor", ("--debug",), "logs is not writable (No space left on device, 0 bytes free); choose a "
        "writable one with --log-dir DIR", full_disks=("logs",)),
    "checkpoint folder on a full disk": BadInput(
        "run_training.sh", ("--debug",), "ckpt is not writable (No space left on device, 0 bytes free); set "
        "checkpoint.dir to a writable folder", full_disks=("ckpt",)),
    "NCCL on CPU ranks": BadInput(
        "supervisor", ("--debug", "--set", "system.backend=nccl"),
        "system.backend 'nccl' needs CUDA GPUs; use gloo (or auto) on CPUs"),
    "liger loss on CPU ranks": BadInput(
        "supervisor", ("--debug", "--set", "training.loss=liger"),
        "training.loss liger needs a CUDA GPU (Triton kernels); use chunked or auto on CPUs"),
    "model folder that does not exist": BadInput(
        "supervisor", ("--debug", "--set", "model.name_or_path=models/none"),
        "model.name_or_path 'models/none': cannot read a model config there"),
    "model vocabulary below the tokenizer's": BadInput(
        "run_training.sh", ("--debug", "--set", "model.vocab_size=100", *SMALL_DATA),
        "the model's vocabulary (100) is smaller than the tokenizer's (300); use the model's own tokenizer"),
    "character device as the data source": BadInput(
        "supervisor", ("--debug", "--set", "data.source=/dev/zero", *SMALL_DATA),
        "data.source /dev/zero is a character device, not a file or folder", before_any_work=False),
    "unknown loss": BadInput(
        "supervisor", ("--debug", "--set", "training.loss=fused"),
        "training.loss must be one of auto, chunked, liger, full, got 'fused'"),
    "compile neither auto nor a boolean": BadInput(
        "run_training.sh", ("--debug", "--set", "system.compile=always"),
        "system.compile must be auto, true or false, got 'always'"),
    "unknown checkpointing policy": BadInput(
        "pretrain_main.py", ("--debug", "--set", "model.gradient_checkpointing=half"),
        "model.gradient_checkpointing must be one of none, selective, full, got 'half'"),
    "production preset on a CPU": BadInput(
        "run_training.sh", ("--preset", "production"),
        "preset 'production' (7.2B parameters, fsdp, bf16) needs GPUs and none was found; use --debug"),
    "GPU preset by hand on a CPU": BadInput(
        "pretrain_main.py", ("--preset", "1b"),
        "preset '1b' (1.1B parameters, ddp, auto) needs GPUs and none was found"),
    "fresh start over an unfinished run": BadInput(
        "run_training.sh", ("--debug",),
        "ckpt holds an unfinished run (up to step_000004 of 10 steps); continue it with --resume auto",
        files=UNFINISHED),
    "fresh start by hand over an unfinished run": BadInput(
        "pretrain_main.py", ("--debug",), "ckpt holds an unfinished run (up to step_000004 of 10 steps)",
        files=UNFINISHED),
    "log folder not writable": BadInput(
        "supervisor", ("--debug", "--log-dir", "occupied/logs"),
        "the log folder occupied/logs is not writable (Not a directory); choose a writable one with --log-dir DIR",
        files=OCCUPIED),
    "checkpoint folder not writable": BadInput(
        "run_training.sh", ("--debug", "--set", "checkpoint.dir=occupied/ckpt"),
        "the checkpoint folder occupied/ckpt is not writable (Not a directory); set checkpoint.dir to a writable "
        "folder", files=OCCUPIED),
    "checkpoint folder not writable by hand": BadInput(
        "pretrain_main.py", ("--debug", "--set", "checkpoint.dir=occupied/ckpt"),
        "the checkpoint folder occupied/ckpt is not writable", files=OCCUPIED),
    "run folder not writable by hand": BadInput(
        "pretrain_main.py", ("--debug", "--set", "logging.run_dir=occupied/run"),
        "the run folder occupied/run is not writable (Not a directory); set logging.run_dir", files=OCCUPIED),
}


def no_half_written_output(folder: Path, planted: dict[str, str | bytes]) -> None:
    """No staging folder in the cache, no invalid token cache, no checkpoint of any kind but those the case planted."""
    cache = folder / "cache"
    assert not list(cache.rglob(f"{BUILD_PREFIX}*")), "a cache build was left half-way"
    assert all(entry.problem is None for entry in list_caches(cache)), "an invalid token cache was left"
    ckpt = folder / "ckpt"
    made = set(ckpt.glob(f"{STEP_PREFIX}*")) - {(folder / name).parent for name in planted}
    assert not made and not list(ckpt.glob(f"{TMP_PREFIX}*"))


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    with ExitStack() as disks:
        for folder in case.full_disks:
            fill(disks.enter_context(small_disk(tmp_path / folder, "64k")))
        run_bad_input(case, tmp_path)


def run_bad_input(case: BadInput, tmp_path: Path) -> None:
    for relative, content in case.files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (tmp_path / relative).write_bytes(content)
        else:
            (tmp_path / relative).write_text(content)
    # Everything a run writes goes under tmp_path, unless the case names a folder (its flags come later: they win).
    paths = ("--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}")
    if case.command in ("run_training.sh", "supervisor"):
        paths += ("--log-dir", str(tmp_path / "logs"), "--no-footer")
    env = clean_env(**{"PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", **case.env})
    proc = subprocess.Popen([*COMMANDS[case.command], *paths, *case.args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    with watching(proc) as tree:
        _, err = proc.communicate(timeout=TIMEOUT)
        tree.stop()
        assert tree.survivors(timeout=2.0) == []
    lines = err.splitlines()
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], err
    assert case.message in lines[-1], err
    if case.before_any_work:
        assert len(lines) == 1, err
    logs = tmp_path / "logs"  # a refused run leaves no run folder, however far it got
    assert not logs.exists() or not [p for p in logs.iterdir() if p.name != FILLER], "a run folder was left"
    no_half_written_output(tmp_path, case.files)


@pytest.mark.slow
def test_the_final_model_survives_its_token_cache_being_deleted(tmp_path: Path) -> None:
    """Deleting the token cache while the run trains (a cleanup, a full disk's victim) costs nothing: the rank holds
    what the final model needs (the tokenizer) from its start."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i} of a small corpus, about foxes and dogs and numbers.\n" for i in range(400)))
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [*COMMANDS["supervisor"], "--debug", "--nproc", "1", "--log-dir", str(tmp_path / "logs"), "--no-footer",
         "--set", f"data.cache_dir={cache}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set",
         f"data.source={corpus}", *SMALL_DATA, "--max-steps", "3", "--set", "debug.inject_fault=slow", "--set",
         "debug.inject_fault_step=1", "--set", "debug.inject_fault_delay_s=1"],
        cwd=tmp_path, env=clean_env(HF_HUB_OFFLINE="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with watching(proc):
        assert proc.stdout is not None
        for line in proc.stdout:  # the rank trains: its tokenizer was read when it started
            if "Step [1/" in line:
                shutil.rmtree(cache)
                break
        out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    assert not cache.exists()
    final = tmp_path / "ckpt" / "final"
    assert {"tokenizer.json", "model.safetensors"} <= {p.name for p in final.iterdir()}, out[-3000:]


# ---------------------------------------------------------------------------------------------------------------------
# Values: refused while the configuration is read, before anything starts, so checked in-process (milliseconds each)
# through the supervisor's own main with --print-config; the entry points share the flags, the files and the checks.

CONFIG_FILES: dict[str, bytes] = {
    "deep.json": b'{"training": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nan.json": b'{"training": {"learning_rate": NaN}}',
    "utf16.json": '{"training": {"max_steps": 5}}'.encode("utf-16"),
    "binary.json": bytes(range(256)) * 4,
    "dup.json": b'{"training": {"batch_size": 2}, "training": {"max_steps": 3}}',
    "dupkey.json": b'{"training": {"batch_size": 2, "batch_size": 3}}',
    "small.json": b'{"preset": "small"}',
    "nope.json": b'{"preset": "nope"}',
}
BAD_VALUES = {
    "max samples beyond any corpus": (("--max-samples", "99999999999999999999b"),
                                      "data.max_samples must be at most 9,007,199,254,740,992, got "),
    "beta1 above 1": (("--set", "training.beta1=1.5"), "training.beta1 must be within [0, 1), got 1.5"),
    "beta2 negative": (("--set", "training.beta2=-1"), "training.beta2 must be within [0, 1), got -1"),
    "init_std negative": (("--set", "model.init_std=-1"), "model.init_std must be within (0, 10], got -1"),
    "init_std NaN": (("--set", "model.init_std=NaN"), "model.init_std must be a finite number, got nan"),
    "ffn size negative": (("--set", "model.ffn_hidden_size=-5"), "model.ffn_hidden_size must be positive, got -5"),
    "seed beyond 64 bits": (("--set", "system.seed=99999999999999999999"),
                            "system.seed must be at most 18,446,744,073,709,551,615, got 99999999999999999999"),
    "dist timeout NaN": (("--set", "system.dist_timeout_s=NaN"), "system.dist_timeout_s must be a finite number"),
    "dist timeout negative": (("--set", "system.dist_timeout_s=-1"),
                              "system.dist_timeout_s must be within (0, 31,536,000], got -1"),
    "dist timeout 1e30": (("--set", "system.dist_timeout_s=1e30"),
                          "system.dist_timeout_s must be within (0, 31,536,000], got 1e+30"),
    "grad accumulation beyond int32": (("--set", "training.grad_accum_nums=99999999999999999999"),
                                       "training.grad_accum_nums must be at most 2,147,483,647"),
    "write stall on a step no checkpoint follows": (
        ("--max-steps", "40", "--set", "checkpoint.interval=10", "--set", "debug.inject_write_stall_step=10"),
        "debug.inject_write_stall_step 10 never fires: no checkpoint follows step 10 (steps count from 0); with "
        "checkpoint.interval 10 checkpoints follow steps 9, 19, 29 and 39: aim it at one"),
    "fault in a save on a step no checkpoint follows": (
        ("--set", "debug.inject_fault=sigkill", "--set", "debug.inject_fault_step=3", "--set",
         "debug.inject_fault_during=checkpoint"),
        "debug.inject_fault_step 3 never fires: no checkpoint follows step 3 (steps count from 0)"),
    "fault phase without a fault": (("--set", "debug.inject_fault_during=publishing"),
                                    "debug.inject_fault_during publishing says when a fault fires, and no fault is set"),
    "out-of-memory fault in a save": (
        ("--set", "debug.inject_fault=oom", "--set", "debug.inject_fault_step=4", "--set",
         "debug.inject_fault_during=staging"),
        "debug.inject_fault oom fires in a step's forward pass, never inside a checkpoint save"),
    "slow fault delay infinite": (("--set", "debug.inject_fault=slow", "--set", "debug.inject_fault_step=1", "--set",
                                   "debug.inject_fault_delay_s=Infinity"),
                                  "debug.inject_fault_delay_s must be a finite number, got inf"),
    "timeouts infinite": (("--hang-timeout", "inf", "--startup-timeout", "inf"),
                          "--hang-timeout must be a number of seconds within 0-2,592,000 (0 disables the watchdog), "
                          "got inf"),
    "hang timeout NaN": (("--hang-timeout", "nan"), "--hang-timeout must be a number of seconds within 0-2,592,000"),
    "startup timeout NaN": (("--startup-timeout", "nan"),
                            "--startup-timeout must be a number of seconds within 0-2,592,000, got nan"),
    "node timeout 0": (("--node-timeout", "0"), "--node-timeout must be a number of seconds within (0, 2,592,000], "
                                                "got 0"),
    "join timeout NaN": (("--join-timeout", "nan"), "--join-timeout must be a number of seconds within (0, 2,592,000]"),
    "ranks beyond any node": (("--nproc", "99999999999"), "--nproc must be within 1-1,024 (ranks on this node)"),
    "learning rate infinite": (("--lr", "inf"), "training.learning_rate must be a finite number, got inf"),
    "empty cache folder": (("--set", "data.cache_dir="), "data.cache_dir is empty; give a value"),
    "empty checkpoint folder": (("--set", "checkpoint.dir="), "checkpoint.dir is empty; give a value"),
    "empty data source": (("--set", "data.source="), "data.source is empty; give a value"),
    "preset given as a path": (("--preset", "../presets/debug"),
                               "preset '../presets/debug' is a path, not a preset's name ("),
    "config nested too deeply": (("--config", "deep.json"), "deep.json: invalid JSON: nested too deeply"),
    "config holding NaN": (("--config", "nan.json"), "nan.json: invalid JSON: NaN is not a JSON number"),
    "config in UTF-16": (("--config", "utf16.json"), "utf16.json is not UTF-8 text (byte 0); save the config as "
                                                     "UTF-8 JSON"),
    "binary config": (("--config", "binary.json"), "binary.json is not UTF-8 text (byte 128)"),
    "newline in a key": (("--set", "data.\nsplit=x"), "unknown key '\\nsplit' in section 'data'"),
    "section twice in a config": (("--config", "dup.json"), "dup.json: key 'training' appears twice in one object; "
                                                            "give each key once"),
    "key twice in a config": (("--config", "dupkey.json"),
                              "dupkey.json: key 'batch_size' appears twice in one object"),
    "key twice in a --set value": (("--set", 'data.mixture={"a": 1, "a": 2}'),
                                   """--set data.mixture={"a": 1, "a": 2}: key 'a' appears twice in one object"""),
    "empty preset": (("--preset", ""), "--preset is empty; give a preset's name (1b, debug, production, small)"),
    "empty config path": (("--config", ""), "--config is empty; give a JSON config file's path"),
    "config file naming another preset than --debug": (
        ("--config", "small.json"), "small.json names preset 'small', which conflicts with --debug"),
    "config file naming an unknown preset": (("--config", "nope.json"), "nope.json: unknown preset 'nope'"),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_bad_value(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    args, message = BAD_VALUES[name]
    for file, content in CONFIG_FILES.items():
        (tmp_path / file).write_bytes(content)
    monkeypatch.chdir(tmp_path)
    preset = () if "--preset" in args else ("--debug",)
    code = cli.main([*preset, "--log-dir", str(tmp_path / "logs"), *args, "--print-config"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "logs").exists()
