# Every target installs what it needs into .venv from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

TOOLS  := .venv-tools/.installed

# The real-kubelet fixture (tests/realkubelet): Go >= 1.26 and the two kubernetes releases it builds.
GO          ?= go
REALKUBELET := tests/realkubelet
KUBELET_NEW := v1.37.2
KUBELET_OLD := v1.36.5
# The kubelet's real plugin manager and DRA manager with DRA drivers on the plugin helper (tests/realdra).
REALDRA     := tests/realdra

# Helm, built by `make helm-binaries` for tests/test_manifests.py (the versions the README's lines are tested with).
HELM_BIN      := tests/helm/bin
HELM3_VERSION := v3.22.0
HELM4_VERSION := v4.3.2

# The suite's processes: its tests mostly wait (on sockets, children, the kubelet fixtures), so three
# share two cores well (BENCHMARKS.md, the test suite).
PYTEST_WORKERS ?= 3

.PHONY: help check test lint typecheck pytest demo proto bench soak clean lock manifests dashboard fuzz
.DEFAULT_GOAL := help

help: ## this list
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  %-20s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# checkov and kubernetes-validate live apart: their pins must not bend the project's.
$(TOOLS): requirements/tools.txt
	test -x .venv-tools/bin/python || $(PYTHON) -m venv .venv-tools
	.venv-tools/bin/python -m pip install --quiet --upgrade pip
	.venv-tools/bin/python -m pip install --quiet -r requirements/tools.txt
	touch $(TOOLS)

test: lint typecheck pytest ## lint, types and every test (builds the Go fixtures and Helm when Go is on PATH)

# The quick loop: lint, types, and the tests of the verdicts, settings, serving and simulator, none of
# which needs a Go build or an outside tool (the figure is in BENCHMARKS.md).
CHECK_TESTS := tests/test_layers.py tests/test_registration.py tests/test_health.py tests/test_dra.py \
	tests/test_config.py tests/test_hamiconfig.py tests/test_proto.py tests/test_dra_proto.py \
	tests/test_serving.py tests/test_sidecar_cli.py tests/test_simulator.py tests/test_doctor_dra.py \
	tests/test_hami.py
check: lint typecheck ## lint, types and the tests that need no Go build (under a minute)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(CHECK_TESTS)

lint: $(STAMP) ## ruff check and ruff format --check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP) ## mypy --strict over the packages, the post-renderer and the dashboard script
	$(PY) -m mypy
	$(PY) -m mypy --strict manifests/hami-patch/render.py manifests/monitoring/dashboard.py

# With Go on PATH, pytest first (re)builds the real-kubelet and DRA fixtures and Helm; without it their tests skip.
pytest: $(STAMP) $(TOOLS) $(if $(shell command -v $(GO) 2>/dev/null),kubelet-fixtures dra-fixtures helm-binaries)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The kubelet's real device manager, PodResources server and plugins (tests/realkubelet,
# docs/real-kubelet.md), at the newest served patch of each minor release (docs/kubelet-releases.md):
# go.mod pins the newest, releases/go.1.MINOR.mod each other; a release older than 1.NN builds with
# -tags kube_lt1NN (compat_*.go). make test (and .ci/run) builds and tests the newest and the newest
# without kubernetes PR 135437; kubelet-fixtures-all builds every release, which the tests then run with
# REALKUBELET_RELEASES=all (docs/real-kubelet.md). go build only relinks what changed.
KUBELET_RELEASES := v1.30.14 v1.31.12 v1.32.9 v1.33.13 v1.34.4 v1.35.4 v1.36.5 v1.37.2
kubelet_minor = $(word 2,$(subst ., ,$(1)))
kubelet_flags = -modfile=$(if $(filter $(KUBELET_NEW),$(1)),go.mod,releases/go.1.$(call kubelet_minor,$(1)).mod) -tags=$(subst \
  $(eval) ,$(comma),$(strip $(foreach t,31 34 35 37,$(if $(filter $(t),$(firstword $(sort $(t) $(call kubelet_minor,$(1))))),,kube_lt1$(t)))))
comma := ,
.PHONY: kubelet-fixtures kubelet-fixtures-all kubelet-fixture-new kubelet-fixture-old kubelet-fixtures-check \
	kubelet-fixtures-check-all FORCE
kubelet-fixtures: kubelet-fixture-new kubelet-fixture-old
kubelet-fixtures-all: $(KUBELET_RELEASES:%=$(REALKUBELET)/bin/realkubelet-%)
kubelet-fixture-new: $(REALKUBELET)/bin/realkubelet-$(KUBELET_NEW)
kubelet-fixture-old: $(REALKUBELET)/bin/realkubelet-$(KUBELET_OLD)
$(REALKUBELET)/bin/realkubelet-%: FORCE
	cd $(REALKUBELET) && $(GO) build -buildvcs=false $(call kubelet_flags,$*) -o bin/realkubelet-$* .

