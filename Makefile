# Every target installs what it needs into .venv from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

TOOLS  := .venv-tools/.installed

# The real-kubelet fixture (tests/realkubelet): Go >= 1.26 and the kubernetes releases it builds.
GO             ?= go
REALKUBELET    := tests/realkubelet
KUBELET_NEW    := v1.37.2
KUBELET_OLDEST := v1.30.14
# "old" in the tests: the newest release without kubernetes PR 135437 (the stop grace's second kubelet).
KUBELET_OLD    := v1.36.5
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
# -tags kube_lt1NN (compat_*.go). make test builds and tests the newest and the oldest
# (KUBELET_QUICK: between them every code path of the device manager that differs between releases,
# and every compat file); make real-slow (so .ci/run) every release (KUBELET_RELEASES), and
# REALKUBELET_RELEASES=all runs the tests at all of them (docs/real-kubelet.md). go build only relinks
# what changed.
KUBELET_RELEASES := v1.30.14 v1.31.12 v1.32.9 v1.33.13 v1.34.4 v1.35.4 v1.36.5 v1.37.2
KUBELET_QUICK    := $(KUBELET_NEW) $(KUBELET_OLDEST)
# The others, newest first: the order real-slow builds them in (each shares most of its dependencies'
# versions with the one before it, so most of a build is found in the Go cache).
KUBELET_REST     := v1.36.5 v1.35.4 v1.34.4 v1.33.13 v1.32.9 v1.31.12
kubelet_minor = $(word 2,$(subst ., ,$(1)))
# The flags of release $(1) for a fixture whose API changes are at the minor releases $(2): its modfile,
# and kube_lt1NN for each change NN it predates.
release_flags = -modfile=$(if $(filter $(KUBELET_NEW),$(1)),go.mod,releases/go.1.$(call kubelet_minor,$(1)).mod) -tags=$(subst \
  $(space),$(comma),$(strip $(foreach t,$(2),$(if $(filter $(t),$(firstword $(sort $(t) $(call kubelet_minor,$(1))))),,kube_lt1$(t)))))
kubelet_flags = $(call release_flags,$(1),31 34 35 37)
comma := ,
space := $(eval) $(eval)
.PHONY: kubelet-fixtures kubelet-fixtures-all kubelet-fixture-new kubelet-fixture-old kubelet-fixture-oldest \
	kubelet-fixtures-check kubelet-fixtures-check-all FORCE
kubelet-fixtures: $(KUBELET_QUICK:%=$(REALKUBELET)/bin/realkubelet-%)
kubelet-fixtures-all: $(KUBELET_RELEASES:%=$(REALKUBELET)/bin/realkubelet-%)
kubelet-fixture-new: $(REALKUBELET)/bin/realkubelet-$(KUBELET_NEW)
kubelet-fixture-old: $(REALKUBELET)/bin/realkubelet-$(KUBELET_OLD)
kubelet-fixture-oldest: $(REALKUBELET)/bin/realkubelet-$(KUBELET_OLDEST)
$(REALKUBELET)/bin/realkubelet-%: FORCE
	cd $(REALKUBELET) && $(GO) build -buildvcs=false $(call kubelet_flags,$*) -o bin/realkubelet-$* .

# The DRA fixture (tests/realdra, docs/real-kubelet.md#dra) at the releases whose DRA kubelet plugin
# API (dra/v1) is GA, 1.34 on: go.mod pins the newest, releases/go.1.MINOR.mod the others, with
# -tags kube_lt136 / kube_lt137 (compat_*.go). make test builds v1.37.2 and v1.36.5 ("new" and "old" in
# its tests); make real-slow every one, and REALDRA_RELEASES=all runs the tests at all of them.
DRA_RELEASES := v1.34.4 v1.35.4 v1.36.5 v1.37.2
DRA_QUICK    := $(KUBELET_NEW) $(KUBELET_OLD)
DRA_REST     := v1.35.4 v1.34.4
dra_flags     = $(call release_flags,$(1),35 36 37)
.PHONY: dra-fixtures dra-fixtures-all dra-fixture-new dra-fixture-old dra-fixtures-check
dra-fixtures: $(DRA_QUICK:%=$(REALDRA)/bin/realdra-%)
dra-fixtures-all: $(DRA_RELEASES:%=$(REALDRA)/bin/realdra-%)
dra-fixture-new: $(REALDRA)/bin/realdra-$(KUBELET_NEW)
dra-fixture-old: $(REALDRA)/bin/realdra-$(KUBELET_OLD)
$(REALDRA)/bin/realdra-%: FORCE
	cd $(REALDRA) && $(GO) build -buildvcs=false $(call dra_flags,$*) -o bin/realdra-$* .

