"""5c.3 from given code: the bytes read off the course's planner — the tiny GPT described by
``reference.planner.tiny_gpt`` on the check's grid, ``plan(...).comm_bytes`` per axis (the planner's
dp axis is dp·cp), the model's configuration read from the check module."""
