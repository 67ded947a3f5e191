"""5c.2 from given code: the composed run's own flat average of the dense gradients over dp_cp
(``reference.compose.train._average_flat``), lecture 4a's sequence-parallel sum and lecture 5b's
expert sync, called in the order the given ZeRO step calls them."""
