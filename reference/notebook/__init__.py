"""What only the notebooks use: :mod:`.course` (quizzes, ``needs``), :mod:`.recorded` (demos recorded
for the student release, replayed until the learner's own run), :mod:`.plots` (static figures),
:mod:`.primer` (lecture 0's first runs).  Nothing below it in ``reference`` imports it back."""
