"""Device discovery and selection: the functions, and the whole supervisor through the fake-GPU seam."""

from __future__ import annotations

import json

import pytest

from rank_scripts.harness import clean_env, run
from supervisor.gpus import discovery as gpus
from trainer.errors import UserError


def inventory(spec: str, visible: str | None = None) -> gpus.Inventory:
    env = {gpus.FAKE_GPUS_ENV: spec}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return gpus.discover(env)


def ids(chosen: list[gpus.Gpu]) -> list[int]:
    return [g.index for g in chosen]


def test_selection_rules():
    eight = inventory("0,1,2,3,4,5,6,7")
    assert ids(gpus.select(eight, None, None)) == list(range(8))
    assert ids(gpus.select(eight, None, 3)) == [0, 1, 2]
    assert ids(gpus.select(eight, "5,0,3", None)) == [5, 0, 3]
    assert ids(gpus.select(inventory("0,1,2"), None, None)) == [0, 1, 2]
    assert gpus.select(gpus.Inventory((), ()), None, None) == []


def test_auto_prefers_free_memory_then_low_utilisation():
    busy = inventory("0:1000:90,1:80000:50,2:80000:5,3:500:0")
    assert ids(gpus.select(busy, "auto", None)) == [2]
    assert ids(gpus.select(busy, "auto", 2)) == [2, 1]
    assert ids(gpus.select(busy, "auto", 4)) == [2, 1, 0, 3]


