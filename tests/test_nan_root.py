"""NaN hunting to the root, end to end on 2 CPU ranks under the supervisor: a step replayed from the run's own
checkpoint prints the losses the run printed (bit-exact) and names the documents of its batch; a production NaN is
recomputed in the run and called reproducible (with the replay command, whose replay names the module) or not (the
rank's device suspected, in the report and in gpu_fault.json, the GPU left out of the restart); a loss spike rolls the
run back to the checkpoint before it, skipping batches, recorded so that a resumed run decides alike. The pieces
alone: the spike rule, the batch a step trains on past skips, the parameters kept for a recompute."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rank_support import LOG_LINE, TINY, base_env, kill_on_exit, merged, set_flags
from supervisor.diagnosis.gpu_fault import text_evidence
from trainer.config import Config
from trainer.data.batches import data_step
from trainer.diagnosis.recompute import KeptParameters
from trainer.diagnosis.spikes import SpikeDetector
from trainer.errors import UserError
from trainer.metrics import HISTORY_JOURNAL, Journal
from trainer.replay import recorded_skips

NAN_MODULE = "model.layers.1.mlp"


def supervise(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m supervisor ARGV` in `tmp_path`, output merged as the user sees it."""
    cmd = [sys.executable, "-m", "supervisor", "--no-footer", "--log-dir", str(tmp_path / "logs"), "--hang-timeout",
           "60", *argv]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env or base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    with kill_on_exit(proc):
        out, _ = proc.communicate(timeout=150)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def train(tmp_path: Path, cache_dir: Path, steps: int, **sections: dict[str, Any]) -> subprocess.CompletedProcess:
    """The tiny run (two layers) on 2 CPU ranks, production checks, a checkpoint every 10 steps."""
    layer = merged(merged(TINY, {"model": {"num_layers": 2}, "data": {"cache_dir": str(cache_dir)},
                                 "training": {"max_steps": steps},
                                 "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 10}}), sections)
    return supervise(tmp_path, "--nproc", "2", "--debug", *set_flags(layer))


def run_folder(out: str) -> Path:
    return Path(re.search(r"logs in (\S+)/\n", out).group(1))


def step_lines(out: str, first: int, last: int) -> dict[tuple[str, int], tuple[str, str, str]]:
    """(rank label, step) → (loss, LR, grad norm) of each rank's log line for steps first..last."""
    found = {}
    for line in out.splitlines():
        label, _, text = line.partition(":")
        if (m := LOG_LINE.match(text)) and first <= int(m["step"]) <= last:
            found[(label, int(m["step"]))] = (m["loss"], m["lr"], m["norm"])
    return found


def history_losses(run: Path, first: int, last: int) -> dict[int, float]:
    steps = json.loads((run / "training_history.json").read_text())["steps"]
    return {s["step"]: s["loss"] for s in steps if first <= s["step"] <= last}


@pytest.mark.slow
def test_replay_prints_the_runs_losses_bit_exact_and_the_batchs_documents(tmp_path: Path,
                                                                          token_cache_dir: Path) -> None:
    original = train(tmp_path, token_cache_dir, 30)
    assert original.returncode == 0, original.stdout
    source = run_folder(original.stdout)
    checkpoints = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").iterdir()}
    assert set(checkpoints) == {"step_000020", "step_000030"}

    replay = supervise(tmp_path, "--replay", str(source), "--step", "25")
    out = replay.stdout
    assert replay.returncode == 0, out
    assert f"supervisor: replay of step 25 of {source}: from {tmp_path / 'ckpt' / 'step_000020'} on 2 ranks" in out
    assert f"resumed from {tmp_path / 'ckpt' / 'step_000020'} at step 20" in out
    replayed = step_lines(out, 0, 29)
    assert set(replayed) == {(label, s) for label in ("CPU0", "CPU1") for s in range(20, 26)}  # then it stops
    assert replayed == step_lines(original.stdout, 20, 25)
    target = run_folder(out)
    assert target != source
    assert history_losses(target, 20, 25) == history_losses(source, 20, 25)  # the floats themselves
    for rank in (0, 1):  # each rank names the documents of its share of the batch
        assert f"CPU{rank}:INFO | [GPU {rank}] step 25's batch on this rank: 4 samples of" in out
        assert re.search(rf"CPU{rank}:INFO \| \[GPU {rank}\] step 25 rank {rank} micro-batch 0 row 3: tokens "
                         rf"[\d,]+-[\d,]+ \| document \d+ \(tokens [\d,]+-[\d,]+\) '", out), out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").iterdir()} == checkpoints
    assert json.loads((target / "config.json").read_text())["checkpoint"]["dir"] == str(target / "checkpoints")

    # step_000020 damaged where only its checksum shows it: passed over, said, and the replay starts further back
    state = tmp_path / "ckpt" / "step_000020" / "state.pt"
    with open(state, "r+b") as f:
        f.seek(4096)
        f.write(b"\xa5" * 256)
    again = supervise(tmp_path, "--replay", str(source), "--step", "21")
    assert again.returncode == 0, again.stdout
    assert re.search(rf"supervisor: {re.escape(str(state.parent))} passed over: {re.escape(str(state))} has checksum "
                     rf"[0-9a-f]+, meta.json recorded [0-9a-f]+\n", again.stdout), again.stdout
    assert "from step 0 (no checkpoint of the run at or before it) on 2 ranks" in again.stdout
    assert step_lines(again.stdout, 0, 21) == step_lines(original.stdout, 0, 21)



@pytest.mark.slow
def test_a_replay_leaves_out_the_runs_injected_process_fault(tmp_path: Path, token_cache_dir: Path) -> None:
    """Rank 1 SIGKILLed at step 3 of the first group, the run restarted and finished: its replay of step 4 runs
    through step 3 (the injection left out, said so), with the run's losses."""
    layer = merged(TINY, {"model": {"num_layers": 2}, "data": {"cache_dir": str(token_cache_dir)},
                          "training": {"max_steps": 6}, "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 5},
                          "debug": {"inject_fault": "sigkill", "inject_fault_step": 3, "inject_fault_rank": 1,
                                    "inject_fault_restart": 0}})
    original = supervise(tmp_path, "--nproc", "2", "--debug", "--max-restarts", "1", *set_flags(layer))
    assert original.returncode == 0 and "restart 1 of 1" in original.stdout, original.stdout
    replay = supervise(tmp_path, "--replay", str(run_folder(original.stdout)), "--step", "4")
    out = replay.stdout
    assert replay.returncode == 0, out
    assert ("supervisor: the run's injected debug.inject_fault sigkill at step 3 on rank 1 is left out: a replay "
            "reproduces the steps' numbers") in out, out
    assert "fault injection" not in out
    replayed = step_lines(out, 0, 5)
    assert set(replayed) == {(label, s) for label in ("CPU0", "CPU1") for s in range(5)}
    assert replayed == {key: line for key, line in step_lines(original.stdout, 0, 4).items() if key in replayed}


def test_replay_refuses_what_it_cannot_replay_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "logs" / "run"
    run.mkdir(parents=True)
    cases = [
        (["--step", "3"], "error: --step N names the step --replay RUN replays; add --replay <run folder>"),
        (["--replay", str(run), "--step", "3"], f"error: --replay {run}: no config.json there; name a run folder"),
    ]
    (tmp_path / "other").mkdir()
    for argv, line in cases:
        result = supervise(tmp_path / "other", *argv)
        assert result.returncode == 2 and result.stdout.startswith(line), result.stdout
        assert "Traceback" not in result.stdout
    (run / "config.json").write_text(json.dumps(TINY))
    for argv, line in [(["--replay", str(run)], f"error: --replay {run} needs the step to replay: --step N"),
                       (["--replay", str(run), "--step", "6"], f"error: --step 6 is not a step of {run} (its steps are "
                                                                f"0-5)"),
                       (["--replay", str(run), "--step", "2", "--set", "training.lr=1"],
                        "error: --replay runs the run's own config as it was; drop --set")]:
        result = supervise(tmp_path / "other", *argv)
        assert result.returncode == 2 and result.stdout.startswith(line), result.stdout



def test_a_replay_skips_the_batches_of_a_run_whose_rank_0_was_killed(tmp_path: Path) -> None:
    """The run's rollback skipped 4 batches from step 10, then rank 0 was killed outright: no
    training_history.json, but its journal recorded the spike, and the replay skips those batches too. A later group
    that resumed before the spike dropped it with the trajectory it replaced."""
    journal = Journal(tmp_path / HISTORY_JOURNAL)
    spike = {"step": 12, "loss": 68.8, "mean": 7.2, "std": 0.1, "policy": "rollback", "resumed_from": 10,
             "skip_from": 10, "skip_count": 4}
    journal.append("spike", spike)
    assert recorded_skips(tmp_path) == {"10": 4}
    journal.append("group", {"from": 8})  # a restart from step 8's checkpoint: the spike is yet to come
    assert recorded_skips(tmp_path) == {}
    journal.close()


@pytest.mark.slow
def test_replay_folds_the_ranks_onto_one_process(tmp_path: Path, token_cache_dir: Path) -> None:
    original = train(tmp_path, token_cache_dir, 22)
    assert original.returncode == 0, original.stdout
    folded = supervise(tmp_path, "--replay", str(run_folder(original.stdout)), "--step", "21", "--nproc", "1")
    out = folded.stdout
    assert folded.returncode == 0, out
    assert "the run's 2 ranks folded onto 1 (accumulation 2)" in out
    assert "CPU0:INFO | [GPU 0] step 21's batch on this rank: 8 samples of" in out
    assert "CPU1:" not in out
    means = {m.group(1): m.group(2) for m in re.finditer(r"step (2[01])/22 \| mean loss (\d+\.\d+)", original.stdout)}
    replayed = {m.group(1): m.group(2) for m in re.finditer(r"step (2[01])/22 \| mean loss (\d+\.\d+)", out)}
    assert replayed.keys() == {"20", "21"}
    for step, loss in replayed.items():  # a sum over ranks became a sum over micro-batches: equal to rounding
        assert abs(float(loss) - float(means[step])) <= 2e-4, (step, loss, means[step])


def test_a_production_nan_is_reproducible_in_the_run_and_its_replay_names_the_module(tmp_path: Path,
                                                                                  token_cache_dir: Path) -> None:
    inject = {"inject_nan_module": NAN_MODULE, "inject_nan_step": 25, "inject_nan_rank": 1}
    original = train(tmp_path, token_cache_dir, 27, training={"nan_recompute": True}, debug=inject)
    out = original.stdout
    assert original.returncode == 0, out
    source = run_folder(out)
    said = re.search(r"CPU1:WARNING \| \[GPU 1\] reproducible: the model's numerics at step 25 \(recomputed from the "
                     r"parameters before it: loss nan, gradient norm nan\); replay it with the NaN diagnostics on: "
                     r"bash run_training.sh --replay (\S+) --step 25\n", out)
    assert said, out
    assert Path(tmp_path / said.group(1)).resolve() == source
    assert "CPU0:WARNING | non-finite step 25 skipped (GPU 1 local loss non-finite)" in out
    assert "did not reproduce" not in out and not (source / "gpu_fault.json").exists()

    replay = supervise(tmp_path, "--replay", said.group(1), "--step", "25")
    assert replay.returncode == 0, replay.stdout
    assert "CPU1:NaN GRADIENT DETECTED [GPU 1]" in replay.stdout and "CPU0:NaN GRADIENT" not in replay.stdout
    assert f"CPU1:First non-finite forward output: {NAN_MODULE} (LlamaMLP)" in replay.stdout
    assert step_lines(replay.stdout, 0, 26) == step_lines(out, 20, 25)
    assert (run_folder(replay.stdout) / "checkpoints" / "debug" / "nan_debug_step_25.pkl").is_file()


def test_a_corrupted_result_does_not_reproduce_and_its_gpu_is_left_out(tmp_path: Path, token_cache_dir: Path) -> None:
    env = base_env(SUPERVISOR_FAKE_GPUS="0,1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "system": {"device": "auto"},
                          "training": {"max_steps": 8, "nan_recompute": True},
                          "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 4},
                          "debug": {"inject_fault": "corrupt", "inject_fault_step": 5, "inject_fault_rank": 1,
                                    "inject_fault_restart": 0}})
    run = supervise(tmp_path, "--nproc", "2", "--debug", "--max-restarts", "1", *set_flags(layer), env=env)
    out = run.stdout
    assert run.returncode == 0, out
    verdict = "did not reproduce: suspect GPU1: step 5's non-finite loss came out finite recomputed (loss "
    assert f"GPU1:ERROR | training stopped: {verdict}" in out
    assert f"supervisor: GPU fault: GPU 1 (its error: ERROR | training stopped: {verdict}" in out
    # DDP's state is whole in the node's memory: the restart on GPU 0 alone resumes from it
    assert re.search(r"supervisor: restart 1 of 1 after GPU1 \(rank 1\) failed: exit 1; the ranks resume from step \d+ "
                     r"in this node's memory \(from this run's latest checkpoint if that copy fails their checks\); on "
                     r"GPU 0", out), out[-3000:]
    assert "step 8/8, final loss" in out
    record = json.loads((run_folder(out) / "gpu_fault.json").read_text())
    assert list(record["gpus"]) == ["1"] and record["gpus"]["1"][0].startswith(verdict)
    assert set(record) == {"node", "gpus", "time", "slurm_job_id", "slurm_restart_count"}  # exclusion.NodeFault's


@pytest.mark.slow
def test_a_loss_spike_rolls_back_skipping_batches_and_a_resumed_run_decides_alike(tmp_path: Path,
                                                                                token_cache_dir: Path) -> None:
    spiky = {"training": {"spike_threshold": 3.0, "spike_window": 4, "spike_policy": "rollback",
                          "spike_skip": 4},
             "checkpoint": {"interval": 5, "keep": 10}, "debug": {"inject_spike_step": 12}}
    run = train(tmp_path, token_cache_dir, 20, **spiky)
    out = run.stdout
    assert run.returncode == 0, out
    assert re.search(r"CPU0:WARNING \| loss spike at step 12: loss \d+\.\d+ against \d\.\d+ ± \d\.\d+ over the steps "
                     r"before it \(above 3 standard deviations\); its batch's 8 samples and their documents in \S+"
                     r"spike_step_12.txt", out), out
    assert (f"CPU0:WARNING | rolled back to {tmp_path / 'ckpt' / 'step_000010'} (step 10), skipping 4 batches: from "
            f"step 10 on, each step trains on the batch 4 steps further on (training.skip_batches {{\"10\": 4}})") in out
    source = run_folder(out)
    history = json.loads((source / "training_history.json").read_text())
    assert history["spikes"] == [{**history["spikes"][0], "step": 12, "policy": "rollback", "resumed_from": 10,
                                  "skip_from": 10, "skip_count": 4}]
    assert [s["step"] for s in history["steps"]] == list(range(20))  # the curve the run trained, once
    assert (source / "spike_step_12.txt").read_text().count("\n") == 8

    # resumed from the checkpoint before the spike: it meets the spike again, and goes back alike
    again = tmp_path / "again"
    again.mkdir()
    (again / "ckpt").mkdir()
    shutil.copytree(tmp_path / "ckpt" / "step_000010", again / "ckpt" / "step_000010")
    resumed = train(again, token_cache_dir, 20, **{**spiky, "checkpoint": {**spiky["checkpoint"], "resume": "auto"}})
    assert resumed.returncode == 0, resumed.stdout
    assert "rolled back to" in resumed.stdout and "skipping 4 batches" in resumed.stdout
    assert step_lines(resumed.stdout, 10, 19) == step_lines(out, 10, 19)
    meta = json.loads((again / "ckpt" / "step_000015" / "meta.json").read_text())
    assert meta["config"]["training"]["skip_batches"] == {"10": 4} and len(meta["loop"]["spike_window"]) == 4

    # the run's own checkpoint before the spike found damaged at the rollback: it goes back to the one before that,
    # and says the step it loaded (resumed here from an intact copy of step 10 kept elsewhere)
    damaged = tmp_path / "damaged"
    for folder, names in ((damaged / "ckpt", ("step_000005", "step_000010")), (damaged / "copy", ("step_000010",))):
        for name in names:
            shutil.copytree(tmp_path / "ckpt" / name, folder / name)
    with open(damaged / "ckpt" / "step_000010" / "state.pt", "r+b") as f:
        f.seek(4096)
        f.write(b"\xa5" * 256)
    fell_back = train(damaged, token_cache_dir, 20,
                      **{**spiky, "checkpoint": {**spiky["checkpoint"], "resume": str(damaged / "copy" / "step_000010")}})
    out = fell_back.stdout
    assert fell_back.returncode == 0, out
    assert re.search(rf"CPU0:WARNING \| --resume: {re.escape(str(damaged / 'ckpt' / 'step_000010' / 'state.pt'))} has "
                     rf"checksum [0-9a-f]+, meta.json recorded [0-9a-f]+; resuming from "
                     rf"{re.escape(str(damaged / 'ckpt' / 'step_000005'))}, the newest intact checkpoint", out), out
    assert (f"CPU0:WARNING | rolled back to {damaged / 'ckpt' / 'step_000005'} (step 5), skipping 4 batches: from "
            f"step 10 on") in out, out
    assert "step 20/20, final loss" in out


def test_the_spike_rule_judges_a_full_window_and_keeps_spikes_out_of_it() -> None:
    detector = SpikeDetector(threshold=3.0, window=4)
    for step, loss in enumerate([5.0, 5.1, 4.9, 5.0]):
        assert detector.observe(step, loss) is None
    assert detector.observe(4, float("nan")) is None and detector.state() == [5.0, 5.1, 4.9, 5.0]
    spike = detector.observe(5, 9.0)
    assert spike is not None and spike.step == 5 and spike.mean == 5.0 and detector.state() == [5.0, 5.1, 4.9, 5.0]
    assert detector.observe(6, 5.05) is None and detector.state() == [5.1, 4.9, 5.0, 5.05]
    fresh = SpikeDetector(threshold=3.0, window=4)
    assert fresh.observe(0, 5.0) is None and fresh.observe(1, 500.0) is None  # judged once the window is full
    fresh.restore(detector.state())
    assert fresh.observe(7, 9.0) is not None


def test_skipped_batches_move_the_steps_after_them_on() -> None:
    assert [data_step(s, None) for s in range(3)] == [0, 1, 2]
    skips = {"10": 4, "20": 2}
    assert [data_step(s, skips) for s in (9, 10, 19, 20, 21)] == [9, 14, 23, 26, 27]


def test_the_kept_parameters_are_the_first_non_finite_steps_until_released() -> None:
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    kept = KeptParameters(params)
    kept.keep(torch.tensor(0.0), 3)
    assert kept.held_step() is None
    before = [p.detach().clone() for p in params]
    kept.keep(torch.tensor(1.0), 4)
    with torch.no_grad():
        params[0].add_(1.0)
    kept.keep(torch.tensor(1.0), 5)  # a later non-finite step: the first one stays held
    assert kept.held_step() == 4 and kept.nbytes == 17 * 4
    with kept.swapped():
        assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert torch.equal(params[0], before[0] + 1.0)
    kept.release()
    assert kept.held_step() is None


@pytest.mark.parametrize("section, message", [
    ({"training": {"nan_recompute": True, "strategy": "fsdp"}}, "training.nan_recompute redoes a step on one rank"),
    ({"training": {"spike_policy": "rollback", "spike_threshold": 4.0}}, "training.spike_policy rollback goes back"),
    ({"training": {"skip_batches": {"ten": 4}}}, "training.skip_batches maps a step to the batches skipped from it"),
    ({"training": {"replay_step": 1000}}, "training.replay_step 1000 is never reached"),
    ({"debug": {"inject_fault": "corrupt", "inject_fault_step": 3, "inject_fault_during": "checkpoint"}},
     "debug.inject_fault corrupt fires in a step's forward pass"),
])
def test_root_hunting_keys_refuse_what_cannot_work(section: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        Config.from_dict(section)


def test_the_supervisor_takes_a_step_that_did_not_reproduce_for_a_gpu_fault() -> None:
    line = "ERROR | training stopped: did not reproduce: suspect GPU1: step 5's non-finite loss came out finite"
    assert text_evidence(f"some output\n{line}\n") == f"its error: {line}"
