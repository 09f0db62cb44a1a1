"""NaN guard on a tiny Llama: skipped steps leave weights and optimizer state alone without host syncs, debug mode
names the first non-finite module and writes loadable dumps, the run stops after N consecutive non-finite steps,
and with 2 real CPU ranks (gloo) the rank whose loss went NaN reports while the other neither hangs nor diverges.

The same file is the 2-rank worker: ``python tests/test_nan_guard.py <rank> <world> <store file> <out dir>``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the worker runs as a script

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from rank_scripts.harness import project_pythonpath  # noqa: E402
from trainer.config import Config  # noqa: E402
from trainer.diagnosis.faults import FaultInjector, poison  # noqa: E402
from trainer.diagnosis.host_sync import HostSyncCounter  # noqa: E402
from trainer.diagnosis.nan_guard import NanGuard, NonFiniteError  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 2
NAN_MODULE = "model.layers.1.mlp"
REPORT_HEAD = [
    "=" * 80, "NaN GRADIENT DETECTED [GPU {gpu}]", "=" * 80, "Step: {step}", "Loss: nan", "Gradient Norm: nan", "",
    "=" * 40, "PROBLEMATIC TENSORS:", "=" * 40,
]


def tiny_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config).to(dtype)


def make_cfg(*, localize: bool = False, dump: bool = False, max_nonfinite: int = 3, nan_step: int | None = None,
             nan_rank: int = 0, checkpoint_dir: Path | None = None) -> Config:
    cfg = Config()
    cfg.debug.nan_localize, cfg.debug.nan_dump, cfg.debug.max_nonfinite_steps = localize, dump, max_nonfinite
    if nan_step is not None:
        cfg.debug.inject_nan_module, cfg.debug.inject_nan_step = NAN_MODULE, nan_step
        cfg.debug.inject_nan_rank = nan_rank
    if checkpoint_dir is not None:
        cfg.checkpoint.dir = str(checkpoint_dir)
    return cfg


def batch_for(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 * rank + step))


@dataclass
class MiniLoop:
    """The loop's order per optimizer step (trainer/loop.py), on one rank, around a tiny model."""

    cfg: Config
    out: Path
    rank: int = 0
    world_size: int = 1
    dtype: torch.dtype = torch.float32
    fused: bool = True
    scaler: torch.amp.GradScaler | None = None
    wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m
    saved: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = tiny_llama(self.dtype)
        self.faults = FaultInjector(self.cfg.debug, self.rank)
        self.faults.attach(self.model)
        self.guard = NanGuard(self.model, self.cfg, rank=self.rank, world_size=self.world_size,
                              gpu_id=str(self.rank), device=torch.device("cpu"), run_dir=self.out / "run",
                              checkpoint_dir=Path(self.cfg.checkpoint.dir))
        self.wrapped = self.wrap(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1, fused=self.fused)

    def save_checkpoint(self, path: Path) -> None:
        """Like trainer.checkpoint.store.save: every rank calls it, rank 0 writes."""
        self.saved.append(path)
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, path)

    def step(self, step: int, *, loss_nan: bool = False, syncs: HostSyncCounter | None = None) -> torch.Tensor:
        self.faults.before_step(step)
        batch = batch_for(step, self.rank)
        self.guard.start_step(step, batch)
        loss = self.wrapped(input_ids=batch, labels=batch).loss
        if loss_nan:
            loss = poison(loss)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        counter = syncs or HostSyncCounter()
        with counter:  # the guard's share of the step: no host read in production
            found_inf = self.guard.check(loss.detach(), grad_norm)
            self.guard.step_optimizer(self.optimizer, found_inf, scaler=self.scaler)
            self.optimizer.zero_grad(set_to_none=True)
            self.guard.after_step(step, loss.detach(), grad_norm, found_inf, self.save_checkpoint)
        return found_inf

    def state(self) -> dict[str, torch.Tensor]:
        """Weights and every optimizer state tensor, cloned."""
        snap = {f"w:{n}": p.detach().clone() for n, p in self.model.named_parameters()}
        for i, p in enumerate(self.model.parameters()):
            snap.update({f"s{i}:{k}": v.clone() for k, v in self.optimizer.state[p].items()})
        return snap


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nan_percentages(pkl: Path) -> dict[str, float]:
    """The user's snippet, verbatim apart from collecting instead of printing."""
    found = {}
    with open(pkl, "rb") as f:
        debug_data = pickle.load(f)
    for name, grad in debug_data["gradients"].items():
        if np.isnan(grad).any():
            found[name] = np.isnan(grad).sum() / grad.size * 100
    return found