# The DRA fixture (tests/realdra, docs/real-kubelet.md#dra), at the same two releases.
.PHONY: dra-fixtures dra-fixture-new dra-fixture-old dra-fixtures-check
dra-fixtures: dra-fixture-new dra-fixture-old

dra-fixture-new:
	cd $(REALDRA) && $(GO) build -buildvcs=false -o bin/realdra-$(KUBELET_NEW) .

dra-fixture-old:
	cd $(REALDRA) && $(GO) build -buildvcs=false -modfile=go.old.mod -tags oldkubelet -o bin/realdra-$(KUBELET_OLD) .

dra-fixtures-check:
	cd $(REALDRA) && files="$$(gofmt -l .)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
	cd $(REALDRA) && $(GO) vet ./... && $(GO) vet -modfile=go.old.mod -tags oldkubelet ./...

# gofmt and go vet over the fixture's module, with the tested releases' modfiles and tags (-all: every
# release's; each vet compiles its release, about 5 minutes of CPU from empty caches).
KUBELET_VETTED ?= $(KUBELET_NEW) $(KUBELET_OLD)
kubelet-fixtures-check-all: KUBELET_VETTED = $(KUBELET_RELEASES)
kubelet-fixtures-check-all: kubelet-fixtures-check
kubelet-fixtures-check:
	cd $(REALKUBELET) && files="$$(gofmt -l .)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
	cd $(REALKUBELET) && $(foreach v,$(KUBELET_VETTED),$(GO) vet $(call kubelet_flags,$(v)) ./... &&) true
	cd tests/fixturekit && files="$$(gofmt -l .)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
	cd tests/fixturekit && $(GO) vet ./...
	cd tests/node && files="$$(gofmt -l pause)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
	cd tests/node && $(GO) vet ./pause

demo: $(STAMP) ## the sidecar against the embedded kubelet simulator (testing/)
	$(PY) -m testing.demo

# A real node in a box (tests/node, docs/testing.md#a-real-node): etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and the kubelet from k8s.io/kubernetes (tests/node/go.mod), Debian's containerd and runc,
# the project's images built by buildah, in namespaces of their own. The binaries are rebuilt when
# tests/node/go.mod changes; the kubelet's binary is named kubelet-e2e (no process named kubelet on the
# machine). NODE_E2E_KEEP=1 keeps the cluster up after the tests.
NODE_DIR     := tests/node
NODE_VERSION := $(KUBELET_NEW)
NODE_BINS    := $(addprefix $(NODE_DIR)/bin/,kubelet-e2e kube-apiserver kube-controller-manager kube-scheduler)
NODE_LDFLAGS := -s -w $(foreach p,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
	-X $(p).gitVersion=$(NODE_VERSION) -X $(p).gitMajor=1 -X $(p).gitMinor=37 -X $(p).gitTreeState=clean)
.PHONY: node-e2e node-bins node-images
node-e2e: $(STAMP) node-bins node-images ## a real node in a box: the kubelet, the control plane, containerd (root)
	$(NODE_DIR)/node.sh

node-bins: $(NODE_BINS) $(NODE_DIR)/bin/kube-state-metrics

$(NODE_DIR)/bin/kubelet-e2e: $(NODE_DIR)/go.mod $(NODE_DIR)/go.sum
	cd $(NODE_DIR) && $(GO) build -buildvcs=false -ldflags '$(NODE_LDFLAGS)' -o bin/kubelet-e2e k8s.io/kubernetes/cmd/kubelet

$(NODE_DIR)/bin/kube-%: $(NODE_DIR)/go.mod $(NODE_DIR)/go.sum
	cd $(NODE_DIR) && $(GO) build -buildvcs=false -ldflags '$(NODE_LDFLAGS)' -o bin/kube-$* k8s.io/kubernetes/cmd/kube-$*

# kube-state-metrics for tests/node/e2e_fleet.py, built from its Go module at the version
# tests/node/kube-state-metrics/go.mod requires (a `tool` line; `go install …@version` cannot be used: the
# module proxy refuses the module's version list, which go install reads for deprecations).
KSM_VERSION := $(shell awk '$$1 == "k8s.io/kube-state-metrics/v2" {print $$2}' $(NODE_DIR)/kube-state-metrics/go.mod)
$(NODE_DIR)/bin/kube-state-metrics: $(NODE_DIR)/kube-state-metrics/go.mod $(NODE_DIR)/kube-state-metrics/go.sum
	cd $(NODE_DIR)/kube-state-metrics && $(GO) build -buildvcs=false -o ../bin/kube-state-metrics \
		-ldflags '-s -w -X github.com/prometheus/common/version.Version=$(KSM_VERSION)' k8s.io/kube-state-metrics/v2

