"""The command line of one training rank (`pretrain_main.py`): which config, which mode, which exit code.

Three ways to start a rank:
  * by the supervisor: `--run-config logs/<run-id>/config.json`, the resolved config taken as is (never re-resolved);
    the run folder is that file's folder;
  * by hand: `--debug`, `--preset`, `--config`, `--set` ... resolved here; a single-process run whose run folder is
    logs/<run-id>/ (or logging.run_dir);
  * under plain `torchrun`: the same flags on every rank, which then find each other through torchrun's environment.
`--dry-run` resolves everything and prints sizes and a memory estimate without training or allocating weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainer.checkpoint.claim import FolderClaim
from trainer.checkpoint.layout import check_checkpoint_dir, check_resume, earlier_run, find_resume
from trainer.config import RUNS_DIR, Config
from trainer.config.resolve import FLAG_KEYS, add_config_arguments, handle_inspection_flags, print_presets_table
from trainer.data import TOKEN_CACHE_ENV
from trainer.diagnosis.oom_report import OOM_EXIT_CODE
from trainer.durable import check_writable
from trainer.errors import USER_ERROR_EXIT_CODE, CollectiveUserError, UserError
from trainer.preflight import cpu_refusal, dry_run
from trainer.torch_release import check_torch_release

FAILURE_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_main.py",
        description="One training rank. Started by the supervisor (--run-config), by hand (a single process), "
                    "or under torchrun (one process per GPU).")
    add_config_arguments(parser)
    parser.add_argument("--run-config", metavar="FILE",
                        help="the resolved config the supervisor wrote (logs/<run-id>/config.json), used as is")
    parser.add_argument("--dry-run", action="store_true",
                        help="print parameters, tokens per step, FLOPs per token and a per-GPU memory estimate "
                             "(DDP and FSDP), then exit; nothing is allocated")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="the ranks --dry-run assumes without WORLD_SIZE (default: the GPUs visible, else 1)")
    return parser


def resolving_flags(args: argparse.Namespace) -> list[str]:
    """The flags that would change a resolved config (not allowed beside --run-config)."""
    used = [f"--{attr.replace('_', '-')}" for attr in FLAG_KEYS if getattr(args, attr) is not None]
    used += ["--preset"] * bool(args.preset) + ["--debug"] * args.debug
    used += ["--config"] * bool(args.config) + ["--set"] * bool(args.set)
    return used


def load_config(args: argparse.Namespace) -> tuple[Config | None, Path | None]:
    """(config, run folder): the folder is known only for --run-config; None config = an inspection flag ran."""
    if args.run_config is None:
        return handle_inspection_flags(args), None
    flags = resolving_flags(args)
    if flags:
        raise UserError(f"--run-config takes a resolved config as is; drop {', '.join(dict.fromkeys(flags))} "
                        f"(or resolve a new config without --run-config)")
    cfg = Config.load(args.run_config)
    if args.list_presets:
        print_presets_table()
        return None, None
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return None, None
    return cfg, Path(args.run_config).resolve().parent


def ranks_here(assumed: int | None = None) -> tuple[int, int]:
    """(the run's ranks, those on this machine): torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE, else `assumed` (what a
    dry run is told to size) on this machine, else this process alone."""
    world = int(os.environ.get("WORLD_SIZE") or assumed or 1)
    return world, int(os.environ.get("LOCAL_WORLD_SIZE") or world)


def check_fits_on_cpu(cfg: Config) -> None:
    """By hand or under torchrun, CPU ranks (`system.device=cpu`, or `auto` without a GPU) are refused here as the
    supervisor refuses them: a config meant for GPUs, or one well beyond the host's memory, before its data is
    tokenized or its weights fill the host's memory. Only a config refused on CPUs pays for importing torch to ask
    whether a GPU is visible."""
    if cfg.system.device == "cuda" or (refusal := cpu_refusal(cfg, *ranks_here())) is None:
        return
    if cfg.system.device == "auto":
        import torch

        if torch.cuda.is_available():
            return
    raise UserError(refusal)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, run_dir = load_config(args)
        if cfg is None:
            return 0
        check_torch_release()
        if args.dry_run:  # sized for the device the rank would take (trainer.model.distributed.select_device)
            from trainer.model.estimate import DetectedGpus, torch_gpus

            gpus = DetectedGpus() if cfg.system.device == "cpu" else torch_gpus()
            print(dry_run(cfg, gpus, *ranks_here(args.nproc or gpus.count)), flush=True)
            return 0
        # under the supervisor, the token cache it found for this config (trainer.data.TOKEN_CACHE_ENV)
        cache = Path(os.environ[TOKEN_CACHE_ENV]) if run_dir is not None and TOKEN_CACHE_ENV in os.environ else None
        claim: FolderClaim | None = None
        if run_dir is None:
            # By hand or under torchrun, what the supervisor checks before starting ranks: a config meant for GPUs,
            # the folders the run writes, the data and the checkpoint to resume, before the seconds that importing
            # torch takes, so that a wrong data.source or a checkpoint of another model is one line at once (the
            # cache is built here, once, under its lock, and handed to the trainer). Under the supervisor the
            # trainer finds it ready, and the supervisor checked the rest.
            from trainer.data.cache import prepare

            check_fits_on_cpu(cfg)
            check_checkpoint_dir(cfg)
            find_resume(cfg)  # a damaged or missing checkpoint: refused before the data is tokenized
            earlier_run(cfg)
            check_writable(Path(cfg.logging.run_dir) if cfg.logging.run_dir else RUNS_DIR, "the run folder",
                            "set logging.run_dir to a writable folder")
            info = prepare(cfg, show_progress=None if os.environ.get("RANK", "0") == "0" else False)
            check_resume(cfg, info.key, info.vocab_size)
            cache = info.path
            if os.environ.get("RANK", "0") == "0":  # checkpoint.dir, this run's alone (the supervisor claims it there)
                claim = FolderClaim.take(Path(cfg.checkpoint.dir), None)
        from trainer.diagnosis.nan_guard import NonFiniteError
        from trainer.diagnosis.nan_verdict import SuspectDevice
        from trainer.loop import OutOfMemory, train

        try:
            return train(cfg, run_dir, cache=cache)
        except NonFiniteError as e:  # the guard already printed its report and wrote its dumps
            print(f"ERROR | training stopped: {e}", flush=True)
            return FAILURE_EXIT_CODE
        except SuspectDevice as e:  # on stderr: the supervisor's evidence of a GPU fault (supervisor.diagnosis)
            print(f"ERROR | training stopped: {e}", file=sys.stderr, flush=True)
            return FAILURE_EXIT_CODE
        except OutOfMemory as e:  # one line here; the traceback is in the report file
            print(f"error: {e}", file=sys.stderr, flush=True)
            return OOM_EXIT_CODE
        finally:
            if claim is not None:
                claim.release()
    except UserError as e:
        if not isinstance(e, CollectiveUserError) or os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