# ---------------------------------------------------------------------------------------------------------------------
# One process


def test_skipped_step_leaves_everything_untouched_without_host_sync(tmp_path: Path) -> None:
    loop = MiniLoop(make_cfg(nan_step=1, checkpoint_dir=tmp_path / "ckpt"), tmp_path)
    syncs = HostSyncCounter()
    assert loop.step(0, syncs=syncs).item() == 0
    before = loop.state()
    assert loop.step(1, syncs=syncs).item() == 1
    assert same(before, loop.state())  # weights, exp_avg, exp_avg_sq and step
    assert loop.step(2, syncs=syncs).item() == 0
    assert not same(before, loop.state())
    assert syncs.count == 0
    assert loop.guard.on_log(2) == ["WARNING | non-finite step 1 skipped (GPU 0 local loss non-finite); "
                                    "1 skipped so far"]
    assert loop.guard.skipped_steps == 1 and loop.guard.on_log(3) == []
    assert not loop.saved and not (tmp_path / "ckpt").exists()  # production dumps only when it stops


def test_non_fused_optimizer_falls_back_to_one_host_read(tmp_path: Path) -> None:
    loop = MiniLoop(make_cfg(nan_step=1, checkpoint_dir=tmp_path / "ckpt"), tmp_path, fused=False)
    loop.step(0)
    before = loop.state()
    syncs = HostSyncCounter()
    loop.step(1, syncs=syncs)
    assert same(before, loop.state()) and syncs.count == 1
    loop.step(2)
    assert not same(before, loop.state())


def test_production_stops_after_consecutive_nonfinite_steps_with_a_dump(tmp_path: Path) -> None:
    loop = MiniLoop(make_cfg(max_nonfinite=2, checkpoint_dir=tmp_path / "ckpt"), tmp_path)
    for step, bad in enumerate([False, True, False, True]):  # never two in a row
        loop.step(step, loss_nan=bad)
    assert len(loop.guard.on_log(3)) == 2
    loop.step(4, loss_nan=True)  # with step 3: two in a row
    loop.step(5, loss_nan=True)
    with pytest.raises(NonFiniteError, match=r"2 consecutive non-finite steps \(steps 3-4\).*GPU 0 local loss"):
        loop.guard.on_log(5)
    assert loop.saved == [tmp_path / "ckpt" / "nan_grad_step_5.pt"]
    assert torch.load(loop.saved[0])["model"].keys() == loop.model.state_dict().keys()
    pkl = tmp_path / "ckpt" / "debug" / "nan_debug_step_4.pkl"  # the step that reached the limit
    with open(pkl, "rb") as f:
        data = pickle.load(f)
    assert data["step"] == 4 and np.isnan(data["loss"]) and data["gpu_id"] == "0"
    assert np.array_equal(data["batch"], batch_for(4, 0).numpy())
    assert data["parameters"].keys() == dict(loop.model.named_parameters()).keys()
    assert nan_percentages(pkl) == {}  # production keeps no gradients; the message says to rerun with --debug
    assert not list(pkl.parent.glob(".*.tmp"))


