# The course's two commands.  `make lab` opens JupyterLab on the index; `make test` runs everything.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
PORT   ?= 8888
# JupyterLab refuses to run as root unless told; containers and CI machines often are root.
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test clean

# The stamps are newer than pyproject.toml while .venv is current; otherwise the course is reinstalled.
$(VENV)/.stamp-lab: pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py
	@touch $@

$(VENV)/.stamp-test: pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --extras test
	@touch $@ $(VENV)/.stamp-lab

# The course's own JupyterLab settings (scripts/jupyter/labconfig: no news or update pop-up over the
# notebook) come first on JUPYTER_CONFIG_PATH; the user's own Jupyter configuration is left untouched.
LAB_CONFIG := $(CURDIR)/scripts/jupyter$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH),)

# The lab serves the course's root (notebooks/ and exercises/ side by side in its file browser) and opens
# the index notebook, also from the URL it prints; `jupyter lab notebooks/index.ipynb` alone serves notebooks/ only.
LAB_ROOT := --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/notebooks/index.ipynb

lab: $(VENV)/.stamp-lab
	JUPYTER_CONFIG_PATH="$(LAB_CONFIG)" $(VPY) -m jupyter lab --port $(PORT) $(LAB_FLAGS) $(LAB_ROOT) notebooks/index.ipynb

test: $(VENV)/.stamp-test
	$(VPY) -m pytest -n $(or $(TEST_JOBS),2)
# On two workers (pytest-xdist): a test file runs on one of them, the longest files first (tests/parallel_run.py);
# `make test TEST_JOBS=0` runs everything in one process.
# Benchmarks, not tests: every speed benchmark against its peer, one table of ratios (benchmarks/bench.py); quick
# sizes (about a minute on 2 cores), `make bench FULL=1` each benchmark's own sizes (about three).  In test's block so
# that the student release's Makefile leaves it out with test (release.py's student_makefile): no benchmarks/ there.
.PHONY: bench
bench: $(VENV)/.stamp-test
	$(VPY) benchmarks/bench.py $(if $(filter-out 0 no false,$(FULL)),--full,)

clean:
	rm -rf $(VENV) .pytest_cache

# Teachers (see docs/teachers.md): the student release (no solution bodies) and the Gradescope bundle, each naming
# the version and commit it was built from; both refuse uncommitted changes in what they ship unless ALLOW_DIRTY=1.
# And the executed course as a static website in site/ (docs/website/build.py).
.PHONY: release autograder site
DIRTY_FLAG = $(if $(filter-out 0 no false,$(ALLOW_DIRTY)),--allow-dirty,)
release: $(VENV)/.stamp-test
	$(VPY) -m exercises.grading.release student --out release $(DIRTY_FLAG)

autograder: $(VENV)/.stamp-test
	$(VPY) -m exercises.grading.release autograder --out autograder $(DIRTY_FLAG)
# (no blank line above: the student release's Makefile leaves this block out, site and all; release.py's student_makefile)
# make site RELEASE=release/splitting-the-work reuses a release built already; ONLY="04b_pipeline_parallelism" builds
# the index and those lectures alone, for a quick look.
site: $(VENV)/.stamp-test
	$(VPY) docs/website/build.py --out site $(if $(RELEASE),--release $(RELEASE),) $(if $(ONLY),--only $(ONLY),)
