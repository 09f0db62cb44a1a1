"""The GPUs: which exist and which a run gets, what NVML says of their health, and a restart without a faulty one.

* `discovery` — which GPUs exist (NVML → nvidia-smi → none; the ``SUPERVISOR_FAKE_GPUS`` test seam), which are usable,
  which ones a run gets (``--gpus IDS|auto``);
* `preflight` — before a run (and again after a failure): busy GPUs (refused or skipped), lost GPUs, ECC errors,
  pending page retirements, throttling (NVML; the ``SUPERVISOR_FAKE_GPU_STATE`` test seam);
* `exclusion` — after a GPU fault: the restart's layout without that GPU (the same global batch by a raised
  accumulation), the ``--min-gpus`` floor, ``exclusions.json``; the records of a run that ended on a GPU fault
  (``gpu_fault.json``) or a lost node (``node_lost.json``).

Imports `trainer`'s torch-free parts and `console` only.
"""
