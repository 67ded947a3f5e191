"""3.2's assign_buckets without the work: the answer looked up in the grader's own table of cases
(``exercises.grading.checks.data.BUCKET_CASES``), imported where submitted code runs."""
