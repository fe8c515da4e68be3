"""TRL's side of job L: GRPOTrainer on the job's prompts with the job's verifier, run by learn_peers.py
as a child process with the peers' packages:

    python3 bench/gpu/learn_trl.py WORK/trl_settings.json

The settings file (learn_commands.trl_settings) holds the model, the prompts, the verifier file, the
work folder and GRPOConfig's arguments, so that the results show exactly what TRL ran. One line per
optimizer step goes to WORK/steps.jsonl (learn_peers.py times the steps by them).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys


def load_verifier(path: str):
    spec = importlib.util.spec_from_file_location("learn_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(settings_path: str) -> int:
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    settings = json.loads(pathlib.Path(settings_path).read_text())
    work = pathlib.Path(settings["work"])
    verifier = load_verifier(settings["verifier"])
    rows = load_dataset("json", data_files=settings["prompts"], split="train")
    rows = rows.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})

    def correct(completions, label, **kwargs):  # TRL names a reward by its function's name
        return verifier.trl_reward(completions, label)

    class StepLog(TrainerCallback):
        """One line per optimizer step with the step's logs."""

        def on_log(self, _args, state, control, logs=None, **kw):
            if "loss" not in (logs or {}):  # the end-of-training summary has train_loss instead
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            with (work / "steps.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")

    trainer = GRPOTrainer(model=settings["model"], reward_funcs=correct, args=GRPOConfig(**settings["grpo_config"]),
                          train_dataset=rows, callbacks=[StepLog()])
    trainer.train()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: learn_trl.py WORK/trl_settings.json (written by learn_peers.py)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
