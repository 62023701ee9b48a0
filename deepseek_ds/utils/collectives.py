"""The collective kinds whose bytes `bench comm` counts and `plan` predicts, named and ordered once for both."""

# What training sends: plan/comm.py predicts each of these per rank and step.
PLANNED_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv", "broadcast")
# Everything the counter can see (bench/comm_counter.py); training makes none of the last three.
KINDS = (*PLANNED_KINDS, "reduce", "gather", "scatter")