# gofmt, and go vet at the releases built (DRA_VETTED): v1.37.2 and v1.36.5 in make test, the others
# where real-slow builds them (a vet right after its release's build compiles nothing more).
DRA_VETTED ?= $(DRA_QUICK)
.PHONY: dra-vet
dra-fixtures-check: dra-vet
	cd $(REALDRA) && files="$$(gofmt -l .)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
dra-vet:
	cd $(REALDRA) && $(foreach v,$(DRA_VETTED),$(GO) vet $(call dra_flags,$(v)) ./... &&) true

# gofmt and go vet over the fixture's module, with the modfiles and tags of the releases make test builds:
# the newest and the oldest take every compat_*.go file between them (-all: every release's; a vet
# compiles its release when it was not built, about 5 minutes of CPU from empty caches).
KUBELET_VETTED ?= $(KUBELET_QUICK)
kubelet-fixtures-check-all: KUBELET_VETTED = $(KUBELET_RELEASES)
kubelet-fixtures-check-all: kubelet-fixtures-check
.PHONY: kubelet-vet
kubelet-fixtures-check: kubelet-vet
	cd $(REALKUBELET) && files="$$(gofmt -l .)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
	cd tests/fixturekit && files="$$(gofmt -l .)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
	cd tests/fixturekit && $(GO) vet ./...
	cd tests/node && files="$$(gofmt -l pause)" && test -z "$$files" || { echo "gofmt needed: $$files"; exit 1; }
	cd tests/node && $(GO) vet ./pause
kubelet-vet:
	cd $(REALKUBELET) && $(foreach v,$(KUBELET_VETTED),$(GO) vet $(call kubelet_flags,$(v)) ./... &&) true

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
	$(PY) -m bench.listener_race
	$(PY) -m bench.api_answers
	$(PY) -m bench.transition_log

soak: $(STAMP) ## random faults against the simulator, wrong verdicts counted
	$(PY) -m bench.soak

# Coverage-guided fuzzing (atheris): each fuzz/fuzz_<name>.py for FUZZ_SECONDS, seeded from fuzz/corpus/<name>/.
# Fails on an escaping exception or an input over 100 ms of CPU; the input goes to fuzz/crashes/.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP) ## coverage-guided fuzzing of every parser that reads the node
	$(PY) -m fuzz.run --seconds $(FUZZ_SECONDS)

# Slow real-kubelet checks, at every release (docs/testing.md#the-release-matrix): the kubelet's 5-minute
# stop grace (v1.37.2, v1.36.5 and the simulator); per device-manager release the differential test and
# the oracle (MATRIX_EVENTS events x MATRIX_SEEDS); per DRA release (1.34 on) the DRA scenarios and the
# DRA oracle; then the demos' tours against the real device manager and DRA manager. One make -j graph
# (REAL_SLOW_JOBS): the releases make test did not build are built one after another, niced
# (BUILD_NICE), beside the jobs that wait on the kubelets' clocks, and each release's tests start as
# soon as its fixture is built; -k: a release that fails does not stop the others' tests.
MATRIX_EVENTS  ?= 200
MATRIX_SEEDS   ?= 1,2
REAL_SLOW_JOBS ?= 12
BUILD_NICE     ?= nice -n 10
# The build chain, in this order: the stop grace's v1.36.5 first, then the DRA releases (their
# oracles, about 15 minutes a release, are the longest jobs), then the device managers, newest first
# (each release's tests take about 4 minutes).
MATRIX_CHAIN   := kubelet-v1.36.5 dra-v1.35.4 dra-v1.34.4 kubelet-v1.35.4 kubelet-v1.34.4 \
	kubelet-v1.33.13 kubelet-v1.32.9 kubelet-v1.31.12
