# The two commands of the README. Each sets up .venv idempotently first (scripts/setup.sh).
.PHONY: quickstart demo test setup

setup:
	bash scripts/setup.sh

quickstart: setup
	.venv/bin/python -m services.cli quickstart

demo: quickstart

test: setup
	bash scripts/test.sh
