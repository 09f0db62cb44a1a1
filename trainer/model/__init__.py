"""The model and what it costs: the transformers model built from the config (`build`), the training objective DDP
and FSDP2 wrap (`loss`), the optimizer and schedule (`optim`), process groups and the model's wrapping over them
(`distributed`), and sizes and per-GPU memory without
allocating anything (`estimate`: torch-free at import, so the supervisor uses it too); where the model comes from,
checked without torch (`source`: the rank and the supervisor say the same lines).

Imports `trainer.config` and the leaves (`errors`, `progress`), never the rank's run above it. This file imports
nothing: `estimate` must stay importable without torch.
"""
