"""python -m services.reward: serve rewards (RewardService) and/or reference log-probs (ReferenceService).

    python -m services.reward --reward_pretrain DIR
    python -m services.reward --remote_rm_url http://host:5000/get_reward,http://host2:5000/get_reward
    python -m services.reward --remote_rm_url my_reward.py
    python -m services.reward --reward_func math --ref_pretrain DIR
"""

from services.common.config import parse_config
from services.common.server import exit_now, run_service
from services.common.user_errors import run_command
from services.reward.config import RewardConfig
from services.reward.server import add_reference_service, add_reward_service, make_reward_source


def main(argv=None) -> int:
    config = parse_config(RewardConfig, argv, description=__doc__)
    if config.dry_run:  # checked and planned, nothing started
        from services.reward.dry_run import print_plan

        return print_plan(config)
    # Models load before serving starts, so health reports SERVING only once they are usable. A
    # ConfigError (a reward file that does not import, ...) reaches run_command: no traceback.
    source = make_reward_source(config)
    reference = None
    if config.ref_pretrain:
        from services.reward.reference import ReferenceModel  # transformers: only when a model is served

        reference = ReferenceModel(config.ref_pretrain, config.device, config.ref_dtype,
                                   config.ref_micro_batch_size, config.attn_implementation)

    async def build(runner) -> None:
        if source is not None:
            await add_reward_service(runner, source, config.reward_clip_range, config.recent_answers)
        if reference is not None:
            add_reference_service(runner, reference)

    run_service("reward", config, build)
    return 0


if __name__ == "__main__":
    exit_now(run_command(main))
