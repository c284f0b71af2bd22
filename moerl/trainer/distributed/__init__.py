"""The distributed trainer: the policy trained by a group of torch.distributed ranks, FSDP2 data-parallel
sharding x expert parallelism (see README.md)."""
