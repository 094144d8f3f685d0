"""HDF5 checkpoints: one file per writing rank, a manifest committed last by the controller."""
