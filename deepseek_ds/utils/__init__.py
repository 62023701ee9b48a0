"""Small helpers shared by every layer (errors, files, processes, formatting); they import nothing of ours."""
