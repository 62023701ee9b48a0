"""The parallel layout (degrees, process groups, each rank's place) and sequence parallelism."""