node-images:
	$(NODE_DIR)/images.sh

# A DRA driver's tour against the kubelet's own plugin manager and DRA manager (tests/realdra).
.PHONY: demo-dra
demo-dra: $(STAMP) dra-fixture-new ## a DRA driver's tour against the kubelet's own DRA manager
	DEMO_KUBELET=dra $(PY) -m testing.demo

# Figures for BENCHMARKS.md (each script prints medians and ratios from one run).
bench: $(STAMP) ## the benchmark scripts behind BENCHMARKS.md
	$(PY) bench/initcheck_startup.py
	$(PY) -m bench.healthz_load
	$(PY) -m bench.probe_cost
	$(PY) -m bench.fault_latency
	$(PY) -m bench.resources
	$(PY) bench/doctor_log.py
	$(PY) -m bench.checkpoint_parse
	$(PY) -m bench.sidecar_listen

soak: $(STAMP) ## random faults against the simulator, wrong verdicts counted
	$(PY) -m bench.soak

# Coverage-guided fuzzing (atheris): each fuzz/fuzz_<name>.py for FUZZ_SECONDS, seeded from fuzz/corpus/<name>/.
# Fails on an escaping exception or an input over 100 ms of CPU; the input goes to fuzz/crashes/.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP) ## coverage-guided fuzzing of every parser that reads the node
	$(PY) -m fuzz.run --seconds $(FUZZ_SECONDS)

# Slow real-kubelet checks: the kubelet's 5-minute stop grace against both releases and the simulator,
# the oracles' 200 random events with three seeds on each release (device plugins and DRA drivers), all
# four side by side (the DRA oracles' 18 minutes bound it); then the DRA fixture's scenarios and the
# demos' tours against the real device manager and DRA manager.
.PHONY: real-slow
real-slow: $(STAMP) kubelet-fixtures dra-fixtures ## the slow real-kubelet checks: stop grace, oracles, DRA scenarios
	$(MAKE) -j4 stop-grace device-oracle dra-oracle-new dra-oracle-old
	$(PY) -m pytest -q -m slow tests/test_realdra.py
	DEMO_KUBELET=real DEMO_TOUR_ONLY=1 $(PY) -m testing.demo > /dev/null
	DEMO_KUBELET=dra DEMO_TOUR_ONLY=1 $(PY) -m testing.demo > /dev/null

# Side by side in real-slow (they mostly wait on the kubelets): the 5-minute stop grace, and the
# device-plugin oracle's 200 events x 3 seeds on both releases.
.PHONY: stop-grace device-oracle
stop-grace: $(STAMP) kubelet-fixtures
	$(PY) -m pytest -q -m slow tests/e2e/test_stop_grace.py

device-oracle: $(STAMP) kubelet-fixtures
	ORACLE_EVENTS=200 ORACLE_SEEDS=1,2,3 $(PY) -m pytest -q -s tests/e2e/test_oracle.py

# The node's ResourceSlices as DRA evidence against a real API server (tests/e2e/test_dra_slices.py):
# kube-apiserver from make node-bins and Debian's etcd-server; .ci/run runs it after node-bins.
.PHONY: dra-slices
dra-slices: $(STAMP) dra-fixture-new $(NODE_DIR)/bin/kube-apiserver
	$(PY) -m pytest -q -m slow tests/e2e/test_dra_slices.py

# HAMi's own registration against a real API server (tests/e2e/test_hami_registration.py): HAMi-shaped
# writers of the Node's annotations (tests/hamifixture.py), kube-apiserver from make node-bins, Debian's etcd.
.PHONY: hami-registration
hami-registration: $(STAMP) $(NODE_DIR)/bin/kube-apiserver ## HAMi's registration against a real API server
	$(PY) -m pytest -q -m slow tests/e2e/test_hami_registration.py

# The DRA oracle (tests/e2e/test_dra_oracle.py), one release per job: 200 events x 3 seeds, about 18 minutes.
.PHONY: dra-oracle-new dra-oracle-old
dra-oracle-new dra-oracle-old: dra-oracle-%: $(STAMP) dra-fixtures
	ORACLE_EVENTS=200 ORACLE_SEEDS=1,2,3 $(PY) -m pytest -q -s -m slow tests/e2e/test_dra_oracle.py -k '$*'