def test_debug_mode_reports_the_first_nonfinite_module_and_dumps(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    loop = MiniLoop(make_cfg(localize=True, dump=True, nan_step=1, checkpoint_dir=tmp_path / "ckpt"), tmp_path)
    loop.step(0)
    assert capsys.readouterr().out == ""
    before = loop.state()
    loop.step(1)
    assert same(before, loop.state())
    out = capsys.readouterr().out.splitlines()
    assert out[:len(REPORT_HEAD)] == [line.format(gpu=0, step=1) for line in REPORT_HEAD]
    assert out[len(REPORT_HEAD)].startswith("⚠️  Gradients with NaN (")
    assert "  • model.layers.1.mlp.down_proj.weight (shape: torch.Size([32, 64]))" in out
    assert "    Grad values: ['NaN', 'NaN', 'NaN', 'NaN', 'NaN', ...]" in out
    assert "    NaN count: 2048/2048" in out
    first = next(line for line in out if line.startswith("First non-finite forward output: "))
    assert first.startswith(f"First non-finite forward output: {NAN_MODULE} (LlamaMLP)")
    assert "| input: " in first and "nan=0 inf=0" in first and f"nan={BATCH * SEQ * 32} inf=0" in first
    pkl = tmp_path / "ckpt" / "debug" / "nan_debug_step_1.pkl"
    assert f"Offending batch: token ids [{BATCH}, {SEQ}] saved in {pkl} (key 'batch')" in out
    assert out[-2:] == [f"Checkpoint saved: {tmp_path / 'ckpt' / 'nan_grad_step_1.pt'}", f"Debug tensors saved: {pkl}"]

    nan = nan_percentages(pkl)
    assert nan[f"{NAN_MODULE}.down_proj.weight"] == 100.0
    assert 0 < nan["model.embed_tokens.weight"] < 100  # only the rows of the batch's tokens
    with open(pkl, "rb") as f:
        data = pickle.load(f)
    assert data["first_nonfinite_module"]["name"] == NAN_MODULE and data["nonfinite_modules"][0] == NAN_MODULE
    assert data["step"] == 1 and data["rank"] == 0 and np.array_equal(data["batch"], batch_for(1, 0).numpy())
    assert data["gradients_source"].startswith("local")
    assert (tmp_path / "run" / "nan_report_step_1.txt").read_text().splitlines() == out
    loop.step(2)
    assert capsys.readouterr().out == "" and not same(before, loop.state())  # finite again: trains on


def test_debug_mode_stops_at_the_limit(tmp_path: Path) -> None:
    loop = MiniLoop(make_cfg(localize=True, max_nonfinite=2, checkpoint_dir=tmp_path / "ckpt"), tmp_path)
    loop.step(0, loss_nan=True)
    assert not loop.saved  # nan_dump off: report only
    with pytest.raises(NonFiniteError, match=r"2 consecutive non-finite steps \(steps 0-1\)"):
        loop.step(1, loss_nan=True)
    assert loop.saved == [tmp_path / "ckpt" / "nan_grad_step_1.pt"]  # the stop always dumps
    assert (tmp_path / "ckpt" / "debug" / "nan_debug_step_1.pkl").is_file()


def test_half_precision_dump_is_float32(tmp_path: Path) -> None:
    loop = MiniLoop(make_cfg(localize=True, dump=True, nan_step=0, checkpoint_dir=tmp_path / "ckpt"), tmp_path,
                    dtype=torch.bfloat16)
    loop.step(0)
    with open(tmp_path / "ckpt" / "debug" / "nan_debug_step_0.pkl", "rb") as f:
        data = pickle.load(f)
    assert {a.dtype for a in data["parameters"].values()} == {np.dtype(np.float32)}
    assert {a.dtype for a in data["gradients"].values()} == {np.dtype(np.float32)}


def test_grad_scaler_overflow_is_skipped_but_not_counted(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)  # overflows fp32 gradients
    loop = MiniLoop(make_cfg(max_nonfinite=1, checkpoint_dir=tmp_path / "ckpt"), tmp_path, scaler=scaler)
    before = loop.state()
    for step in range(2):  # loss ≈ ln(64) ≈ 4.16: times 2**127 or 2**126 is beyond float32
        assert loop.step(step).item() == 1  # the guard sees the scaler's inf norm
    after = loop.state()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the weights (no optimizer state before step 0)
    assert all(v.count_nonzero() == 0 for k, v in after.items() if k.startswith("s"))
    assert scaler.get_scale() == 2.0**125  # halved on every overflow
    assert loop.guard.on_log(1)[0].endswith("(fp16 gradient overflow; the loss scale was lowered); 1 skipped so far")
    scaler.update(1.0)
    loop.step(2)
    assert not same(before, loop.state())
    loop.step(3, loss_nan=True)  # a NaN loss is the model's fault, whatever the scale: counted
    with pytest.raises(NonFiniteError, match="GPU 0 local loss non-finite"):
        loop.guard.on_log(3)


def test_host_sync_counter_counts_device_to_host_reads() -> None:
    t = torch.ones(3)
    with HostSyncCounter() as syncs:
        t.sum().item()
        bool(t[0])
        t.tolist()
        t.cpu()
        _ = t * 2 + 1
        torch.isfinite(t).all()
    assert syncs.count == 4
    assert torch.Tensor.tolist(t) == [1.0, 1.0, 1.0]  # the methods are restored


# ---------------------------------------------------------------------------------------------------------------------
# Two real CPU ranks (gloo)


SCENARIOS = ("debug", "production")


def run_scenario(scenario: str, rank: int, world_size: int, out: Path) -> dict[str, object]:
    """One rank of one scenario: DDP around the tiny Llama, NaN on rank 1, the guard in the scenario's mode."""
    from torch.nn.parallel import DistributedDataParallel

    if scenario == "debug":  # NaN in model.layers.1.mlp at step 3 on rank 1, every step checked and dumped
        cfg, steps, log_every, bad = make_cfg(localize=True, dump=True, nan_step=3, nan_rank=1,
                                              checkpoint_dir=out / "ckpt"), 6, 1, set()
    else:  # production: one NaN step, training goes on, then NaN losses on rank 1 until the run stops
        cfg, steps, log_every, bad = make_cfg(max_nonfinite=2, checkpoint_dir=out / "ckpt"), 8, 2, {1, 4, 5, 6, 7}
    loop = MiniLoop(cfg, out, rank=rank, world_size=world_size, wrap=DistributedDataParallel)
    result: dict[str, list[object]] = {"lines": [], "found_inf": [], "weights": [], "untouched": []}
    try:
        for step in range(steps):
            before = loop.state()
            result["found_inf"].append(loop.step(step, loss_nan=rank == 1 and step in bad).item())
            if result["found_inf"][-1]:
                result["untouched"].append(same(before, loop.state()))
            result["weights"].append(sum(float(p.double().sum()) for p in loop.model.parameters()))
            if step % log_every == log_every - 1:
                result["lines"] += loop.guard.on_log(step)
    except NonFiniteError as e:
        result["stopped"] = [step, str(e)]
    result["saved"] = [str(p) for p in loop.saved]
    return result


def worker(rank: int, world_size: int, store: str, out: Path) -> None:
    """One rank process: both scenarios in one process group (the imports dominate the cost of a rank)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    for scenario in SCENARIOS:
        print(f"--- {scenario}", flush=True)
        result = run_scenario(scenario, rank, world_size, out / scenario)
        (out / scenario / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Both ranks as real processes; none may hang (rank 0 must get past the step rank 1 went NaN in)."""
    out = tmp_path_factory.mktemp("two_ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": project_pythonpath()}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(out / "store"), str(out)], cwd=out,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            for q in ([*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]
                      if p.poll() is None else []):
                q.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    return out, outputs


