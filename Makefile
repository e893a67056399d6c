# Every target installs what it needs into .venv from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test lint typecheck pytest demo proto bench soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: lint typecheck pytest

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m sidecar.demo

# Regenerate the protobuf code from sidecar/proto/*.proto (tests/test_proto.py checks it is current).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. sidecar/proto/*.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