.PHONY: real-slow stop-grace
real-slow: $(STAMP) kubelet-fixtures dra-fixtures ## the slow checks at every release: stop grace, differential, oracles, DRA
	$(MAKE) -k -j$(REAL_SLOW_JOBS) -Oline --no-print-directory stop-grace $(KUBELET_RELEASES:%=kubelet-matrix-%) \
		$(DRA_RELEASES:%=dra-matrix-%)
	DEMO_KUBELET=real DEMO_TOUR_ONLY=1 $(PY) -m testing.demo > /dev/null
	DEMO_KUBELET=dra DEMO_TOUR_ONLY=1 $(PY) -m testing.demo > /dev/null

stop-grace: $(STAMP) matrix-built-kubelet-$(KUBELET_OLD)
	$(PY) -m pytest -q -p no:cacheprovider -m slow tests/e2e/test_stop_grace.py

# matrix-built-<fixture>-<release>: built by make test's targets (KUBELET_QUICK, DRA_QUICK: nothing to do)
# or in MATRIX_CHAIN's order, each after the one before it, under BUILD_NICE. make test's vet of the
# quick releases covers every compat_*.go of the device-manager fixture; the DRA fixture's kube_lt136
# files are vetted here, at v1.34.4 (MATRIX_VETTED: a vet after its build still computes the analyzers'
# facts of every dependency, about a minute of CPU a release).
MATRIX_VETTED ?= dra-v1.34.4
.PHONY: $(KUBELET_RELEASES:%=matrix-built-kubelet-%) $(DRA_RELEASES:%=matrix-built-dra-%)
$(KUBELET_QUICK:%=matrix-built-kubelet-%) $(DRA_QUICK:%=matrix-built-dra-%):
	@true
matrix_target = $(if $(filter kubelet-%,$(1)),$(REALKUBELET)/bin/realkubelet-$(1:kubelet-%=%),$(REALDRA)/bin/realdra-$(1:dra-%=%)) \
	$(if $(filter $(1),$(MATRIX_VETTED)),$(if $(filter kubelet-%,$(1)),kubelet-vet KUBELET_VETTED=$(1:kubelet-%=%),dra-vet \
	DRA_VETTED=$(1:dra-%=%)))
define matrix_step
matrix-built-$(1): $(if $(2),| matrix-built-$(2))
	$$(BUILD_NICE) $$(MAKE) --no-print-directory $(call matrix_target,$(1))
endef
$(foreach i,$(shell seq $(words $(MATRIX_CHAIN))),$(eval $(call matrix_step,$(word $(i),$(MATRIX_CHAIN)),$(if \
	$(filter 1,$(i)),,$(word $(shell expr $(i) - 1),$(MATRIX_CHAIN))))))

# Every fixture build .ci/run makes, in its order, one a line (bench/fixture_builds.py measures them).
.PHONY: print-fixture-steps
print-fixture-steps:
	@printf '%s\n' $(KUBELET_QUICK:%=$(REALKUBELET)/bin/realkubelet-%) kubelet-vet $(DRA_QUICK:%=$(REALDRA)/bin/realdra-%) \
		dra-vet $(foreach c,$(MATRIX_CHAIN),'$(strip $(call matrix_target,$(c)))')

# One device-manager release: the fixture's scenarios (the rows of docs/kubelet.md#releases), the sidecar
# against it, the differential test (the simulator against it) and the oracle: about 40 s, then 70 s a seed.
MATRIX_TESTS := tests/test_realkubelet.py tests/e2e/test_real_kubelet.py tests/test_differential.py \
	tests/e2e/test_oracle.py
