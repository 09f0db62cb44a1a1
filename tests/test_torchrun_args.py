"""torchrun's command line read in process (`supervisor.launch.torchrun_args`): which command lines are torchrun's,
what each flag becomes, the defaults torchrun takes (PET_* variables, where several nodes meet), its parser's
abbreviations, and what is refused in one line before anything starts."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from supervisor.launch import cli, torchrun_args
from supervisor.plan import rendezvous
from trainer.errors import UserError

PROGRAMS = Path(__file__).resolve().parent / "torchrun_programs"


def read(*argv: str) -> tuple:
    return cli.read_command_line(list(argv))


def test_torchruns_command_line_is_recognised_and_the_supervisors_is_not():
    own, theirs = cli.build_parser(), torchrun_args.build_parser(cli.add_torchrun_side_flags)
    for argv in (["prog.py"], ["--gpus", "1", "prog.py"], ["--standalone"], ["-m", "pkg"], ["--nproc_per_node=2"],
                 ["--no-python", "x"], ["--tee", "3"], ["--node_rank", "1"]):
        assert torchrun_args.recognised(argv, own, theirs), argv
    for argv in (["--debug"], ["--nproc", "2", "--entry", "w.py", "--", "prog.py"], ["--set", "a.b=1", "--gpus", "1"],
                 ["--max-restarts", "2", "--hang-timeout", "5"]):
        assert not torchrun_args.recognised(argv, own, theirs), argv


def test_torchruns_flags_become_the_supervisors_launch():
    script = str(PROGRAMS / "flaky.py")
    args, program_args, launch, notes = read("--nproc_per_node=3", "--max_restarts", "2", "--shutdown-timeout=5",
                                             "--role", "trainer", "--rdzv_id=job7", "--master_port=1234", script,
                                             "--nproc_per_node", "9", "--", "x")
    assert (args.nproc, args.max_restarts, args.grace_period, args.master_port) == (3, 2, 5.0, 1234)
    assert program_args == ["--nproc_per_node", "9", "--", "x"], "everything after the program is the program's"
    assert (launch.mode, launch.role, launch.run_id, notes) == ("script", "trainer", "job7", [])
    args, _, _, _ = read("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--node-timeout", "7",
                         "--join-timeout", "60", script)
    assert (args.node_timeout, args.join_timeout) == (7.0, 60.0)  # the supervisor's own, beside torchrun's
    args, _, launch, _ = read("--standalone", "--master-port", "1234", script)
    assert (args.master_addr, args.master_port, args.nnodes) == ("localhost", None, 1)
    uuid.UUID(launch.run_id)
    args, _, launch, _ = read("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500",
                              "--nnodes", "2:2", script)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, launch.run_id) == \
        (2, 1, "node0", 29500, "none")
    args, _, _, _ = read("--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0", script)  # as c10d users do
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (4, None, "node0", 29400)
    args, _, _, _ = read("--nproc-per-node", "cpu", script)
    assert args.nproc is None and args.cpu_ranks >= 1 and "system.device=cpu" in args.set
    args, _, launch, _ = read("--gpus", "2,5", "-m", "pkg.train", "--lr=3")
    assert (args.gpus, args.nproc, launch.mode, str(launch.program)) == ("2,5", None, "module", "pkg.train")
    args, entry_args, launch, _ = read("--nproc-per-node", "2", "pretrain_main.py", "--debug", "--set", "a.b=1")
    assert launch is None and entry_args == [] and (args.nproc, args.debug, args.set) == (2, True, ["a.b=1"])


@pytest.mark.parametrize("release, addr", [((2, 11), "127.0.0.1"), ((2, 12), "localhost"), ((2, 13), "localhost")])
def test_a_single_node_without_an_endpoint_meets_where_the_installed_torchrun_would(monkeypatch, release, addr):
    """`torchrun --nproc-per-node 2 train.py`: torch 2.12's torchrun on runs it as --standalone (localhost, a fresh
    run id); 2.11's as a static rendezvous at --master-addr (127.0.0.1). MASTER_ADDR is what the program sees, so the
    installed torch decides, as for its own torchrun."""
    monkeypatch.setattr(torchrun_args, "torch_release", lambda: release)
    args, _, launch, _ = read("--nproc-per-node", "2", str(PROGRAMS / "flaky.py"))
    static = addr == "127.0.0.1"
    # no address given: the supervisor's single-node default, 127.0.0.1 (supervisor.launch.cli), torchrun's too
    assert (args.master_addr, args.master_port) == (None if static else "localhost", None)
    assert (launch.run_id == "none") == static
    args, _, _, _ = read("--standalone", str(PROGRAMS / "flaky.py"))  # --standalone itself: every release
    assert args.master_addr == "localhost"


def test_flags_left_off_the_command_line_come_from_pet_variables(monkeypatch, tmp_path, capsys):
    """As torchrun reads them (what Kubeflow's PyTorchJob sets before a plain `torchrun script.py`); the command line
    wins; a value the flag would refuse is one line naming the variable."""
    script = str(PROGRAMS / "flaky.py")
    for name, value in {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "node0",
                        "PET_MASTER_PORT": "23456", "PET_MAX_RESTARTS": "2", "PET_RDZV_ID": "job7"}.items():
        monkeypatch.setenv(name, value)
    args, _, launch, _ = read(script)
    assert (args.nnodes, args.nproc, args.node_rank, args.master_addr, args.master_port, args.max_restarts,
            launch.run_id) == (2, 3, 1, "node0", 23456, 2, "job7")
    args, _, _, _ = read("--node-rank", "0", "--nproc_per_node=1", script)
    assert (args.node_rank, args.nproc, args.nnodes) == (0, 1, 2)
    monkeypatch.delenv("PET_NNODES")
    monkeypatch.setenv("PET_STANDALONE", "1")
    args, _, launch, _ = read(script)
    assert (args.master_addr, args.master_port, args.nnodes) == ("localhost", None, 1)
    uuid.UUID(launch.run_id)
    assert read("--debug")[2] is None  # the supervisor's own command line does not read them
    monkeypatch.setenv("PET_NODE_RANK", "one")
    assert cli.main(["--log-dir", str(tmp_path / "logs"), script]) == 2
    err = capsys.readouterr().err
    assert err == ("error: PET_NODE_RANK='one': expected a value for --node-rank (torchrun reads it as --node-rank "
                   "when the command line leaves that out); fix or unset it\n"), err


def test_abbreviations_and_a_program_after_a_double_dash_are_read_as_torchrun_reads_them():
    """torchrun's parser takes a flag's unambiguous prefix and ``--`` before the program; what follows the program
    is the program's, even where it looks like one of torchrun's flags abbreviated (torchrun itself refuses a
    program's ``--max 1`` as ambiguous)."""
    script = str(PROGRAMS / "flaky.py")
    args, program_args, launch, _ = read("--nproc_per", "3", "--max_r=2", "--", script, "--max", "1", "--", "x")
    assert (args.nproc, args.max_restarts, launch.program, program_args) == (3, 2, script, ["--max", "1", "--", "x"])
    own = read("--nproc", "2", "--gpu", "1", "--debug")  # the supervisor's own, abbreviated: still its own
    assert own[2] is None and (own[0].nproc, own[0].gpus) == (2, "1")
    own = read("--nproc", "2", "--entry", script, "--", "run.py")  # after --: --entry's arguments
    assert own[2] is None and own[1] == ["run.py"]


def test_several_nodes_without_an_address_meet_where_torchrun_would():
    """torchrun's static rendezvous defaults to 127.0.0.1:29500, its c10d one to localhost:29400: the same here,
    saying so (every node on one host, or the address named)."""
    script = str(PROGRAMS / "flaky.py")
    args, _, _, notes = read("--nnodes", "2", "--node-rank", "1", script)
    assert (args.master_addr, args.master_port) == ("127.0.0.1", 29500)
    assert notes == ["--master-addr not given: node 0 is 127.0.0.1:29500, as under torchrun (every node on this host; "
                     "--master-addr HOST names node 0 elsewhere)"]
    args, _, _, notes = read("--nnodes", "2", "--master-addr", "node0", script)
    assert (args.master_addr, args.master_port) == ("node0", 29500)
    assert notes == ["--master-port not given: node 0's port is 29500, as under torchrun"]
    args, _, _, notes = read("--nnodes", "2", "--rdzv-backend", "c10d", script)
    assert (args.master_addr, args.master_port) == ("localhost", 29400) and "localhost:29400" in notes[0]
    args, _, _, notes = read("--master-port", "65535", script)  # one node: no control port after it
    assert (args.master_port, notes) == (65535, [])
    cli.node_layout(args, notes)
    cli.check_flags(args)  # refused on several nodes only


def test_flags_without_a_use_here_are_accepted_with_one_line_each():
    flags = ["--tee", "3", "-r", "3", "--log_dir=/tmp/x", "--monitor-interval", "1", "--start_method=fork",
             "--rdzv-conf", "join_timeout=5", "--local-addr", "h", "--local-ranks-filter", "0", "--run-path",
             "--numa-binding", "node", "--signals-to-handle", "SIGUSR1", "--event-log-handler", "x",
             "--logs-specs", "x", "--duplicate-stdout-filters", "a", "--duplicate-stderr-filters", "b"]
    args, _, launch, notes = read(*flags, str(PROGRAMS / "flaky.py"))
    assert args.log_dir == "/tmp/x" and args.local_addr == "h"  # honoured: where this node connects from
    assert launch.console_ranks == {0} and launch.signals_to_handle == "SIGUSR1"  # honoured too
    named = [note.split(":", 1)[0] for note in notes]
    assert sorted(named) == sorted(["--tee 3", "--redirects 3", "--log-dir /tmp/x", "--monitor-interval 1",
                                    "--start-method fork", "--rdzv-conf join_timeout=5",
                                    "--run-path", "--numa-binding node",
                                    "--signals-to-handle SIGUSR1", "--event-log-handler x", "--logs-specs x",
                                    "--duplicate-stdout-filters a", "--duplicate-stderr-filters b"])
    assert all("\n" not in note for note in notes)


@pytest.mark.parametrize("argv, message", [
    (("--nnodes", "1:4", "P"), "--nnodes 1:4: elastic node ranges are not supported"),
    (("--rdzv-backend", "etcd", "P"), "--rdzv-backend etcd: only static and c10d rendezvous are supported"),
    (("--nproc-per-node", "xpu", "P"), "--nproc-per-node xpu: expected a number, gpu, cpu or auto"),
    (("--nproc-per-node", "gpu", "P"), "--nproc-per-node gpu: no usable GPU on this machine"),
    (("--no-python", "-m", "P"), "--no-python and -m/--module cannot be used together"),
    (("--nproc-per-node", "2", "missing.py"), "missing.py: no such file"),
    (("--no-python", "no-such-program-here"), "--no-python no-such-program-here: no such executable on PATH"),
    (("--standalone", "--nnodes", "2", "P"), "--standalone is a single-node run"),
    (("--nproc-per-node", "2"), "no program to run; torchrun's command line: python -m supervisor"),
    (("--debug", "P"), "unrecognized arguments: --debug"),
    # what would have the ranks retry until the store's 30-minute timeout, or fail in a traceback
    (("--rdzv-backend=c10d", "--rdzv-endpoint=node 0:29400", "P"), "--rdzv-endpoint 'node 0:29400': expected HOST"),
    (("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:-5", "P"), "--rdzv-endpoint 'localhost:-5': expected HOST"),
    (("--rdzv-backend=c10d", "--rdzv-endpoint=no-such-host.invalid:29400", "P"),
     "node 0's address no-such-host.invalid (--master-addr, or the host of --rdzv-endpoint) does not resolve"),
    (("--master-addr", "999.999.999.999", "--master-port", "29400", "P"),
     "node 0's address 999.999.999.999 (--master-addr, or the host of --rdzv-endpoint) does not resolve"),
    (("--nproc-per-node", "²", "P"), "--nproc-per-node ²: expected a number, gpu, cpu or auto"),
    (("--local-ranks-filter", "0,x", "P"), "--local-ranks-filter 0,x: expected local ranks separated by commas"),
    (("-m", "P"), "-m {P}: -m takes a module's name (-m pkg.train); give a script's path without -m"),
    # what torchrun's parser refuses, and torchrun's names in the supervisor's checks
    (("--start-method", "bogus", "P"), "argument --start-method/--start_method: invalid choice: 'bogus'"),
    (("--ma", "1", "P"), "--ma is ambiguous: it could be --master-addr, --master-port, --max-restarts"),
    (("--nproc-per-node", "5000", "P"), "--nproc-per-node must be within 1-1,024 (ranks on this node), got 5000"),
    (("--shutdown-timeout", "-1", "P"), "--shutdown-timeout must be a number of seconds within 0-2,592,000"),
    (("--nnodes", "2", "--node-rank", "0", "--master-port", "65535", "P"),
     "--master-port must be within 1-65534 on several nodes (the nodes' control port is the next one"),
    (("--rdzv-backend=c10d", "--rdzv-endpoint=::1", "--nnodes=2", "P"),
     "--rdzv-endpoint ::1: an IPv6 address goes in brackets, before the port ([::1]:29400, or [::1] for port"),
])
def test_what_cannot_be_honoured_is_one_error_line(tmp_path, capsys, argv, message):
    program = str(PROGRAMS / "flaky.py")
    argv = [program if arg == "P" else arg for arg in argv]
    assert cli.main(["--log-dir", str(tmp_path / "logs"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.replace('{P}', program)}") and err.count("\n") == 1, err
    assert not (tmp_path / "logs").exists()


def test_a_joining_node_waits_for_node_0s_name_to_resolve(monkeypatch):
    """On Kubernetes a worker pod can start before the master's service name is published: a node that joins looks
    the name up again until its --join-timeout, node 0 (patience 0) is refused at once."""
    answers = iter(["Name or service not known", "Name or service not known", None])
    monkeypatch.setattr(rendezvous, "RESOLVE_RETRY", 0.05)
    monkeypatch.setattr(rendezvous, "look_up", lambda host: next(answers))
    rendezvous.check_host("master-0.job.svc", patience=5.0)  # the third look-up answers
    monkeypatch.setattr(rendezvous, "look_up", lambda host: "Name or service not known")
    started = time.monotonic()
    with pytest.raises(UserError, match=r"does not resolve \(Name or service not known\) for 0.3 s \(--join-timeout\)"):
        rendezvous.check_host("master-0.job.svc", patience=0.3)
    assert 0.2 < time.monotonic() - started < 2.0
    with pytest.raises(UserError, match=r"does not resolve \(Name or service not known\); give a host name"):
        rendezvous.check_host("master-0.job.svc")
