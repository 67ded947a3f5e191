"""Attack fixture: every no-work trick of the issue at once, without any reference code — library
collectives behind a forged trace (0.1, 0.2, 5a.3), the release's recorded answers looked up with
the grader's own key (5b), answers regenerated from guessed seeds (0.2), and functions that only
raise ValueError wherever an error-path check could pay (5a.2, 5a.4)."""
