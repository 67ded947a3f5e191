"""5c.1 without the work: the groups read off the course's own RankGrid (which lists Megatron's
order tp-cp-dp-pp), for any order that is Megatron's."""
