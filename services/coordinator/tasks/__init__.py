"""Built-in tasks: problems with a known answer, generated locally from a seed, in OpenRLHF's
prompt/label JSONL layout, with a training and a held-out split that never share a problem
(`rlmesh make-task NAME`). Each task names the reward rule that grades it."""