.PHONY: $(KUBELET_RELEASES:%=kubelet-matrix-%)
$(KUBELET_RELEASES:%=kubelet-matrix-%): kubelet-matrix-%: $(STAMP) matrix-built-kubelet-%
	REALKUBELET_RELEASES=$* ORACLE_EVENTS=$(MATRIX_EVENTS) ORACLE_SEEDS=$(MATRIX_SEEDS) \
		$(PY) -m pytest -q -s -p no:cacheprovider $(MATRIX_TESTS)

# One DRA release: the DRA fixture's scenarios and the DRA oracle (MATRIX_EVENTS x MATRIX_SEEDS, about
# 7 minutes a seed: 14.5 minutes a release with two, most of it waiting).
.PHONY: $(DRA_RELEASES:%=dra-matrix-%)
$(DRA_RELEASES:%=dra-matrix-%): dra-matrix-%: $(STAMP) matrix-built-dra-%
	REALDRA_RELEASES=$* ORACLE_EVENTS=$(MATRIX_EVENTS) ORACLE_SEEDS=$(MATRIX_SEEDS) \
		$(PY) -m pytest -q -s -p no:cacheprovider -m slow tests/test_realdra.py tests/e2e/test_dra_oracle.py

# The node's ResourceSlices as DRA evidence against a real API server (tests/e2e/test_dra_slices.py):
# kube-apiserver from make node-bins and Debian's etcd-server; .ci/run runs it after node-bins.
.PHONY: dra-slices
dra-slices: $(STAMP) dra-fixture-new $(NODE_DIR)/bin/kube-apiserver
	$(PY) -m pytest -q -m slow tests/e2e/test_dra_slices.py

# HAMi's own registration against a real API server (tests/e2e/test_hami_registration.py): HAMi-shaped
# writers of the Node's annotations (tests/hamifixture.py), and every vendor's stand-in writing its own
# (tests/test_standin.py); kube-apiserver from make node-bins, Debian's etcd.
.PHONY: hami-registration
hami-registration: $(STAMP) $(NODE_DIR)/bin/kube-apiserver ## HAMi's registration against a real API server
	$(PY) -m pytest -q -m slow tests/e2e/test_hami_registration.py tests/test_standin.py

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
manifests: profiles helm-binaries ## regenerate manifests/example-hami/hami.yaml and the profiles' copy
	$(HELM_BIN)/helm-$(HELM3_VERSION) template hami tests/fixtures/hami-chart --namespace kube-system \
		--kube-version 1.33.0 > manifests/example-hami/hami.yaml

# The vendor profiles (hami_guard/profiles/*.toml) as JSON for the post-renderer, which runs with python3 and
# PyYAML alone and cannot import the package, and each vendor's kustomize component written from it
# (tests/test_profiles.py checks the committed copies are current); then what the monitoring and the
# NetworkPolicies take from the profiles: the alerts' generated regions, manifests/network-policy and the
# dashboard (tests/test_monitoring.py checks them).
.PHONY: profiles
profiles: $(STAMP) ## regenerate everything written from the vendor profiles
	$(PY) -m hami_guard.profiles > manifests/hami-patch/profiles.json
	rm -rf manifests/hami-patch/vendors
	$(PY) manifests/hami-patch/render.py components manifests/hami-patch/vendors
	$(PY) -m manifests.monitoring.vendors
	$(PY) -m manifests.monitoring.dashboard

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

# Re-pin the sidecar image's dependencies (requirements/sidecar.txt) from a clean install of the project.
# requirements/init.txt pins nothing: initcheck imports the standard library alone (tests/test_images.py).
lock: ## re-pin the images' dependencies
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install --quiet .
	{ head -2 requirements/sidecar.txt; .venv-lock/bin/pip freeze --exclude hami-guard; } > requirements/sidecar.txt.new
	mv requirements/sidecar.txt.new requirements/sidecar.txt
	rm -rf .venv-lock

clean: ## remove the venvs, caches and built fixtures
	rm -rf $(VENV) .venv-tools .venv-aiohttp-oldest .venv-aiohttp-newest build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(REALKUBELET)/bin $(REALDRA)/bin $(NODE_DIR)/bin
