"""Memory and step-time estimates per rank and layout (`deepseek-ds plan`): model states laid out as DeepSpeed lays
them out (params, states), activations, buffers (estimate), step time and the layout search (steptime), tables and
JSON (report), the sub-command and the verdict validate / train print (cli)."""
