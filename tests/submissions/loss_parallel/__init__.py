"""4.3 without the work: ``loss_parallel()`` and ``F.cross_entropy`` on a vocabulary-sharded DTensor."""