# The serving-limits floods on loopback (about 75 s): /healthz p99 during each, peak RSS, fds, exit on
# SIGTERM (BENCHMARKS.md#stress). STRESS_CPU_LIMIT=0.2 adds the manifests' CPU limit where cgroups allow.
.PHONY: stress
stress: $(STAMP) ## the serving limits' floods on loopback
	$(PY) -m bench.stress

# Everything that runs aiohttp's server (sidecar/server/serving.py, sidecar/server/views.py), against the oldest and
# the newest aiohttp pyproject.toml allows, each in a venv of its own. serving.py depends on documented
# aiohttp API only and refuses to start on a version that does not take its limits.
AIOHTTP_TESTS := tests/test_serving.py tests/test_sidecar_cli.py tests/e2e/test_sidecar.py
.PHONY: test-aiohttp-range
test-aiohttp-range: ## the HTTP tests on the oldest and newest aiohttp allowed
	@range=$$($(PYTHON) -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if d.startswith("aiohttp"))[len("aiohttp"):])') && \
	oldest=$$(echo "$$range" | sed -n 's/.*>=\([0-9.]*\).*/\1/p') && test -n "$$oldest" && \
	for which in oldest newest; do \
	  venv=.venv-aiohttp-$$which; \
	  if [ $$which = oldest ]; then want="aiohttp==$$oldest"; else want="aiohttp$$range"; fi; \
	  test -x $$venv/bin/python || $(PYTHON) -m venv $$venv || exit 1; \
	  $$venv/bin/python -m pip install --quiet --upgrade pip || exit 1; \
	  $$venv/bin/python -m pip install --quiet --upgrade -e '.[dev]' "$$want" || exit 1; \
	  echo "== aiohttp $$($$venv/bin/python -c 'import aiohttp; print(aiohttp.__version__)') ($$which allowed: $$want)"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) $(AIOHTTP_TESTS) || exit 1; \
	done

# Regenerate the protobuf code from sidecar/proto/*.proto (tests/test_proto.py checks it is current).
proto: $(STAMP) ## regenerate the protobuf code
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. sidecar/proto/*.proto

# Regenerate manifests/example-hami/hami.yaml: the chart fixture as the README's kustomize route renders
# HAMi's chart (tests/test_manifests.py checks it is current).
manifests: helm-binaries ## regenerate manifests/example-hami/hami.yaml
	$(HELM_BIN)/helm-$(HELM3_VERSION) template hami tests/fixtures/hami-chart --namespace kube-system \
		--kube-version 1.33.0 > manifests/example-hami/hami.yaml

# Helm 3 and Helm 4, built from their Go modules at pinned versions (tests/test_manifests.py installs
# with both). Kept in tests/helm/bin like the kubelet fixtures: a second run finds them and does nothing.
.PHONY: helm-binaries
helm-binaries: $(HELM_BIN)/helm-$(HELM3_VERSION) $(HELM_BIN)/helm-$(HELM4_VERSION)

$(HELM_BIN)/helm-%:
	mkdir -p $(HELM_BIN)/.gobin-$*
	GOBIN=$(CURDIR)/$(HELM_BIN)/.gobin-$* $(GO) install helm.sh/helm/$(firstword $(subst ., ,$*))/cmd/helm@$*
	mv $(HELM_BIN)/.gobin-$*/helm $@ && rmdir $(HELM_BIN)/.gobin-$*

# Regenerate the Grafana dashboard (manifests/monitoring/dashboard.json) with grafana-foundation-sdk, a dev
# dependency (tests/test_monitoring.py checks the committed JSON is current).
dashboard: $(STAMP) ## regenerate the Grafana dashboard
	$(PY) -m manifests.monitoring.dashboard

# Re-pin the images' dependencies (requirements/*.txt) from a clean install of the project.
lock: ## re-pin the images' dependencies
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install --quiet .
	{ head -2 requirements/sidecar.txt; .venv-lock/bin/pip freeze --exclude hami-guard; } > requirements/sidecar.txt.new
	mv requirements/sidecar.txt.new requirements/sidecar.txt
	{ head -1 requirements/init.txt; grep '^psutil==' requirements/sidecar.txt; } > requirements/init.txt.new
	mv requirements/init.txt.new requirements/init.txt
	rm -rf .venv-lock

clean: ## remove the venvs, caches and built fixtures
	rm -rf $(VENV) .venv-tools .venv-aiohttp-oldest .venv-aiohttp-newest build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(REALKUBELET)/bin $(REALDRA)/bin $(NODE_DIR)/bin
