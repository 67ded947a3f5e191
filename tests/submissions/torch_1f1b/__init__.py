"""4.4 without the work: the 1F1B order read off ``torch.distributed.pipelining``'s own
Schedule1F1B (its pipeline-order table), renumbered into the course's Action."""
