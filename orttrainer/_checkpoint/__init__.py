"""The parts behind `orttrainer.checkpoint` (the public module re-exports what callers use):

- `errors`: the error type every part raises;
- `trainer_files`: the file side of ORTTrainer.save_checkpoint / load_checkpoint;
- `aggregation`: aggregate_checkpoints, merging per-rank HDF5 files;
- `experimental`: the deprecated experimental_* API on torch.save files.
"""