@pytest.mark.parametrize("flag, nproc, message", [
    ("9", None, "GPU 9 does not exist; this machine has GPUs 0-7"),
    ("0,0", None, "a GPU is listed twice"),
    ("0,x", None, "expected GPU ids such as 0,3,5"),
    ("0,²", None, "expected GPU ids such as 0,3,5"),  # a digit to str.isdigit, not to int
    ("0,1", 3, "names 2 GPUs but --nproc is 3"),
    (None, 9, "--nproc 9: only 8 usable GPUs (0-7)"),
    ("auto", 9, "--gpus auto --nproc 9: only 8 usable GPUs"),
])
def test_impossible_requests(flag, nproc, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpus.select(inventory("0,1,2,3,4,5,6,7"), flag, nproc)


def test_cuda_visible_devices_limits_the_choice():
    inv = inventory("0,1,2,3", visible="2,3")
    assert ids(list(inv.usable)) == [2, 3]
    assert ids(gpus.select(inv, None, None)) == [2, 3]
    with pytest.raises(UserError, match=r"GPU 1 is hidden by CUDA_VISIBLE_DEVICES=2,3; usable GPUs: 2-3"):
        gpus.select(inv, "1", None)
    assert ids(list(inventory("0,1,2,3", visible="GPU-fake-3,0").usable)) == [3, 0]
    assert list(inventory("0,1", visible="").usable) == []
    assert ids(list(inventory("0,1,2", visible="1,7,2").usable)) == [1], "CUDA stops at the first unknown entry"


def test_real_discovery_honours_cuda_visible_devices(monkeypatch):
    """NVML's answer is filtered like the fake one: an empty CUDA_VISIBLE_DEVICES means no usable GPU (the default
    test tier runs so on GPU machines), while the fake-GPU seam still wins over the real probes."""
    h100 = gpus.Gpu(0, "NVIDIA H100 80GB HBM3", 80 * 2**30, 80 * 2**30, 0, "GPU-1234")
    monkeypatch.setattr(gpus, "nvml_gpus", lambda: [h100])
    assert gpus.discover({}).usable == (h100,) and not gpus.discover({}).fake
    hidden = gpus.discover({"CUDA_VISIBLE_DEVICES": ""})
    assert hidden.gpus == (h100,) and hidden.usable == () and gpus.select(hidden, None, None) == []
    with pytest.raises(UserError, match="GPU 0 is hidden by CUDA_VISIBLE_DEVICES=; usable GPUs: none"):
        gpus.select(hidden, "0", None)
    assert gpus.discover({"CUDA_VISIBLE_DEVICES": "-1"}).usable == ()
    fake = gpus.discover({gpus.FAKE_GPUS_ENV: "0,1"})
    assert fake.fake and ids(list(fake.usable)) == [0, 1]


def test_no_gpu_with_gpus_flag():
    with pytest.raises(UserError, match="no GPU found on this machine"):
        gpus.select(gpus.Inventory((), ()), "0", None)


def test_id_ranges():
    assert gpus.id_ranges([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8"
    assert gpus.id_ranges([4]) == "4"


# ---------------------------------------------------------------------------------------------------------------------
# Through the supervisor


def dumps(r) -> list[dict]:
    """What each rank wrote with --dump-env, in rank order."""
    folder = r.tmp / "env"
    return [json.loads((folder / f"rank{i}.json").read_text()) for i in range(len(list(folder.glob("*.json"))))]


@pytest.mark.parametrize("isolate", [False, True], ids=["torchrun-view", "isolated"])
def test_rank_environment_on_chosen_gpus(tmp_path, isolate):
    """A program other than the trainer sees the run's GPUs in local-rank order (cuda:LOCAL_RANK is its own), or with
    --isolate-gpus its own alone, as the trainer always does; GPU_RANK is the physical id either way."""
    (tmp_path / "env").mkdir()
    r = run(tmp_path, "--gpus", "3,1", *(["--isolate-gpus"] if isolate else []),
            entry_args=("--steps", "1", "--dump-env", str(tmp_path / "env")),
            env=clean_env(SUPERVISOR_FAKE_GPUS="0,1,2,3"))
    assert r.returncode == 0, r.stderr
    ranks = dumps(r)
    assert [d["env"]["CUDA_VISIBLE_DEVICES"] for d in ranks] == (["3", "1"] if isolate else ["3,1", "3,1"])
    assert [d["env"]["GPU_RANK"] for d in ranks] == ["3", "1"]
    for i, d in enumerate(ranks):
        env = d["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(i), str(i))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == ranks[0]["env"]["MASTER_PORT"]
        assert env["PYTHONUNBUFFERED"] == "1" and int(env["OMP_NUM_THREADS"]) >= 1
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert d["progress_fd_open"]
        assert "--run-config" not in d["argv"], "only the project's trainer gets --run-config"
        config = json.loads(open(env["SUPERVISOR_RUN_CONFIG"]).read())
        assert config["system"]["device"] == "cpu", "fake GPUs compute on the CPU"
    assert ranks[0]["ports"] == {"plain_bind": False, "reuse_listen": True}, \
        "the port is held against others, yet rank 0's store can take it"
    run_dir = r.run_dir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "errors", "flight_recorder", "gpu1.log",
                                                         "gpu3.log", "supervisor.log"]
    assert r.stdout.startswith("GPU3:") or r.stdout.startswith("GPU1:")


def test_cpu_ranks_have_no_gpu(tmp_path):
    (tmp_path / "env").mkdir()
    r = run(tmp_path, "--nproc", "3", entry_args=("--steps", "1", "--dump-env", str(tmp_path / "env")))
    assert r.returncode == 0, r.stderr
    assert "no GPU found: starting 3 CPU ranks on gloo" in r.stderr
    for d in dumps(r):
        assert d["env"]["CUDA_VISIBLE_DEVICES"] == "" and "GPU_RANK" not in d["env"]
    assert sorted(p.name for p in r.run_dir().glob("*.log")) == ["cpu0.log", "cpu1.log", "cpu2.log", "supervisor.log"]


def test_auto_choice_is_printed(tmp_path):
    r = run(tmp_path, "--gpus", "auto", "--nproc", "2", entry_args=("--steps", "1"),
            env=clean_env(SUPERVISOR_FAKE_GPUS="0:1000:90,1:80000:50,2:80000:5"))
    assert r.returncode == 0, r.stderr
    assert "--gpus auto chose GPU 2 (fake, 78.1 GiB free, 5% busy); GPU 1 (fake, 78.1 GiB free, 50% busy)" in r.stderr
    assert "2 ranks (GPU2, GPU1)" in r.stderr


def test_missing_gpu_is_a_user_error(tmp_path):
    r = run(tmp_path, "--gpus", "9", env=clean_env(SUPERVISOR_FAKE_GPUS="0,1,2,3,4,5,6,7"))
    assert r.returncode == 2
    assert r.stderr == "error: GPU 9 does not exist; this machine has GPUs 0-7\n"
    assert not r.log_dir.exists(), "nothing is created for a run that cannot start"


@pytest.mark.parametrize("spec, message", [("0,0,1", "GPU 0 is listed twice"), ("-1", "expected ids such as 0,1,2"),
                                           ("0:x", "expected ids"), ("²", "expected ids"), ("0:10:101", "at most 100")])
def test_a_fake_gpu_list_that_makes_no_machine_is_one_line(tmp_path, spec, message):
    """Two ranks on one fake id would write one gpu0.log; a negative id is no GPU."""
    r = run(tmp_path, "--nproc", "1", env=clean_env(SUPERVISOR_FAKE_GPUS=spec))
    assert r.returncode == 2 and r.stderr.startswith("error: SUPERVISOR_FAKE_GPUS=") and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not r.log_dir.exists()
