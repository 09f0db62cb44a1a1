"""The values every numeric key of the run's configuration accepts (`BOUNDS`, one line a key beside the dataclasses'
fields), and the names that may not be empty; `check_bounds` applies both. Cross-key rules stay in
`trainer.config.validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.config.json_text import shown
from trainer.errors import UserError

if TYPE_CHECKING:  # the type alone: trainer.config imports this module
    from trainer.config import Config


@dataclass(frozen=True)
class Bound:
    """The values one numeric key accepts: `low` and `high` inclusive unless open (None: no limit on that side);
    a float must be finite as well. The caps keep a value inside what the libraries it reaches take (an int64, a
    `timedelta`, `time.sleep`), so an absurd value is one line here rather than a traceback minutes later."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def refusal(self, value: float) -> str | None:
        """What `value` breaks, as the error message says it ('must be positive', 'must be within [0, 1)'), or
        None when it is admitted. Only the side it breaks is named: a cap of two billion says nothing to a user
        who typed -1."""
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if not (too_low or too_high):
            return None
        if isinstance(value, float) and self.low is not None and self.high is not None:
            return (f"must be within {'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if too_high:
            return f"must be {'below' if self.high_open else 'at most'} {number(self.high)}"
        if self.low == 0 and self.low_open or (isinstance(value, int) and self.low == 1 and not self.low_open):
            return "must be positive"
        if self.low == 0:
            return "must be 0 or more"
        return f"must be {'above' if self.low_open else 'at least'} {number(self.low)}"


def number(value: float) -> str:
    """31,536,000 rather than 3.1536e+07; 0.5 as it is."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"




COUNT_MAX = 2**31 - 1  # steps, sizes, intervals: an int32, far beyond any run, inside every index type torch uses
POSITIVE, NON_NEGATIVE = Bound(1, COUNT_MAX), Bound(0, COUNT_MAX)
POSITIVE_FLOAT, FRACTION = Bound(0, low_open=True), Bound(0, 1)
# Every int and float key, beside the dataclasses so that a new key gets its line here (tests/test_config.py checks
# none is missing). Cross-key rules (context within positions, heads dividing the width) stay in `validate`.
BOUNDS: dict[str, Bound] = {
    "system.device_id": Bound(0, 4095),
    "system.seed": Bound(0, 2**64 - 1),  # torch.manual_seed's range
    "system.dist_timeout_s": Bound(0, 365 * 86400, low_open=True),
    "model.hidden_size": POSITIVE,
    "model.num_layers": POSITIVE,
    "model.num_heads": POSITIVE,
    "model.num_kv_heads": POSITIVE,
    "model.ffn_hidden_size": POSITIVE,
    "model.max_position_embeddings": POSITIVE,
    "model.vocab_size": POSITIVE,
    "model.init_std": Bound(0, 10, low_open=True),
    "model.rope_theta": POSITIVE_FLOAT,
    "data.vocab_size": Bound(256 + 1, 2**32),  # the 256 bytes and a merge at least; ids are stored as uint32 at most
    "data.context_length": POSITIVE,
    "data.max_samples": Bound(1, 2**53),  # '5.5b' goes through a float: exact up to 2**53
    "data.val_fraction": Bound(0, 1, high_open=True),
    "training.max_steps": POSITIVE,
    "training.batch_size": POSITIVE,
    "training.grad_accum_nums": POSITIVE,
    "training.num_workers": Bound(0, 1024),
    "training.learning_rate": POSITIVE_FLOAT,
    "training.min_lr_ratio": FRACTION,
    "training.warmup_steps": NON_NEGATIVE,
    "training.weight_decay": Bound(0),
    "training.beta1": Bound(0, 1, high_open=True),  # torch.optim.AdamW's range
    "training.beta2": Bound(0, 1, high_open=True),
    "training.max_grad_norm": POSITIVE_FLOAT,
    "training.eval_interval": NON_NEGATIVE,
    "training.eval_steps": POSITIVE,
    "training.spike_threshold": Bound(0),  # 0: no detector
    "training.spike_window": Bound(2, 100_000),  # a standard deviation needs two losses; a window is kept per step
    "training.spike_skip": POSITIVE,
    "training.replay_step": NON_NEGATIVE,
    "checkpoint.interval": NON_NEGATIVE,
    "checkpoint.keep": POSITIVE,
    "checkpoint.memory_interval": NON_NEGATIVE,  # or "auto" (trainer.config.normalise_switches)
    "logging.log_interval": POSITIVE,
    "debug.max_nonfinite_steps": POSITIVE,
    "debug.inject_nan_step": NON_NEGATIVE,
    "debug.inject_nan_rank": NON_NEGATIVE,
    "debug.inject_fault_step": NON_NEGATIVE,
    "debug.inject_fault_rank": NON_NEGATIVE,
    "debug.inject_fault_restart": NON_NEGATIVE,  # 0: the first group
    "debug.inject_fault_code": Bound(0, 255),  # an exit status
    "debug.inject_fault_delay_s": Bound(0, 86400, low_open=True),
    "debug.inject_write_stall_step": NON_NEGATIVE,
    "debug.inject_spike_step": NON_NEGATIVE,
    "debug.inject_spike_scale": Bound(0, 1e6, low_open=True),
}
# Folders, files and names where an empty string would quietly mean the working folder or nothing at all.
NON_EMPTY = ("data.source", "data.cache_dir", "data.tokenizer", "data.text_field", "data.split", "checkpoint.dir",
             "checkpoint.resume", "model.name_or_path", "logging.run_dir", "logging.wandb_project")


def value_of(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def check_bounds(cfg: Config) -> None:
    """Every numeric key within its `BOUNDS` (finite, for a float); no folder, file or name left empty."""
    for dotted, bound in BOUNDS.items():
        value = value_of(cfg, dotted)
        if isinstance(value, (int, float)) and (refusal := bound.refusal(value)):  # (a word, "auto": its own check)
            raise UserError(f"{dotted} {refusal}, got {shown(value) if isinstance(value, int) else f'{value:g}'}")
    for dotted in NON_EMPTY:
        value = value_of(cfg, dotted)
        if value is not None and not value.strip():
            raise UserError(f"{dotted} is empty; give a value (an empty one would quietly mean the working folder "
                            f"or nothing)")
