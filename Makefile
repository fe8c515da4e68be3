# The two commands of the README. Each sets up .venv idempotently first (scripts/setup.sh).
.PHONY: quickstart demo test test-all setup

setup:
	bash scripts/setup.sh

quickstart: setup
	.venv/bin/python -m services.cli quickstart

demo: quickstart

test: setup
	bash scripts/test.sh

# The suite and the learning-quality runs marked `slow` (several minutes more).
test-all: setup
	RLMESH_TEST_SLOW=1 bash scripts/test.sh
