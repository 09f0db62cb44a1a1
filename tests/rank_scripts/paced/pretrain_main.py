"""The project's pretrain_main.py with every rank's step padded by the same sleep (``PACED_STEP_S`` seconds).

For the straggler detector's normal run: two ranks that do the same work must not be named, however loaded the
machine is. On a busy machine a CPU rank's compute (about 10 ms a step here) is stretched by whatever shares its
core, one rank more than the other, which is a real straggler; padded with an equal sleep at the start of each step
(inside the time the detector compares, where `debug.inject_fault=slow` sleeps on one rank), each rank's own
busy time is mostly time that load cannot stretch, as a GPU's step is. The name is the trainer entry's, so that the
supervisor treats it as the trainer (``--run-config``, the checks before the start).
"""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)  # as pretrain_main.py does, before torch is imported

if __name__ == "__main__":
    import os
    import runpy
    import sys
    import time
    from pathlib import Path

    from trainer.diagnosis.faults import FaultInjector

    PACE = float(os.environ["PACED_STEP_S"])
    before_step = FaultInjector.before_step

    def paced(self: FaultInjector, step: int, data_step: int | None = None) -> None:
        time.sleep(PACE)
        before_step(self, step, data_step)

    FaultInjector.before_step = paced  # type: ignore[method-assign]
    main = str(Path(__file__).resolve().parents[3] / "pretrain_main.py")
    sys.argv[0] = main
    runpy.run_path(main, run_name="__main__")
