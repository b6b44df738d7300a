# The README's two commands: `make demo` (kproxy on the embedded lab) and `make test` (everything CI runs).
# Both begin with `setup`, which is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
KPROXY := $(VENV)/bin/kproxy
MODE   ?= iptables

.PHONY: setup test lint unit integration conformance demo bench clean-lab image soak

setup:
	@bash scripts/setup.sh

lint: setup
	$(VENV)/bin/ruff check kproxy backends tests
	$(VENV)/bin/ruff format --check kproxy backends tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The image is built before the tests (tests/integration/test_image.py runs it; a no-op when it is up to date).
test: lint image
	$(PY) -m pytest

# deploy/Dockerfile as localhost/kproxy:<version>, with buildah on an mmdebstrap base (scripts/image.sh)
image: setup
	@bash scripts/image.sh >/dev/null

unit: setup
	$(PY) -m pytest tests/unit

integration: setup
	$(PY) -m pytest tests/integration

conformance: setup
	$(KPROXY) conformance --mode $(MODE)

demo: setup
	$(KPROXY) demo --mode $(MODE)

bench: setup
	$(KPROXY) bench sync --mode $(MODE) --services 10000 --endpoints 10 --repeat 5 --format json

# kproxy soak: 10 minutes of churn under faults on every available mode (make test runs a short one)
soak: setup
	@mkdir -p reports
	$(KPROXY) soak --mode all --minutes 10 --json reports/soak.json

clean-lab: setup
	$(KPROXY) lab down