def scenario_output(text: str, scenario: str) -> str:
    return text.split(f"--- {scenario}\n", 1)[1].split("--- ", 1)[0]


def results(out: Path, scenario: str) -> list[dict[str, list[object]]]:
    return [json.loads((out / scenario / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_debug_mode_names_the_rank_and_the_layer(two_ranks: tuple[Path, list[str]]) -> None:
    root, outputs = two_ranks
    out, (r0, r1) = root / "debug", results(root, "debug")
    out0, out1 = (scenario_output(text, "debug") for text in outputs)
    assert r0["found_inf"] == r1["found_inf"] == [0, 0, 0, 1, 0, 0]  # one decision on both ranks
    assert r0["untouched"] == r1["untouched"] == [True]  # weights and optimizer state, on both
    assert r0["weights"] == r1["weights"] and r0["weights"][2] == r0["weights"][3] != r0["weights"][4]
    line = "WARNING | non-finite step 3 skipped (GPU 1 local loss non-finite); 1 skipped so far"
    assert r0["lines"] == r1["lines"] == [line]
    assert "NaN GRADIENT DETECTED" not in out0  # rank 0's own loss stayed finite
    assert "NaN GRADIENT DETECTED [GPU 1]" in out1 and "Step: 3" in out1
    assert f"First non-finite forward output: {NAN_MODULE} (LlamaMLP)" in out1
    checkpoint = out / "ckpt" / "nan_grad_step_3.pt"
    assert r0["saved"] == r1["saved"] == [str(checkpoint)] and checkpoint.is_file()  # a collective save: both call
    pkl = out / "ckpt" / "debug" / "nan_debug_step_3.pkl"  # one rank dumped: no GPU id in the name
    assert sorted(p.name for p in pkl.parent.iterdir()) == [pkl.name]
    nan = nan_percentages(pkl)
    assert nan[f"{NAN_MODULE}.down_proj.weight"] == 100.0  # rank 1's local gradients, before the all-reduce
    with open(pkl, "rb") as f:
        data = pickle.load(f)
    assert data["rank"] == 1 and data["gpu_id"] == "1" and data["loss_nonfinite_gpus"] == ["1"]
    assert data["first_nonfinite_module"]["name"] == NAN_MODULE
    assert np.array_equal(data["batch"], batch_for(3, 1).numpy())


def test_two_ranks_production_goes_on_then_stops_together(two_ranks: tuple[Path, list[str]]) -> None:
    root, outputs = two_ranks
    out, (r0, r1) = root / "production", results(root, "production")
    out0, out1 = (scenario_output(text, "production") for text in outputs)
    assert r0["found_inf"] == r1["found_inf"] == [0, 1, 0, 0, 1, 1]
    assert r0["untouched"] == r1["untouched"] == [True, True, True]
    assert r0["weights"] == r1["weights"] and r0["weights"][1] != r0["weights"][3]  # trained on after step 1
    assert r0["lines"] == r1["lines"] == [
        "WARNING | non-finite step 1 skipped (GPU 1 local loss non-finite); 1 skipped so far"]
    assert r0["stopped"][0] == r1["stopped"][0] == 5  # both at the same log step
    assert "2 consecutive non-finite steps (steps 4-5)" in r0["stopped"][1]
    assert "GPU 1 local loss non-finite" in r0["stopped"][1]
    assert "NaN GRADIENT DETECTED [GPU 1]" in out1 and "NaN GRADIENT DETECTED" not in out0
    assert r0["saved"] == r1["saved"] == [str(out / "ckpt" / "nan_grad_step_5.pt")]
    assert (out / "ckpt" / "nan_grad_step_5.pt").is_file()
    assert (out / "ckpt" / "debug" / "nan_debug_step_5.pkl").is_file()


if __name__ == "__main__":
    rank_, world_, store_, out_ = sys.argv[1:5]
    worker(int(rank_), int(world_), store_, Path(out_))
