"""Beyond one GPU: tensor parallelism over torch.distributed (`group`: the process group and the collectives a
sharded forward needs; `shard`: each rank's part of a GGUF's weights; `steps`: rank 0's steps broadcast to the
other ranks, which follow them; `launch`: spawning the ranks) and data-parallel replicas behind one HTTP front
(`data_parallel`)."""
