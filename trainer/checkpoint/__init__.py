"""Checkpoints: what a save writes and a resume reads (`store`: the full state or DCP's shards, `final/`, imports
torch), and their names on disk, damage found from the files alone (each file's size and checksum, recorded in
meta.json by the rank that wrote it), and which one `--resume` means (`layout`: torch-free, so the supervisor refuses
a bad `--resume` before any rank starts). Both publish through
`trainer.durable` (temporary name → fsync → rename). `manager` is the loop's one interface to them (resume, save at a
step, the final model); `background` writes a save on a thread of its own from host memory staged by DCP's stager;
`memory` keeps the latest state in the node's shared memory (a snapshot every few steps), which a restart on the
node loads before any checkpoint on disk; `claim` keeps a checkpoint folder one run's at a time (torch-free, like
`layout`).

Imports `trainer.config`, `trainer.model` and the leaves; this file imports nothing, so `layout` stays torch-free.
"""
