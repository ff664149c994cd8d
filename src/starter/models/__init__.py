"""What the engine asks of a task: when a step logs (logging_step.py), where a net's head is (head.py)."""
