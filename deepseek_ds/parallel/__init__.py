"""The parallel layout (degrees.py: the degrees and the Layout type; layout.py: process groups, each rank's place),
sequence parallelism, expert LoRA and pipeline schedules."""
