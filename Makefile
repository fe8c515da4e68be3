# The two commands of the README. Each sets up .venv idempotently first (scripts/setup.sh).
.PHONY: quickstart quickstart-real demo test test-all setup

setup:
	bash scripts/setup.sh

quickstart: setup
	.venv/bin/python -m services.cli quickstart

# A real pretrained model (SmolLM2-135M-Instruct, fetched once) learns arithmetic by GRPO: ~12 min on 2 cores.
quickstart-real: setup
	.venv/bin/python -m services.cli quickstart --real

demo: quickstart

test: setup
	bash scripts/test.sh

# The suite and the learning-quality runs marked `slow` (several minutes more).
test-all: setup
	RLMESH_TEST_SLOW=1 bash scripts/test.sh
