# cachefs: one command to install and mount a demo, one to install and run the tests.
#   sudo make demo    install everything, mount a demo over an emulated slow disk
#   sudo make test    install everything, run the full test suite
PYTHON ?= python3
export PIP_BREAK_SYSTEM_PACKAGES = 1
export PIP_ROOT_USER_ACTION = ignore
DEB_PACKAGES = fuse3 libfuse3-dev pkg-config fio gcc python3-dev python3-pip python3-venv systemd \
	dpkg-dev patch debian-archive-keyring rsync acl libxxhash-dev btrfs-progs

.PHONY: install deps demo demo-stop test bench bench-quick

deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# The Python package, then FUSE passthrough (deps/passthrough: libfuse 3.17 in a private prefix and
# pyfuse3 with the passthrough patch, replacing the stock pyfuse3). When that build cannot run
# here, the stock pyfuse3 stays and cachefs runs without passthrough (it logs why).
# The package is installed editable: nothing compiles its bytecode, and where
# PYTHONDONTWRITEBYTECODE is set (as on these machines) every daemon start compiled all of
# cachefs again (~0.2-0.3 s of CPU each; the suite starts about a thousand).
install: deps
	$(PYTHON) -m pip install -q -e '.[test,bench]'
	$(PYTHON) -m compileall -q cachefs cli bench tests
	@bash deps/passthrough/build.sh --python "$$(command -v $(PYTHON))" \
	  || echo "make: the FUSE passthrough build failed (above); cachefs will run without passthrough."
	@scripts=$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))'); \
	if [ -w /usr/sbin ] && [ -x "$$scripts/mount.cachefs" ]; then \
	  ln -sf "$$scripts/mount.cachefs" /usr/sbin/mount.cachefs; \
	  ln -sf "$$scripts/mount.cachefs" /usr/sbin/mount.fuse.cachefs; fi

demo: install
	PYTHON=$(PYTHON) bash bench/demo.sh

demo-stop:
	PYTHON=$(PYTHON) bash bench/demo.sh stop

# Three workers on two cores: the mount tests mostly wait (on FUSE round trips, promotions,
# destages, daemons starting and stopping), so the suite runs in about half the time.
test: install
	$(PYTHON) -m pytest -q -n 3 --durations=15

bench-quick: install
	$(PYTHON) bench/run.py --quick

bench: install
	$(PYTHON) bench/run.py
